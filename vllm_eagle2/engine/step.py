"""One eagle2 step inside vLLM's model runner, in the order it runs; its state is :class:`Eagle2Step`.

vLLM 0.32 runs a step in two calls of the model runner, ``execute_model`` (inputs, target forward)
and ``sample_tokens`` (sampling, then the drafter). Each hook of
:mod:`vllm_eagle2.patches.model_runner` calls one function below, and each takes the step's state
explicitly. What outlives a step is the drafter's: the trees it proposed (``drafter.proposed``),
the catch-up rows waiting, the budget's prices and acceptance, the lookup chains' indexes.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch

from vllm_eagle2.engine import attention, verification
from vllm_eagle2.engine.step_state import Eagle2Step

if TYPE_CHECKING:  # vLLM 0.32's own types, as its model runner passes them
    from vllm.v1.attention.backend import CommonAttentionMetadata
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import DraftTokenIds, SamplerOutput
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

__all__ = ["Eagle2Step", "begin", "draft", "drafts_sent", "keep_hidden_rows", "prepare", "sample", "started"]


@contextmanager
def begin(runner: GPUModelRunner) -> Iterator[Eagle2Step]:
    """1. ``execute_model``: the step opens, and with it the target forward's tree-attention scope
    (``step.forward``: the masks :func:`prepare` publishes)."""
    step = runner._eagle2_step = Eagle2Step()
    with attention.tree_batch() as step.forward:
        yield step


def started(runner: GPUModelRunner, step: Eagle2Step, scheduler_output: SchedulerOutput) -> None:
    """2. ``_prepare_inputs``, before vLLM's: the budget learns from the step before, and this step's
    record opens (``step.times``: its scheduled tokens, prompt chunks apart, as their pass is not
    the decoding pass the plans price; whether it verifies drafts; the context its rows read),
    which the step fills as it runs (:meth:`~vllm_eagle2.budget.adaptive.AdaptiveBudget.learn`)."""
    budget = runner.drafter.budget
    if budget is not None:
        total = scheduler_output.total_num_scheduled_tokens
        requests = len(scheduler_output.num_scheduled_tokens)
        drafts = sum(len(d) for d in scheduler_output.scheduled_spec_decode_tokens.values())
        prompt = total - requests - drafts
        # What each row reads: the context its request held before the step, and the step's.
        held = runner.input_batch.num_computed_tokens_cpu[:requests]
        context = float(held.mean()) + total / requests if requests else 0.0
        step.times = budget.learn(total, prompt, verifies=drafts > 0, context=context)


def prepare(runner: GPUModelRunner, step: Eagle2Step, spec_meta: SpecDecodeMetadata | None) -> None:
    """3. ``_prepare_inputs``, after vLLM's: the scheduled drafts matched to the trees proposed last
    step, every node at its RoPE position, the masks published (``step.verify``; None without
    drafts). The target forward follows: in each attention layer the tree rows attend through
    their masks (:mod:`.attention`)."""
    verification.prepare_tree_verification(runner, step, spec_meta)


def keep_hidden_rows(runner: GPUModelRunner, step: Eagle2Step) -> None:
    """4. ``sample_tokens`` opens: the target's hidden-state rows (an EAGLE-3 head's auxiliary ones
    too) that the drafter's catch-up pass reads, and that verification reorders
    (``step.hidden_states``)."""
    state = getattr(runner, "execute_model_state", None)  # None where execute_model returned early
    rows = [getattr(state, "hidden_states", None), *(getattr(state, "aux_hidden_states", None) or [])]
    step.hidden_states = [h for h in rows if h is not None]


def sample(
    runner: GPUModelRunner, step: Eagle2Step, logits: torch.Tensor, spec_meta: SpecDecodeMetadata
) -> SamplerOutput:
    """5. ``_sample``: every tree verified (:mod:`vllm_eagle2.verify`), the accepted nodes' K/V and
    rows moved into chain order, acceptance recorded; vLLM's ``SamplerOutput``."""
    return verification.sample_with_trees(runner, step, logits, spec_meta)


def draft(
    runner: GPUModelRunner,
    step: Eagle2Step,
    sampled: torch.Tensor | list[list[int]],
    cad: CommonAttentionMetadata | None,
    limit: int,
) -> list[list[int]] | None:
    """6. ``propose_draft_token_ids``: the drafter chooses the next step's drafting
    (:meth:`~.proposer.Eagle2Proposer.begin_step`: ``step.draft``). Without head levels the step may
    end here, its catch-up rows waiting (the drafts returned: none, or lookup chains). Else None,
    and vLLM calls the drafter's ``propose``: the catch-up pass, the tree, the drafts sent; the trees
    stay with the drafter for the next step's :func:`prepare`."""
    step.drafted = True
    return runner.drafter.begin_step(runner.input_batch.num_reqs, sampled, step, cad, limit)


def drafts_sent(
    runner: GPUModelRunner, step: Eagle2Step, drafts: DraftTokenIds | None
) -> DraftTokenIds | None:
    """7. ``sample_tokens`` returns (and the step closes): its drafts go with its output (vLLM's
    ``DraftTokenIds``). Where the drafter did not run (vLLM zero-filled its drafts), none are sent
    and no trees are kept."""
    if step.drafted or drafts is None:
        return drafts
    runner.drafter.proposed = None
    return type(drafts)(drafts.req_ids, [[] for _ in drafts.req_ids])
