"""Making EAGLE heads: data, features, the trainable head, losses and the training loop.

Nothing here is imported by the serving plugin; it needs torch and transformers, not vLLM.
``scripts/train_eagle_head.py`` is the command line; the pipeline it runs is described in
:mod:`vllm_eagle2_tools.training.recipe`.

- ``conversations``: ShareGPT and distilled conversations as token ids plus assistant-reply masks.
- ``replies``: the committed distilled replies: format, manifest, slices.
- ``generate``: filling slices with the target's greedy replies (``scripts/generate_replies.py``).
- ``features``: the target's frozen tensors and the content-addressed feature shards.
- ``head``: the trainable EAGLE head; build, load and export in vLLM's ``eagle`` format.
- ``eagle3_head``: the trainable EAGLE-3 head (``--format eagle3``); build, load, vLLM's ``eagle3`` format.
- ``loss``: packed batches and the EAGLE loss (regression plus CE, per drafting depth; EAGLE-3: CE
  over the head's draft vocabulary).
- ``loop``: epoch plans, shard streaming, held-out evaluation, the training loop with checkpoints.
- ``recipe`` / ``cli``: the whole run (data, features, training, export, ``training.json``) and its options.
"""

from __future__ import annotations

from vllm_eagle2_tools.progress import stderr_log

log = stderr_log("train_eagle_head")
