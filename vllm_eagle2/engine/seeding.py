"""Seeded requests in an eagle2 engine: position-keyed sampling (:mod:`vllm_eagle2.verify.seeded`)
inside vLLM's model runner, so that a seeded request samples the same tokens whatever its drafts.

* :func:`reseed`, every step before sampling: each seeded request's generator is seeded
  mix(seed, k), ``k`` its output tokens so far. vLLM's sampler then draws token ``k`` (in a step
  without drafts, and at the root of a tree) from a state that depends on (seed, k) alone.
* :func:`seeded_choices`, in a step with drafts: vLLM's own sampler at every node row of the
  seeded requests' trees, each row with a generator of its output position; the verifier matches
  the drafts against these choices.

vLLM schedules eagle2 synchronously, so a request's output tokens are all known at sampling.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from vllm_eagle2.verify.seeded import SeededRows, mix, node_choices

if TYPE_CHECKING:
    from vllm.v1.sample.metadata import SamplingMetadata
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from vllm_eagle2.engine.step_state import ProposedTrees

__all__ = ["reseed", "seeded_choices", "seeded_rows"]


def _seed_and_position(runner: GPUModelRunner, row: int) -> tuple[int | None, int]:
    """The seed of the request at batch ``row`` and the output position its root samples now."""
    state = runner.requests[runner.input_batch.req_ids[row]]
    return state.sampling_params.seed, len(state.output_token_ids)


def reseed(runner: GPUModelRunner) -> None:
    """Seed every seeded request's generator mix(seed, k) for the token ``k`` sampled this step
    (a partial prefill's discarded sample too: its generator is put back after, as before)."""
    for row, generator in runner.input_batch.generators.items():
        seed, k = _seed_and_position(runner, row)
        if seed is not None:
            generator.manual_seed(mix(seed, k))


def _draft_depths(store: ProposedTrees | None, src: int | None, drafts: list[int]) -> list[int]:
    """The depth of each of a request's drafts: its stored tree's where the drafts are a prefix of
    those sent from row ``src`` of ``store`` (the proposing step's), else a chain's (1, 2, ...).

    The same match as :func:`vllm_eagle2.engine.verification._matched_trees` makes on the
    device, made here on the host copies that came with the drafts' transfer: no device read.
    """
    n = len(drafts)
    if store is not None and src is not None and n <= store.sent_tokens.shape[1]:
        if store.sent_tokens[src, :n].tolist() == drafts:
            return store.sent_depths[src, :n].tolist()
    return list(range(1, n + 1))


def seeded_rows(runner: GPUModelRunner, counts: list[int]) -> SeededRows:
    """The seeded requests that verify drafts this step (``counts``: [B] drafts scheduled, host),
    with their seeds, output positions and drafts' depths, all from the host."""
    generators = runner.input_batch.generators
    rows = [r for r in sorted(generators) if r < len(counts) and counts[r] > 0]
    store = runner.drafter.proposed
    src_of = {rid: i for i, rid in enumerate(store.req_ids)} if store is not None and rows else {}
    req_ids = runner.input_batch.req_ids
    seeds, positions, depths = [], [], []
    for r in rows:
        seed, k = _seed_and_position(runner, r)
        drafts = list(runner.input_batch.spec_token_ids[r][: counts[r]])
        seeds.append(seed)
        positions.append(k)
        depths.append(_draft_depths(store, src_of.get(req_ids[r]), drafts))
    return SeededRows(rows=rows, seeds=seeds, positions=positions, depths=depths)


def seeded_choices(
    runner: GPUModelRunner,
    seeded: SeededRows,
    logits: torch.Tensor,
    root: torch.Tensor,
    sampling: SamplingMetadata,
) -> torch.Tensor:
    """[B, N + 1] int64: vLLM's sample at every row of the ``seeded`` trees (-1 in other rows).

    logits: [B, N + 1, V], the trees' rows as the verifier reads them; root: [B], vLLM's sample at
    each root this step (drawn after :func:`reseed`), the seeded rows' column 0. Each node row is
    sampled as vLLM's ``Sampler.sample`` samples a row: the temperature divided in
    (``apply_temperature``), then ``topk_topp_sampler`` with the row's own generator. Requests with
    drafts apply no logits processor (:mod:`.eligibility`), so these steps are all vLLM's sampler
    does to their rows.
    """
    sampler = runner.sampler

    def sample(rows, temperature, generators, top_k, top_p):
        rows = sampler.apply_temperature(rows, temperature, all_random=True)
        return sampler.topk_topp_sampler(rows, generators, top_k, top_p)[0]

    return node_choices(logits, seeded, root, sampling.temperature, sampling.top_k, sampling.top_p, sample)
