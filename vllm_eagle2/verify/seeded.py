"""Position-keyed seeded sampling: a seeded request's token at output position ``k`` is drawn with
noise that depends on (seed, k) alone, whatever its drafts, its tree or the batch. No vLLM here.

Every position has its own generator, seeded :func:`mix` (seed, k). In a step without drafts, and
at the root of a tree, the engine re-seeds the request's own generator with it before vLLM's sampler
draws token ``k``. In a tree, every node row (the target's distribution after a node ``d`` deep,
which decides token ``k + d``) is sampled by the same sampler with a fresh generator seeded
mix(seed, k + d): siblings share it, as only one of them can be on the accepted path.
:func:`node_choices` gathers these samples (the target's *choice* at every row), which
:func:`vllm_eagle2.verify.verifier.verify_tree` then matches the drafts against
("sample-match"). The token emitted at position ``k + d`` is therefore the sampler's function of
(seed, k + d) and the logits of the accepted prefix: the same as in a step without drafts.

Cost: one sampler row (a pass over the vocabulary) per node of a seeded request, and a generator
made and seeded per node, in a Python loop over the seeded requests' nodes only (as vLLM's own
sampler loops over its seeded rows). Measured with vLLM 0.32's CPU sampler on 2 cores, one seeded
request with 60 nodes over a 49,152-token vocabulary (SmolLM2's): 15 ms per step at temperature 1,
165 ms with top-k 50 and top-p 0.9 (vLLM's CPU top-p sorts every row), where the rejection path's
whole ``verify_tree`` of that request took 4-5 ms.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from vllm_eagle2.device import to_device

__all__ = ["SeededRows", "mix", "node_choices", "position_generator"]

_GAMMA = 0x9E3779B97F4A7C15  # SplitMix64's increment (2**64 / golden ratio)
_MASK64 = (1 << 64) - 1

#: vLLM's sampler (temperature, then top-k / top-p, then a per-row generator draw):
#: ``sample(logits [M, V] float32, temperature [M], generators {row: generator}, top_k [M] or None,
#: top_p [M] or None)`` -> [M] sampled token ids. It may write into ``logits``.
Sampler = Callable[
    [torch.Tensor, torch.Tensor, dict[int, torch.Generator], torch.Tensor | None, torch.Tensor | None],
    torch.Tensor,
]


def mix(seed: int, position: int) -> int:
    """The generator seed of output position ``position`` (>= 0) of a request seeded ``seed``.

    Output ``position`` of SplitMix64 started at ``seed`` (mod 2**64), shifted to 63 bits: a
    nonnegative int that every torch generator accepts. Distinct positions of one seed, and the
    same position of nearby seeds, get unrelated values.
    """
    z = (seed + (position + 1) * _GAMMA) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


def position_generator(seed: int, position: int, device: torch.device) -> torch.Generator:
    """A fresh generator on ``device`` for output ``position`` of a request seeded ``seed``."""
    return torch.Generator(device=device).manual_seed(mix(seed, position))


@dataclass(frozen=True)
class SeededRows:
    """The seeded requests of a step that verify drafts, all on the host.

    rows: their batch rows; seeds: their seeds; positions: the output position each one's root
    samples this step (its number of output tokens so far); depths: per request, the depth of each
    of its drafts in order (a root child is 1 deep), one entry per draft.
    """

    rows: Sequence[int]
    seeds: Sequence[int]
    positions: Sequence[int]
    depths: Sequence[Sequence[int]]


def node_choices(
    logits: torch.Tensor,
    seeded: SeededRows,
    root: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    sample: Sampler,
) -> torch.Tensor:
    """The target's choice at every row of the seeded trees, [B, N + 1] int64 (-1 elsewhere).

    logits: [B, N + 1, V], row 0 after the root, row ``i + 1`` after node ``i`` (as
    :func:`~vllm_eagle2.verify.verifier.verify_tree` reads them); root: [B] the sampler's own
    sample at each root, taken as column 0 (its generator was seeded mix(seed, k) before it drew);
    temperature / top_k / top_p: [B] per request. Node ``i`` of request ``r``, ``d`` deep, is
    sampled with a generator seeded mix(seed, k + d), every node row in one call of ``sample``.
    No host read: the rows and seeds come from the host.
    """
    batch, width, _ = logits.shape
    device = logits.device
    choices = torch.full((batch, width), -1, dtype=torch.long, device=device)
    if not seeded.rows:
        return choices
    rows = to_device(list(seeded.rows), device, torch.long)
    choices[rows, 0] = root.to(device).long()[rows]
    req, col, generators = [], [], {}
    for r, seed, k, depths in zip(seeded.rows, seeded.seeds, seeded.positions, seeded.depths):
        for i, depth in enumerate(depths):  # Python loop over the seeded node rows only
            generators[len(req)] = position_generator(seed, k + depth, device)
            req.append(r)
            col.append(i + 1)
    if not req:
        return choices
    req_t = to_device(req, device, torch.long)
    col_t = to_device(col, device, torch.long)
    node_logits = logits[req_t, col_t].float()  # a copy: the sampler may write into it
    picked = sample(
        node_logits,
        temperature[req_t],
        generators,
        None if top_k is None else top_k[req_t],
        None if top_p is None else top_p[req_t],
    )
    choices[req_t, col_t] = picked.long()
    return choices
