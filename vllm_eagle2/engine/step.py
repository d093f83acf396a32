"""One eagle2 step inside vLLM's model runner, and the one object that carries it.

vLLM 0.32 runs a step in two calls of the model runner, ``execute_model`` (inputs, target
forward) and ``sample_tokens`` (sampling, then drafting for the next step). With eagle2 a step
goes (hooks in :mod:`vllm_eagle2.patches.model_runner`, work in this package):

1. ``execute_model`` opens the step: ``runner._eagle2_step = Eagle2Step()``, and the target
   forward's tree attention scope (:func:`.attention.tree_batch`) as ``step.forward``.
2. ``_prepare_inputs``: the budget starts its step timer; a step without drafts gets plain
   decoding's inputs; :func:`.verification.prepare_tree_verification` matches the scheduled
   drafts to the trees the drafter proposed last step (``drafter.proposed``), gives every node
   its RoPE position and publishes the tree masks into ``step.forward`` (``step.verify``).
3. The target forward: each attention layer (:mod:`.attention`) recomputes the tree rows with
   their masks and keeps a copy of their fresh K/V (``step.forward.kept_kv``).
4. ``sample_tokens`` records the hidden-state rows the drafter's catch-up pass will read
   (``step.hidden_states``); vLLM's ``_sample`` becomes
   :func:`.verification.sample_with_trees`: verify every tree (:mod:`vllm_eagle2.verify`), move
   the accepted nodes' K/V and rows into chain order, record acceptance for the budget.
5. ``propose_draft_token_ids`` lets the budget plan the next step
   (:meth:`.proposer.Eagle2Proposer.begin_step`). A plan without head drafts ends there: the
   step's catch-up rows wait (:mod:`.catch_up`) and its drafts are none or lookup chains alone.
   Else vLLM calls the drafter's ``propose``: the waiting rows and the catch-up pass, the
   expansion levels (:mod:`.expansion`), the best m nodes per request, kept in
   ``drafter.proposed`` for the next step's step 2.
6. ``sample_tokens`` returns with the drafts and closes the step (``runner._eagle2_step = None``).

Everything that lives for one step is on the :class:`Eagle2Step`; what outlives it is the
drafter's (``proposed`` trees, the catch-up rows waiting, the budget's measurements, counters).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from vllm_eagle2.engine.attention import TreeForward
    from vllm_eagle2.engine.verification import VerifyStep


@dataclass
class Eagle2Step:
    """The state of one eagle2 step, owned by the model runner (``runner._eagle2_step``).

    forward: the target forward's tree attention: the masks the verifier publishes, the K/V
        the layers keep (set when the ``tree_batch`` scope opens; it outlives the scope).
    verify: the trees this step verifies; None = no drafts were scheduled.
    hidden_states: the target's hidden-state rows (and an EAGLE-3 head's auxiliary ones),
        [T, H] each, that the drafter's catch-up pass reads; the verifier reorders their rows
        like the accepted tokens.
    drafted: the drafter ran this step (else vLLM's drafts are zero-filled, and none are sent).
    """

    forward: TreeForward | None = None
    verify: VerifyStep | None = None
    hidden_states: list[torch.Tensor] = field(default_factory=list)
    drafted: bool = False


@dataclass
class ProposedTrees:
    """The trees proposed last step, for the verifier of this step.

    req_ids: request ids, in the batch order of the proposing step.
    tokens / parents / ranks: [B, N] int64, scores: [B, N] float32, grafted: [B, N] bool (see
    :class:`vllm_eagle2.tree.DraftTree`; tokens are target token ids).
    lookup_buckets: [B] int64, the match-length bucket of each request's lookup chain (-1 = none;
        all -1 without lookup chains).
    off_chain: [B, M] bool on the host, M <= N: the drafts sent that are off their tree's
        leading chain (:func:`vllm_eagle2.tree.off_leading_chain`), the only ones whose
        verification needs a tree mask. It came with the drafts' own transfer, so the verifier
        sizes its tree attention without reading the device.
    """

    req_ids: list[str]
    tokens: torch.Tensor
    parents: torch.Tensor
    ranks: torch.Tensor
    scores: torch.Tensor
    grafted: torch.Tensor
    lookup_buckets: torch.Tensor
    off_chain: np.ndarray
