"""The state of one eagle2 step, and of the trees one step hands the next.

:class:`Eagle2Step` carries everything that lives for one step (:mod:`.step` walks it); the
other types are its parts. :class:`ProposedTrees` is what outlives a step: the drafter keeps the
trees it proposed for the verifier of the next one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from vllm_eagle2.budget.decisions import DraftPlan
from vllm_eagle2.budget.timing import StepTimes
from vllm_eagle2.graft import LookupChains

if TYPE_CHECKING:
    from vllm_eagle2.budget.adaptive import StepBudget
    from vllm_eagle2.engine.attention import TreeForward


@dataclass
class Eagle2Step:
    """The state of one eagle2 step, owned by the model runner (``runner._eagle2_step``).

    forward: the target forward's tree attention: the masks the verifier publishes (set when
        the ``tree_batch`` scope opens).
    verify: the trees this step verifies; None = no drafts were scheduled.
    hidden_states: the target's hidden-state rows (and an EAGLE-3 head's auxiliary ones),
        [T, H] each, that the drafter's catch-up pass reads; the verifier reorders their rows
        like the accepted tokens.
    drafted: the drafter ran this step (else vLLM's drafts are zero-filled, and none are sent).
    draft: what the drafter chose to draft, from ``begin_step`` to ``propose``.
    times: the step's record for the adaptive budget (its timings, what it sent), which the budget
        learns from when the next step starts; None without the adaptive budget.
    """

    forward: TreeForward | None = None
    verify: VerifyStep | None = None
    hidden_states: list[torch.Tensor] = field(default_factory=list)
    drafted: bool = False
    draft: DraftChoice | None = None
    times: StepTimes | None = None


@dataclass(frozen=True)
class DraftChoice:
    """A step's one drafting choice, made before the drafter runs: none (``head`` False, no
    ``chains``), lookup chains alone (``head`` False), the head's tree (no ``chains``), or the
    head's tree with the chains grafted in.

    plan: the draft shape, fitted to the head's rows; head: the head drafts a tree (else it runs its
    catch-up pass at most); chains: the requests' lookup chains, or None; buckets: [B] int64 their
    match-length buckets (-1 = no chain); head_skipped: the plan has head levels, but confident
    chains go alone (the allocation then prices no levels); budget: the adaptive budget's share of
    the step, which allocates its drafts (None: a fixed budget, every allowed node is sent).
    """

    plan: DraftPlan
    head: bool
    chains: LookupChains | None
    buckets: torch.Tensor
    head_skipped: bool = False
    budget: StepBudget | None = None


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
    sent_tokens / sent_depths: [B, M] int64 on the host, the drafts sent and their depths (0 past
        a request's drafts), from the same transfer: the seeds of a seeded request's node rows
        (:mod:`vllm_eagle2.engine.seeding`) follow the depths without reading the device.
    """

    req_ids: list[str]
    tokens: torch.Tensor
    parents: torch.Tensor
    ranks: torch.Tensor
    scores: torch.Tensor
    grafted: torch.Tensor
    lookup_buckets: torch.Tensor
    off_chain: np.ndarray
    sent_tokens: np.ndarray
    sent_depths: np.ndarray


@dataclass
class VerifyStep:
    """The trees of this step's verification, B = requests in the batch.

    tokens / parents: [B, N] int64 (tokens -1 and parents -1 past a request's drafts).
    num_drafts: [B] int64, and num_drafts_host its host copy; row_start: [B] int64, flattened row
        of each request's root.
    depths: [B, N] int64, a root child is 1 deep (as in :class:`vllm_eagle2.tree.DraftTree`;
        0 past the drafts); trees: the drafter's record of them.
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    num_drafts: torch.Tensor
    num_drafts_host: np.ndarray
    row_start: torch.Tensor
    depths: torch.Tensor
    trees: MatchedTrees

    @property
    def branched(self) -> bool:
        """Whether any tree branches (host). Without, every accepted path is a prefix of its
        drafts, already in place: nothing is moved."""
        return bool(self.trees.off_chain.any())


@dataclass
class MatchedTrees:
    """The drafter's trees matched to this step's drafts, B = requests, N = draft width.

    parents: [B, N] int64, the stored tree's, or a chain where none matches (-1 past the drafts).
    known: [B, N] bool, drafts whose stored tree matched (their ranks and scores are real).
    ranks: [B, N] int64 and scores: [B, N] float32 (see :class:`vllm_eagle2.tree.DraftTree`).
    grafted: [B, N] bool, known drafts that came from a lookup chain; lookup_buckets: [B] int64,
        their chain's match-length bucket (-1 = none).
    off_chain: [B, N] bool on the host, the drafts off their stored tree's leading chain (all
        False where no tree is stored; drafts whose tokens do not match their tree are verified
        as a chain, for which a tree mask is exact too).
    """

    parents: torch.Tensor
    known: torch.Tensor
    ranks: torch.Tensor
    scores: torch.Tensor
    grafted: torch.Tensor
    lookup_buckets: torch.Tensor
    off_chain: np.ndarray
