"""Lookup chains in the engine: each request's text indexed, its chain found, valued, and learned.

Only with ``speculative_config.lookup`` > 0 (the chain length L). Per step:

* :meth:`LookupDrafts.copy_sampled` (before the budget plans): this step's sampled tokens, which
  vLLM has on the device only until its bookkeeping, start their copy to the host.
* :meth:`LookupDrafts.chains` (when the step chooses its drafting): each request's
  :class:`~vllm_eagle2.lookup.SuffixIndex` takes its new tokens (the runner's host copy of its
  text, then this step's), and gives the continuation of its longest repeated suffix. A chain's
  value at position i is the summed log of the acceptance rate learned for chains of its match
  length at positions 0..i: the tree (:mod:`vllm_eagle2.graft`) weighs it against the head's nodes.
  :meth:`StepChains.reach` gives the same chains as acceptance probabilities by position (host,
  from the rates of the step before), for the budget's choice to leave the head's levels unrun.
* :meth:`LookupDrafts.record` (in verification): per match-length bucket and chain position,
  how often a grafted node was reached (its parent accepted) and accepted; discounted each step.

The host part (indexes, matching) is a loop over the batch's requests, as vLLM's own n-gram
drafter is: a request's text lives on the host. Everything after it is batched on the device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from vllm_eagle2.budget.acceptance import DISCOUNT
from vllm_eagle2.device import to_device
from vllm_eagle2.graft import LookupChains
from vllm_eagle2.lookup import OutputCache, SuffixIndex
from vllm_eagle2.verify.paths import accepted_and_reached

if TYPE_CHECKING:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

#: Chains are valued by the length of the match they continue: bucket i holds matches of at least
#: ``MATCH_BUCKETS[i]`` tokens (and fewer than the next bound).
MATCH_BUCKETS = (1, 2, 4, 8, 16)
#: Before any verification a chain position of each bucket is assumed accepted (its parent accepted)
#: at these rates, worth ``PRIOR_TRIALS`` trials: longer matches are likelier to go on.
PRIOR_RATES = (0.3, 0.5, 0.7, 0.8, 0.9)
PRIOR_TRIALS = 2.0
#: A step whose head drafts nothing sends only chains of this bucket or above (matches of 8+
#: tokens). Measured on MT-bench at batch 16 with every chain allowed (matches there are mostly
#: 1-3 tokens): 0.85x no speculation against 0.94x without lookup chains.
ALONE_MIN_BUCKET = 3
#: ``0`` keeps the head's levels beside every chain (the budget never lets confident chains go alone):
#: what that choice is worth, for the benchmark's ``lookup_head`` row.
HEAD_SKIP_ENV = "VLLM_EAGLE2_HEAD_SKIP"
#: The request's last tokens looked up in the output cache: a match longer than the top bucket's
#: bound values no differently.
CACHE_QUERY = 2 * MATCH_BUCKETS[-1]


@dataclass(frozen=True)
class SampledCopy:
    """A step's sampled tokens [B, W] (-1 = none) on the host, once ``event`` (CUDA) has passed."""

    host: torch.Tensor
    event: Any


@dataclass(frozen=True)
class StepChains:
    """This step's lookup chains. chains: [B, L] (:class:`~vllm_eagle2.graft.LookupChains`);
    buckets: [B] int64 on the device, each chain's match-length bucket (-1 = none); rates: [B, L]
    host, the learnt acceptance rate of each chain position (up to the step before); lengths: [B]
    host, each chain's tokens."""

    chains: LookupChains
    buckets: torch.Tensor
    rates: np.ndarray
    lengths: np.ndarray

    def reach(self, max_nodes: int) -> np.ndarray:
        """[B, <= max_nodes] host: the probability that each chain position is accepted with its
        ancestors, 0 past a chain's end."""
        rates = self.rates[:, :max_nodes]
        within = np.arange(rates.shape[1]) < self.lengths[:, None]
        return np.cumprod(np.where(within, rates, 0.0), axis=1)


