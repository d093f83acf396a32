"""Tensor-parallel ranks that decide alike.

Under tensor parallelism every rank of the last pipeline stage runs the drafter and the verifier,
and every head pass and target pass runs collectives. So every choice that shapes a step (the
plan's levels, the nodes sent per request, whether lookup chains go alone, the calibration's
passes) must be the same on every rank; a rank that decided from its own clock paired later
collectives with the wrong ones (wrong output from the first token, or a hang).

The budget's only rank-local input is time. :func:`rank_agreement` gives it rank 0's timings:
one broadcast of a small host vector per step (and one per calibration pass), over the group's
CPU channel, so no device sync. Everything else the decisions read is the same on every rank
already: host state from the scheduler's output, and device state computed from logits that vLLM
itself keeps identical across ranks (each rank samples its own tokens from them).
"""

from __future__ import annotations

import numpy as np
import torch

from vllm_eagle2.budget.costs import Agree, same_everywhere


def rank_agreement() -> Agree:
    """The tensor-parallel group's :data:`~vllm_eagle2.budget.costs.Agree`: rank 0's values on
    every rank; :func:`~vllm_eagle2.budget.costs.same_everywhere` with one rank."""
    from vllm.distributed import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return same_everywhere
    group = parallel_state.get_tp_group()
    if group.world_size == 1:
        return same_everywhere

    def agree(values: np.ndarray) -> np.ndarray:
        shared = torch.from_numpy(np.array(values, dtype=np.float64))
        torch.distributed.broadcast(shared, src=group.ranks[0], group=group.cpu_group)
        return shared.numpy()

    return agree
