"""Lossless verification of draft trees against the target's logits; no vLLM here.

* :mod:`.paths`: tree structure on the device: ancestor tables, path sums, sibling groups,
  the accepted path.
* :mod:`.logits`: what the rule reads from the target's logits: greedy choices, filtered
  probabilities (temperature, top-k, top-p).
* :mod:`.verifier`: the acceptance rule itself (greedy match, or EAGLE's recursive rejection
  sampling over siblings) and :func:`verify_tree`, one call for a batch of mixed requests.
"""

from vllm_eagle2.verify.paths import VerifyResult
from vllm_eagle2.verify.verifier import verify_tree

__all__ = ["VerifyResult", "verify_tree"]