class LookupDrafts:
    """The lookup chains of one engine's requests (L = ``length`` tokens each at most)."""

    def __init__(self, length: int, device: torch.device, cache_tokens: int = 0) -> None:
        self.length = length
        self.device = device
        self._indexes: dict[str, SuffixIndex] = {}
        self._seen: dict[str, int] = {}  # tokens of each request's text its index has taken
        self._prompt_len: dict[str, int] = {}
        self.cache = OutputCache(cache_tokens) if cache_tokens else None
        self.cache_chains = 0  # chains taken from the cache (host count)
        # [2, buckets, L]: discounted trials and acceptances of grafted nodes.
        self.stats = torch.zeros(2, len(MATCH_BUCKETS), length, device=device)
        self._prior = torch.tensor(PRIOR_RATES, device=device).unsqueeze(1)  # [buckets, 1]
        # The learnt rates on the host, [buckets, L], copied each step: the host prices a step's
        # chains with the step before's, whose copy has landed with that step's sync.
        self._rates_host = torch.tensor(PRIOR_RATES).unsqueeze(1).repeat(1, length)
        if device.type == "cuda":
            self._rates_host = self._rates_host.pin_memory()
        self.sent = torch.zeros((), dtype=torch.long, device=device)  # grafted drafts verified
        self.accepted = torch.zeros((), dtype=torch.long, device=device)  # of them accepted

    def forget(self, req_ids: set[str]) -> None:
        """Drop finished requests; with a cache, keep their outputs (as far as their index holds them)."""
        for rid in req_ids:
            index, seen = self._indexes.pop(rid, None), self._seen.pop(rid, 0)
            prompt_len = self._prompt_len.pop(rid, seen)
            if self.cache is not None and index is not None:
                self.cache.add(index.tail(min(seen - prompt_len, len(index))))

    def copy_sampled(self, sampled: torch.Tensor | list[list[int]]) -> SampledCopy | None:
        """This step's sampled tokens on their way to the host: a device tensor [B, W] (-1 = none)
        whose copy starts now, or None where vLLM has already written host lists into the runner's
        text (nothing to add)."""
        if not isinstance(sampled, torch.Tensor):
            return None
        if not sampled.is_cuda:
            return SampledCopy(sampled, None)
        host = torch.empty(sampled.shape, dtype=sampled.dtype, pin_memory=True)
        host.copy_(sampled, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return SampledCopy(host, event)

    def chains(
        self, runner: GPUModelRunner, req_ids: list[str], sampled: SampledCopy | None, min_bucket: int = 0
    ) -> StepChains | None:
        """Each request's chain, after its index takes the step's ``sampled`` tokens; None when no
        request has one. Chains of a bucket below ``min_bucket`` are dropped (the requests' indexes
        still take every token)."""
        if sampled is not None and sampled.event is not None:
            sampled.event.synchronize()
        new_tokens = sampled.host.numpy() if sampled is not None else None
        tokens, buckets, found = self._extend_and_match(runner, req_ids, new_tokens)
        found &= buckets >= min_bucket
        if not found.any():
            return None
        buckets[~found] = -1
        tokens[~found] = -1
        tokens_d, buckets_d = to_device(tokens, self.device), to_device(buckets, self.device)
        trials, accepted = self.stats
        rate = (accepted + self._prior * PRIOR_TRIALS) / (trials + PRIOR_TRIALS)
        rates = self._rates_host.numpy()[buckets.clip(min=0)]  # learnt up to the step before
        self._rates_host.copy_(rate, non_blocking=True)
        log_rate = torch.log(rate)
        values = log_rate[buckets_d.clamp(min=0)].cumsum(1)
        values = torch.where((tokens_d >= 0) & (buckets_d >= 0).unsqueeze(1), values, float("-inf"))
        chains = LookupChains(torch.where(values > float("-inf"), tokens_d, -1), values)
        return StepChains(chains, buckets_d, rates, (tokens >= 0).sum(1))

    def _extend_and_match(
        self, runner: GPUModelRunner, req_ids: list[str], sampled: np.ndarray | None
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Each request's index takes its new text (and its ``sampled`` [B, W] tokens, -1 padded,
        unless discarded); returns its chain's tokens [B, L] (-1 padded), its match-length bucket
        [B] and whether it has a chain [B] bool, all on the host."""
        batch = len(req_ids)
        discard = runner.discard_request_mask.np[:batch]
        text, known = runner.input_batch.token_ids_cpu, runner.input_batch.num_tokens_no_spec
        prompt_lens = runner.input_batch.num_prompt_tokens
        tokens = np.full((batch, self.length), -1, dtype=np.int64)
        buckets = np.zeros(batch, dtype=np.int64)
        found = np.zeros(batch, dtype=bool)
        for i, rid in enumerate(req_ids):
            index, seen = self._indexes.get(rid), self._seen.get(rid, 0)
            if index is None or seen > known[i]:  # new, or its text was rewound
                index, seen = SuffixIndex(), 0
                self._indexes[rid] = index
                if self.cache is not None:  # what forget keeps of the text is what follows the prompt
                    self._prompt_len[rid] = int(prompt_lens[i])
            index.extend(text[i, seen : known[i]].tolist())
            seen = int(known[i])
            if sampled is not None and not discard[i]:
                new = sampled[i][sampled[i] >= 0].tolist()
                index.extend(new)
                seen += len(new)
            self._seen[rid] = seen
            length, continuation = index.match(self.length)
            if self.cache is not None:
                cached = self.cache.find(index.tail(CACHE_QUERY), self.length)
                if cached[0] > length and cached[1]:
                    (length, continuation), self.cache_chains = cached, self.cache_chains + 1
            tokens[i, : len(continuation)] = continuation
            buckets[i] = np.searchsorted(MATCH_BUCKETS, length, side="right") - 1
            found[i] = len(continuation) > 0
        return tokens, buckets, found

    def record(
        self,
        grafted: torch.Tensor,
        buckets: torch.Tensor,
        parents: torch.Tensor,
        depths: torch.Tensor,
        accepted_nodes: torch.Tensor,
    ) -> None:
        """Learn from one verification (device only).

        grafted: [B, N] bool, the verified drafts that came from lookup chains; buckets: [B]
        int64 their chain's match-length bucket; parents / depths: [B, N] int64 of the verified
        trees; accepted_nodes: [B, N] int64 the accepted path's node indices, -1 padded.
        """
        accepted, reached = accepted_and_reached(parents, accepted_nodes)
        reached = reached & grafted
        cell = buckets.clamp(min=0).unsqueeze(1) * self.length + (depths - 1).clamp(0, self.length - 1)
        self.stats.mul_(DISCOUNT)
        trials, wins = self.stats.view(2, -1)
        trials.index_add_(0, cell.flatten(), reached.flatten().float())
        wins.index_add_(0, cell.flatten(), (accepted & grafted).flatten().float())
        self.sent += grafted.sum()
        self.accepted += (accepted & grafted).sum()

    def summary(self) -> dict[str, int]:
        """Grafted drafts verified and accepted (reads the device: an RPC's, never a step's), and with
        a cache the chains taken from it."""
        cache = {} if self.cache is None else {"lookup_cache_chains": self.cache_chains}
        return {"lookup_drafts": int(self.sent.item()), "lookup_accepted": int(self.accepted.item()), **cache}
