"""The eagle2 drafter: vLLM's EAGLE head, grown into one dynamic tree per request.

One step of drafting, for every request of the batch at once:

0. a step without head drafts ends in :meth:`Eagle2Proposer.begin_step`; its catch-up waits (.catch_up).
1. catch-up: the head runs over the tokens the target just accepted, pairing target
   hidden state i with token i + 1 (vLLM's own EAGLE first pass, reused as is). Its
   output at the last accepted position gives the root's children (level 1).
2. expansion: ``depth - 1`` passes of the head over the ``topk`` frontier nodes of every
   request (``vllm_eagle2.tree.build_dynamic_tree`` chooses them). A frontier node at
   level L sits at position ``root + L``; its draft KV is written past the request's end
   (slot ``end + (L - 1) * topk + j``) and it attends to the whole context plus its own
   ancestors, through the tree side channel of :mod:`vllm_eagle2.engine.attention`.
3. rerank: the best ``num_speculative_tokens`` nodes of the pool are the drafts, best
   first; the tree is kept in :class:`~.step.ProposedTrees` for the verifier of the next step.

With the adaptive budget (the default) the settings are upper bounds: before step 2 the
:class:`~vllm_eagle2.budget.adaptive.AdaptiveBudget` picks this step's depth and topk, or no drafts
at all, from the batch size and the measured costs; after step 3 it cuts each request's tree
to its share of one budget for the batch (each tree is best first, so any prefix is a tree).
With ``lookup`` chains a step without head drafts may still send them, as chains, where the
allocation finds their verification pays (no head pass). Beside confident chains the head's levels go unrun.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from vllm.forward_context import set_forward_context
from vllm.v1.spec_decode.eagle import EagleProposer

from vllm_eagle2.budget.adaptive import AdaptiveBudget
from vllm_eagle2.budget.decisions import NO_DRAFTS, DraftPlan, fit_level_rows
from vllm_eagle2.config import Eagle2Settings, env_flag
from vllm_eagle2.device import to_device
from vllm_eagle2.engine import attention
from vllm_eagle2.engine.catch_up import DeferredCatchUp, rows_may_wait, step_rows, waiting_rows_metadata
from vllm_eagle2.engine.eligibility import EligibleRequests, drafting_blockers
from vllm_eagle2.engine.expansion import TreeExpander
from vllm_eagle2.engine.head_vocab import HeadVocabulary
from vllm_eagle2.engine.lookup_drafts import ALONE_MIN_BUCKET, HEAD_SKIP_ENV, LookupDrafts
from vllm_eagle2.engine.ranks import rank_agreement
from vllm_eagle2.engine.step import ProposedTrees
from vllm_eagle2.engine.verification import VerifyCounters
from vllm_eagle2.head_files import EAGLE3
from vllm_eagle2.tree import build_dynamic_tree, lookup_chain_tree, off_leading_chain

if TYPE_CHECKING:
    from vllm_eagle2.engine.step import Eagle2Step

logger = logging.getLogger("vllm.eagle2")  # under vLLM's logger: its handlers and level


class Eagle2Proposer(EagleProposer):
    """vLLM's EagleProposer with the chain loop replaced by EAGLE-2 tree drafting.

    A subclass, so every ``isinstance(drafter, EagleProposer)`` path of the runner stays on.
    """

    def __init__(self, vllm_config: Any, device: torch.device, runner: Any = None) -> None:
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
        self._calibrating = False
        self.budget: AdaptiveBudget | None = None
        s = self.settings
        if s.budget == "adaptive":
            sched = vllm_config.scheduler_config
            self.budget = AdaptiveBudget(
                depth=s.depth,
                topk=1 if s.tree == "chain" else s.topk,
                max_nodes=s.nodes_per_step,
                chain=s.tree == "chain",
                max_batch=sched.max_num_seqs,
                max_tokens=sched.max_num_batched_tokens,
                device=device,
            )
            self.budget.agree = rank_agreement()
        self._full_plan = DraftPlan(
            depth=s.depth, topk=s.topk, num_nodes=s.num_nodes, per_request=s.nodes_per_step, rate=0.0
        )
        self._step_plan: DraftPlan | None = None  # begin_step's plan, for this step's propose
        self._step_chains: tuple[Any, torch.Tensor] | None = None  # begin_step's lookup chains
        self.catch_up = DeferredCatchUp(max_rows=self.max_num_tokens)
        self.head_passes = 0
        self.counters = VerifyCounters(device)
        self.lookup = LookupDrafts(s.lookup, device, cache_tokens=s.lookup_cache) if s.lookup else None
        self.head_skip = env_flag(HEAD_SKIP_ENV, default=True)
        blockers = drafting_blockers(vllm_config.model_config.get_diff_sampling_param())
        if blockers:
            logger.warning(
                "eagle2: the model's generation config sets %s by default: requests that keep it are "
                "decoded without drafts (the tree verifier applies temperature, top-k and top-p only). "
                "To draft, start vLLM with --generation-config vllm or send neutral values per request.",
                ", ".join(blockers),
            )

    # -- model ---------------------------------------------------------------------------
    def initialize_attn_backend(
        self, kv_cache_config: Any, kernel_block_sizes: list[int] | None = None
    ) -> None:
        super().initialize_attn_backend(kv_cache_config, kernel_block_sizes)
        attention.check_kernel_blocks(kv_cache_config, kernel_block_sizes)

    def load_model(self, target_model: torch.nn.Module) -> None:
        super().load_model(target_model)
        layers = self.vllm_config.compilation_config.static_forward_context
        attn_layers = {name: layer for name, layer in layers.items() if hasattr(layer, "impl")}
        attention.wrap_attention_layers(attn_layers)
        self.target_attn_layer_names = set(attn_layers) - set(self._draft_attn_layer_names)
        self.vocab = HeadVocabulary(self.model, self.settings)

    def dummy_run(self, num_tokens: int, *args: Any, **kwargs: Any) -> None:
        if self._calibrating:
            return  # the budget's calibration times the target alone
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
        self, batch: int, sampled: Any = None, step: Eagle2Step | None = None, cad: Any = None, limit: int = 0
    ) -> list[list[int]] | None:
        """Plan this step's drafts for its ``batch`` requests, before vLLM prepares the drafter's inputs.

        ``sampled``: vLLM's sampled tokens of this step, for the lookup chains; ``step``: this step's
        state (the target's hidden-state rows, whether it verified drafts); ``cad``: vLLM's
        attention metadata of the step, for the drafter; ``limit``: the most drafts a request may get.

        Returns the step's drafts when it sends no head drafts (none, or lookup chains alone) and
        its catch-up waits (:mod:`.catch_up`): the head does no work and vLLM's drafter
        preparation is skipped.
        Else None: vLLM prepares the drafter's inputs and calls :meth:`propose`.
        """
        if self.lookup is not None:
            self.lookup.take_sampled(sampled)
        budget = self.budget
        if budget is None:
            plan = self._full_plan
        else:
            budget.target_done()
            plan = budget.plan(batch)
        fitted = self._step_plan = fit_level_rows(plan, batch, self.max_num_tokens)
        self.counters.narrowed_steps += fitted is not plan
        self._step_chains = None
        if self.lookup is not None and batch:
            # A step without head drafts may still send long matches' chains: they cost no head
            # pass, only their verification, which the allocation prices.
            min_bucket = ALONE_MIN_BUCKET if not fitted.drafts else 0
            req_ids = list(self.runner.input_batch.req_ids[:batch])
            self._step_chains = self.lookup.chains(self.runner, req_ids, min_bucket)
        if self._step_chains is not None and self._step_chains[0] is None:
            self._step_chains = None
        if fitted.drafts or not self._rows_wait(batch, step, sampled, cad):
            return None
        self._step_plan = None
        if self._step_chains is not None and limit > 0:  # chains alone: no head pass either
            chains, buckets = self._step_chains
            tree = lookup_chain_tree(chains, limit)
            # Each request's context ends after this step's rows: the root is its last.
            ends = self.runner.input_batch.num_computed_tokens_cpu[:batch] + np.diff(
                self.runner.query_start_loc.np[: batch + 1]
            )
            fits = to_device(ends + tree.num_nodes <= self.max_model_len, buckets.device)
            return self._send(tree, fits, fitted, buckets, False, limit)
        self.proposed = None
        if budget is not None:
            budget.count_step(fitted, [0] * batch)
        return [[] for _ in range(batch)]

    def _rows_wait(self, batch: int, step: Eagle2Step | None, sampled: Any, cad: Any) -> bool:
        """Keep this step's catch-up rows for later (:mod:`.catch_up`), if they may wait; with the
        queue at its length, run them with the waiting ones, in one head pass."""
        runner, queue = self.runner, self.catch_up
        if cad is None or not rows_may_wait(step, batch, sampled, runner.discard_request_mask.np[:batch]):
            return False
        qsl = runner.query_start_loc.np[: batch + 1]
        total = int(qsl[-1])
        full = not queue.has_room(total)
        if full and queue.rows + total > queue.max_rows:
            return False  # propose runs the waiting rows, then this step's catch-up
        hidden = step.hidden_states  # EAGLE-3: the auxiliary rows, as vLLM hands the drafter them
        rows = torch.cat(hidden[1:], dim=-1) if self.method == "eagle3" else hidden[0]
        starts = runner.input_batch.num_computed_tokens_cpu[:batch]
        req_ids = runner.input_batch.req_ids[:batch]
        queue.defer(step_rows(req_ids, qsl, starts, runner.input_ids.gpu, rows, sampled))
        if full:
            self._run_waiting_catch_up(cad, starts + np.diff(qsl))
        return True

    def propose(  # noqa: D417 - same signature as vLLM's EagleProposer.propose
        self,
        num_speculative_tokens: int,
        target_token_ids: torch.Tensor,
        target_positions: torch.Tensor,
        target_hidden_states: torch.Tensor,
        next_token_ids: torch.Tensor,
        token_indices_to_sample: torch.Tensor | None,
        common_attn_metadata: Any,
        sampling_metadata: Any,
        mm_embed_inputs: Any = None,
        num_rejected_tokens_gpu: torch.Tensor | None = None,
        slot_mappings: Any = None,
    ) -> list[list[int]]:
        """Draft one tree per request; returns each request's draft tokens (best first).

        The catch-up pass runs outside any ``tree_batch`` scope (causal); each expansion level
        opens its own (:class:`~vllm_eagle2.engine.expansion.TreeExpander`).
        """
        budget = self.budget
        cad = common_attn_metadata
        batch = cad.batch_size()
        plan, self._step_plan = self._step_plan, None
        if plan is None:
            raise RuntimeError("eagle2: propose without begin_step (the runner's propose_draft_token_ids)")
        self._run_waiting_catch_up(cad, self.runner.input_batch.num_computed_tokens_cpu[:batch])
        catch_up_only = num_speculative_tokens == 0 or not plan.drafts
        if budget is not None and not catch_up_only:
            budget.level_started(batch)  # the root level, its catch-up pass included
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
        chains, buckets = None, torch.full((batch,), -1, dtype=torch.long, device=last_hidden.device)
        if self._step_chains is not None and num_speculative_tokens > 0:
            chains, buckets = self._step_chains
        if catch_up_only and chains is None:
            self.proposed = None
            if budget is not None:
                budget.count_step(plan, [0] * batch)
            return [[] for _ in range(batch)]
        # Confident chains may leave the head's levels unrun: the budget weighs them alone against
        # the plan beside them (a batch-wide choice, as a level runs for the whole batch).
        head_skipped = False
        if not catch_up_only and chains is not None and budget is not None and self.head_skip:
            head_skipped = budget.chains_alone_pay(plan, self.lookup.outlook(num_speculative_tokens))
            if head_skipped:
                budget.drafting_done(timed=False)  # the root level's mark: only the catch-up ran

        root_pos = self._get_positions(num_tokens)[sample_idx].long()  # [B] position of the root
        if catch_up_only or head_skipped:
            tree = lookup_chain_tree(chains, num_speculative_tokens)
            fits = root_pos + 1 + tree.num_nodes <= self.max_model_len
        else:
            root_logits = self.vocab.logits(last_hidden[sample_idx])
            expander = TreeExpander(self, cad, root_pos, hidden[sample_idx])
            tree = build_dynamic_tree(
                root_logits,
                expander,
                depth=plan.depth,
                topk=plan.topk,
                num_nodes=plan.num_nodes,
                mode=self.settings.tree,
                token_ids=self.vocab.token_ids,
                lookup=chains,
            )
            fits = expander.fits
        return self._send(tree, fits, plan, buckets, head_skipped, num_speculative_tokens)

    def _send(
        self,
        tree: Any,
        fits: torch.Tensor,
        plan: DraftPlan,
        buckets: torch.Tensor,
        head_skipped: bool,
        limit: int,
    ) -> list[list[int]]:
        """The drafts of ``tree`` (a :class:`~vllm_eagle2.tree.DraftTree`) this step sends, at most
        ``limit`` per request, cut to the budget's counts; the tree is kept for the verifier.

        fits: [B] bool, the request's tree fits its context; buckets: [B] int64, lookup buckets."""
        budget, batch = self.budget, len(fits)
        req_ids = list(self.runner.input_batch.req_ids[:batch]) if self.runner is not None else []
        tokens = tree.tokens
        grafted = tree.grafted if tree.grafted is not None else torch.zeros_like(tokens, dtype=torch.bool)

        # Drafts only where the whole tree fits in max_model_len and the sampler is reproducible,
        # and never a node without a token (a row without a chain, in a step of chains alone).
        n_out = min(limit, tree.num_nodes)
        eligible = self.eligible.rows(self.runner.requests, req_ids) if req_ids else [True] * batch
        allowed = (fits & to_device(eligible, fits.device)).unsqueeze(1) & (tokens[:, :n_out] >= 0)
        if budget is None:
            counts = torch.cummin(allowed.to(torch.int8), dim=1).values.sum(dim=1)
        else:
            budget.drafting_done()
            counts = budget.allocate(
                NO_DRAFTS if head_skipped else plan,
                tree.scores[:, :n_out],
                tree.depths[:, :n_out],
                allowed,
                grafted[:, :n_out],
            )
            budget.acceptance.copy_to_host()
        sent = torch.arange(n_out, device=counts.device) < counts.unsqueeze(1)
        off_chain = off_leading_chain(tree.depths[:, :n_out]) & sent
        # vLLM wants host lists: one transfer brings the drafts, their counts and their shape.
        host = torch.cat([tokens[:, :n_out], counts.unsqueeze(1), off_chain.long()], dim=1).cpu().numpy()
        self.proposed = ProposedTrees(
            req_ids=req_ids,
            tokens=tokens,
            parents=tree.parents,
            ranks=tree.ranks,
            scores=tree.scores,
            grafted=grafted,
            lookup_buckets=buckets,
            off_chain=host[:, n_out + 1 :].astype(bool),
        )
        drafts = [row[:count] for row, count in zip(host[:, :n_out].tolist(), host[:, n_out].tolist())]
        if budget is not None:
            budget.after_sync()
            budget.count_step(plan, [len(d) for d in drafts], head_skipped)
        return drafts

    def _run_head(self, cad: Any, num_tokens: int, *, first_pass: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """One head forward over ``num_tokens`` rows with ``cad``'s attention metadata; returns
        (last hidden states, hidden states), each ``[num_tokens, H]``.

        Run as vLLM's own draft loop runs its passes: the inputs come from the proposer's persistent
        buffers (the first pass fills them in ``set_inputs_first_pass``, a level before calling),
        padded to a size the dispatcher knows, and replayed from its piecewise CUDA graph where one
        was captured (vLLM captures the head at start-up). Attention runs between the graph's
        pieces, so the tree side channel still reaches it.
        """
        _, per_layer = self.build_per_group_and_layer_attn_metadata(cad)
        mode, padded, across_dp = self._determine_batch_execution_and_padding(num_tokens)
        if first_pass:
            model_kwargs, slot_size = self.build_model_inputs_first_pass(num_tokens, padded, None)
        else:
            model_kwargs = {
                "input_ids": self.input_ids[:padded],
                "positions": self._get_positions(padded),
                "hidden_states": self.hidden_states[:padded],
            }
            slot_size = padded
        with set_forward_context(
            per_layer,
            self.vllm_config,
            num_tokens=padded,
            num_tokens_across_dp=across_dp,
            cudagraph_runtime_mode=mode,
            slot_mapping=self._get_slot_mapping(slot_size, cad.slot_mapping),
        ):
            out = self.model(**model_kwargs)
        last, hidden = out if self.model_returns_tuple() else (out, out)
        self.head_passes += 1
        return last[:num_tokens], hidden[:num_tokens]

    def _run_waiting_catch_up(self, cad: Any, next_positions: np.ndarray) -> None:
        """The catch-up rows of the steps that sent no drafts, in one causal head pass that writes
        the head's KV at their positions, before the catch-up at ``next_positions`` ([B] host, each
        request's next row) reads it."""
        if not self.catch_up.waiting:
            return
        req_ids = self.runner.input_batch.req_ids[: len(next_positions)]
        waiting = self.catch_up.take({rid: i for i, rid in enumerate(req_ids)}, next_positions)
        if waiting is None:
            return
        rows = len(waiting.positions)
        caught_up, positions = waiting_rows_metadata(cad, waiting, self.block_size)
        hidden = waiting.hidden
        if self.method == "eagle3":
            hidden = self.model.combine_hidden_states(hidden)
        self.input_ids[:rows] = waiting.tokens
        self.positions[:rows] = positions
        self.hidden_states[:rows] = hidden
        self._run_head(caught_up, rows, first_pass=True)  # catch-up rows: the head's first pass
