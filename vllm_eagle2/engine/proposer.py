"""The eagle2 drafter: vLLM's EAGLE head, grown into one dynamic tree per request.

One step of drafting, for every request of the batch at once, in phases:

0. choose (:meth:`Eagle2Proposer.begin_step`): the budget's plan (depth and topk, or no drafts)
   and the lookup chains make one :class:`~.step_state.DraftChoice`: none, chains alone, the head's
   tree, or the head's tree with the chains grafted in. Without head levels the step may end
   there, its catch-up rows waiting (:mod:`.catch_up`).
1. catch-up (:meth:`Eagle2Proposer.propose`): the head's first pass over the tokens the target
   just accepted (vLLM's own); its output at the last one gives the root's children.
2. expansion: ``depth - 1`` head passes over each request's frontier
   (:func:`vllm_eagle2.tree.build_dynamic_tree`, :mod:`.expansion`), then the best nodes of the pool.
3. send (:mod:`.sending`): each tree cut to its share of the batch's budget; the trees are kept in
   :class:`~.step_state.ProposedTrees` for the next step's verifier.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from vllm.v1.spec_decode.eagle import EagleProposer

from vllm_eagle2.budget.adaptive import AdaptiveBudget
from vllm_eagle2.budget.decisions import DraftPlan, fit_level_rows
from vllm_eagle2.config import Eagle2Settings, env_flag
from vllm_eagle2.device import to_device
from vllm_eagle2.engine import attention
from vllm_eagle2.engine.catch_up import DeferredCatchUp, rows_wait, run_waiting
from vllm_eagle2.engine.eligibility import EligibleRequests, warn_of_default_blockers
from vllm_eagle2.engine.expansion import TreeExpander
from vllm_eagle2.engine.head_passes import HeadPasses
from vllm_eagle2.engine.head_vocab import HeadVocabulary
from vllm_eagle2.engine.lookup_drafts import ALONE_MIN_BUCKET, HEAD_SKIP_ENV, LookupDrafts
from vllm_eagle2.engine.ranks import rank_agreement
from vllm_eagle2.engine.sending import send_drafts
from vllm_eagle2.engine.step_state import DraftChoice, Eagle2Step, ProposedTrees
from vllm_eagle2.engine.verification import VerifyCounters
from vllm_eagle2.head_files import EAGLE3
from vllm_eagle2.tree import DraftTree, build_dynamic_tree, lookup_chain_tree

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.attention.backend import CommonAttentionMetadata
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner


class Eagle2Proposer(HeadPasses, EagleProposer):
    """vLLM's EagleProposer with the chain loop replaced by EAGLE-2 tree drafting.

    A subclass, so every ``isinstance(drafter, EagleProposer)`` path of the runner stays on; its
    head passes are :class:`~.head_passes.HeadPasses`.
    """

    def __init__(
        self, vllm_config: VllmConfig, device: torch.device, runner: GPUModelRunner | None = None
    ) -> None:
        super().__init__(vllm_config, device, runner)
        self.runner = runner  # vLLM's proposer does not keep it; we read the batch's request ids
        self.settings: Eagle2Settings = vllm_config.speculative_config.eagle2
        # The head's own limit where it is shorter (vLLM's ``effective_drafter_max_model_len``): its
        # positions past it are not defined. Requests near it stop drafting, the others go on.
        limit = vllm_config.model_config.max_model_len
        self.max_model_len = getattr(runner, "effective_drafter_max_model_len", limit)
        self.proposed: ProposedTrees | None = None
        self.target_attn_layer_names: set[str] = set()
        self.eligible = EligibleRequests()
        self.vocab: HeadVocabulary | None = None  # what the head drafts over, once it loads
        if self.settings.head_format == EAGLE3:
            # vLLM's EAGLE-3 paths: the runner collects the auxiliary hidden states, propose combines them.
            self.method = "eagle3"
            self.eagle3_use_aux_hidden_state = self._get_eagle3_use_aux_hidden_state_from_config()
        self._target_alone = False  # see target_alone
        self.budget: AdaptiveBudget | None = None
        s = self.settings
        if s.budget == "adaptive":
            sched = vllm_config.scheduler_config
            self.budget = AdaptiveBudget.of(s, sched.max_num_seqs, sched.max_num_batched_tokens, device)
            self.budget.agree = rank_agreement()
        self._full_plan = DraftPlan(
            depth=s.depth, topk=s.topk, num_nodes=s.num_nodes, per_request=s.nodes_per_step, rate=0.0
        )
        cache = vllm_config.cache_config
        self.catch_up = DeferredCatchUp(
            max_rows=self.max_num_tokens, block_size=cache.block_size if cache.enable_prefix_caching else 0
        )
        self.head_passes = 0
        self.counters = VerifyCounters(device)
        self.lookup = LookupDrafts(s.lookup, device, cache_tokens=s.lookup_cache) if s.lookup else None
        self.head_skip = env_flag(HEAD_SKIP_ENV, default=True)
        warn_of_default_blockers(vllm_config.model_config.get_diff_sampling_param())

    # -- model ---------------------------------------------------------------------------
    def initialize_attn_backend(
        self, kv_cache_config: KVCacheConfig, kernel_block_sizes: list[int] | None = None
    ) -> None:
        super().initialize_attn_backend(kv_cache_config, kernel_block_sizes)
        attention.check_kernel_blocks(kv_cache_config, kernel_block_sizes)
        # Every builder (the target's, then the head's) has given its layers vLLM's ISA by now.
        layers = self.vllm_config.compilation_config.static_forward_context
        attention.check_layouts(layers, self.vllm_config.model_config.dtype)

    def load_model(self, target_model: torch.nn.Module) -> None:
        super().load_model(target_model)
        layers = self.vllm_config.compilation_config.static_forward_context
        attn_layers = {name: layer for name, layer in layers.items() if hasattr(layer, "impl")}
        attention.wrap_attention_layers(attn_layers)
        self.target_attn_layer_names = set(attn_layers) - set(self._draft_attn_layer_names)
        self.vocab = HeadVocabulary(self.model, self.settings)

    @contextmanager
    def target_alone(self) -> Iterator[None]:
        """Within: vLLM's dummy runs leave the head out (the budget's calibration times the target)."""
        self._target_alone = True
        try:
            yield
        finally:
            self._target_alone = False

    def dummy_run(self, num_tokens: int, *args: Any, **kwargs: Any) -> None:
        if self._target_alone:
            return
        # Profiling runs one pass per draft level, not one per verified node.
        saved = self.num_speculative_tokens
        self.num_speculative_tokens = min(saved, self.settings.depth)
        try:
            super().dummy_run(num_tokens, *args, **kwargs)
        finally:
            self.num_speculative_tokens = saved

    # -- drafting --------------------------------------------------------------------------
    def forget(self, req_ids: set[str]) -> None:
        self.eligible.forget(req_ids)
        if self.lookup is not None:
            self.lookup.forget(req_ids)

    def begin_step(
        self,
        batch: int,
        sampled: torch.Tensor | list[list[int]],
        step: Eagle2Step,
        cad: CommonAttentionMetadata | None = None,
        limit: int = 0,
    ) -> list[list[int]] | None:
        """Choose this step's drafting for its ``batch`` requests (``step.draft``), before vLLM
        prepares the drafter's inputs.

        ``sampled``: vLLM's sampled tokens of this step, for the lookup chains; ``step``: this step's
        state (the target's hidden-state rows, whether it verified drafts); ``cad``: vLLM's
        attention metadata of the step, for the drafter; ``limit``: the most drafts a request may get.

        Returns the step's drafts when the plan has no head levels (none, or lookup chains alone)
        and its catch-up waits (:mod:`.catch_up`): the head does no work and vLLM's drafter
        preparation is skipped. Else None: vLLM prepares the drafter's inputs and calls :meth:`propose`.
        """
        choice = step.draft = self._choose(batch, step, sampled, limit)
        if choice.plan.drafts or not rows_wait(self.catch_up, self, self.runner, batch, step, sampled, cad):
            return None
        step.draft = None
        if choice.chains is None:
            return self._send_none(choice, step, batch)
        tree = lookup_chain_tree(choice.chains, limit)
        # Each request's context ends after this step's rows: the root is its last.
        ends = self.runner.input_batch.num_computed_tokens_cpu[:batch] + np.diff(
            self.runner.query_start_loc.np[: batch + 1]
        )
        fits = to_device(ends + tree.num_nodes <= self.max_model_len, choice.buckets.device)
        return self._send(tree, fits, choice, step, limit)

    def _choose(
        self, batch: int, step: Eagle2Step, sampled: torch.Tensor | list[list[int]], limit: int
    ) -> DraftChoice:
        """The step's one drafting choice: none, lookup chains alone, the head's tree, or the head's
        tree with chains grafted in (:class:`~.step_state.DraftChoice`)."""
        copy = self.lookup.copy_sampled(sampled) if self.lookup is not None else None
        if step.times is not None:
            step.times.target_done()
        share = None if self.budget is None else self.budget.plan(batch, self.max_num_tokens, step.times)
        if share is None:
            fitted = fit_level_rows(self._full_plan, batch, self.max_num_tokens)
            self.counters.narrowed_steps += fitted is not self._full_plan
        else:
            fitted = share.plan
            self.counters.narrowed_steps += share.narrowed
        chains = None
        if self.lookup is not None and batch:
            # A step without head drafts may still send long matches' chains: they cost no head
            # pass, only their verification, which the allocation prices.
            min_bucket = ALONE_MIN_BUCKET if not fitted.drafts else 0
            req_ids = list(self.runner.input_batch.req_ids[:batch])
            chains = self.lookup.chains(self.runner, req_ids, copy, min_bucket)
        if limit == 0:  # no drafts may be sent (the indexes took the step's tokens all the same)
            chains = None
        head = fitted.drafts and limit > 0
        # Confident chains may leave the head's levels unrun: the budget weighs them alone against
        # the plan beside them (a batch-wide choice, as a level runs for the whole batch).
        head_skipped = False
        if head and chains is not None and share is not None and self.head_skip:
            head_skipped = share.chains_alone_pay(chains.reach(limit))
        buckets = chains.buckets if chains is not None else torch.full((batch,), -1, device=self.device)
        return DraftChoice(
            plan=fitted,
            head=head and not head_skipped,
            chains=None if chains is None else chains.chains,
            buckets=buckets,
            head_skipped=head_skipped,
            budget=share,
        )

    def propose(  # noqa: D417 - same signature as vLLM's EagleProposer.propose
        self,
        num_speculative_tokens: int,
        target_token_ids: torch.Tensor,
        target_positions: torch.Tensor,
        target_hidden_states: torch.Tensor,
        next_token_ids: torch.Tensor,
        token_indices_to_sample: torch.Tensor | None,
        common_attn_metadata: CommonAttentionMetadata,
        sampling_metadata: Any,
        mm_embed_inputs: Any = None,
        num_rejected_tokens_gpu: torch.Tensor | None = None,
        slot_mappings: Any = None,
    ) -> list[list[int]]:
        """Draft as :meth:`begin_step` chose; returns each request's draft tokens (best first).

        Phases: the waiting catch-up rows and this step's catch-up pass (causal, outside any
        ``tree_batch`` scope), then the drafts: none, the lookup chains alone, or the head's tree
        (its expansion levels each open their own scope, :class:`~.expansion.TreeExpander`).
        """
        step = self.runner._eagle2_step
        choice = None if step is None else step.draft
        if choice is None:
            raise RuntimeError("eagle2: propose without begin_step (the runner's propose_draft_token_ids)")
        step.draft = None
        cad = common_attn_metadata
        batch = cad.batch_size()
        last_hidden, hidden, sample_idx, root_pos = self._catch_up(
            choice,
            step,
            target_token_ids,
            target_positions,
            target_hidden_states,
            next_token_ids,
            token_indices_to_sample,
            cad,
            num_rejected_tokens_gpu,
        )
        if not choice.head and choice.chains is None:
            return self._send_none(choice, step, batch)
        if not choice.head:
            tree = lookup_chain_tree(choice.chains, num_speculative_tokens)
            fits = root_pos + 1 + tree.num_nodes <= self.max_model_len
            return self._send(tree, fits, choice, step, num_speculative_tokens)
        expander = TreeExpander(
            self,
            cad,
            root_pos,
            hidden[sample_idx],
            region_capacity=self.settings.draft_kv_slots,
            max_model_len=self.max_model_len,
            on_level=None if step.times is None else step.times.level_started,
        )
        tree = build_dynamic_tree(
            self.vocab.logits(last_hidden[sample_idx]),
            expander,
            depth=choice.plan.depth,
            topk=choice.plan.topk,
            num_nodes=choice.plan.num_nodes,
            mode=self.settings.tree,
            token_ids=self.vocab.token_ids,
            lookup=choice.chains,
        )
        return self._send(tree, expander.fits, choice, step, num_speculative_tokens)

    def _catch_up(
        self,
        choice: DraftChoice,
        step: Eagle2Step,
        target_token_ids: torch.Tensor,
        target_positions: torch.Tensor,
        target_hidden_states: torch.Tensor,
        next_token_ids: torch.Tensor,
        token_indices_to_sample: torch.Tensor | None,
        cad: CommonAttentionMetadata,
        num_rejected_tokens_gpu: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The waiting rows, then the head's first pass over the tokens the target just accepted
        (vLLM's own EAGLE first pass). Returns the head's last hidden states and hidden states
        [T, H], the rows of the roots [B] and the roots' positions [B] int64."""
        batch = cad.batch_size()
        run_waiting(
            self.catch_up, self, self.runner, cad, self.runner.input_batch.num_computed_tokens_cpu[:batch]
        )
        if step.times is not None and choice.head:
            step.times.level_started(batch)  # the root level, its catch-up pass included
        if self.method == "eagle3":
            target_hidden_states = self.model.combine_hidden_states(target_hidden_states)
        num_tokens, sample_idx, cad = self.set_inputs_first_pass(
            target_token_ids=target_token_ids,
            next_token_ids=next_token_ids,
            target_positions=target_positions,
            target_hidden_states=target_hidden_states,
            token_indices_to_sample=token_indices_to_sample,
            cad=cad,
            num_rejected_tokens_gpu=num_rejected_tokens_gpu,
        )
        last_hidden, hidden = self._run_head(cad, num_tokens, first_pass=True)
        root_pos = self._get_positions(num_tokens)[sample_idx].long()  # [B] position of the root
        return last_hidden, hidden, sample_idx, root_pos

    def _send_none(self, choice: DraftChoice, step: Eagle2Step, batch: int) -> list[list[int]]:
        """A step that sends no drafts."""
        self.proposed = None
        if step.times is not None:
            step.times.drafts_sent(choice.plan, [0] * batch)
        return [[] for _ in range(batch)]

    def _send(
        self, tree: DraftTree, fits: torch.Tensor, choice: DraftChoice, step: Eagle2Step, limit: int
    ) -> list[list[int]]:
        """The drafts of ``tree`` this step sends (:func:`~.sending.send_drafts`); the tree is kept
        for the verifier. fits: [B] bool, the request's tree fits its context."""
        batch = len(fits)
        req_ids = list(self.runner.input_batch.req_ids[:batch])
        eligible = self.eligible.rows(self.runner.requests, req_ids)
        if step.times is not None:
            step.times.drafting_done()
        drafts, self.proposed = send_drafts(tree, fits, eligible, req_ids, choice, limit)
        if step.times is not None:
            step.times.drafts_sent(choice.plan, [len(d) for d in drafts], choice.head_skipped)
        return drafts
