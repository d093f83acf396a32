"""The eagle2 drafter: vLLM's EAGLE head, grown into one dynamic tree per request.

One step of drafting, for every request of the batch at once:

1. catch-up: the head runs over the tokens the target just accepted, pairing target
   hidden state i with token i + 1 (vLLM's own EAGLE first pass, reused as is). Its
   output at the last accepted position gives the root's children (level 1).
2. expansion: ``depth - 1`` passes of the head over the ``topk`` frontier nodes of every
   request (``vllm_eagle2.tree.build_dynamic_tree`` chooses them). A frontier node at
   level L sits at position ``root + L``; its draft KV is written past the request's end
   (slot ``end + (L - 1) * topk + j``) and it attends to the whole context plus its own
   ancestors, through the tree side channel of :mod:`vllm_eagle2.attention`.
3. rerank: the best ``num_speculative_tokens`` nodes of the pool are the drafts, best
   first; the tree is kept in :class:`TreeStore` for the verifier of the next step.

With the adaptive budget (the default) the settings are upper bounds: before step 2 the
:class:`~vllm_eagle2.adaptive.AdaptiveBudget` picks this step's depth and topk, or no drafts
at all, from the batch size and the measured costs; after step 3 it cuts each request's tree
to its share of one budget for the batch (each tree is best first, so any prefix is a tree).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import numpy as np
import torch
from vllm.forward_context import set_forward_context
from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod
from vllm.v1.spec_decode.eagle import EagleProposer

from vllm_eagle2 import attention
from vllm_eagle2.adaptive import AdaptiveBudget
from vllm_eagle2.budget import DraftPlan, fit_level_rows
from vllm_eagle2.config import Eagle2Settings
from vllm_eagle2.device import to_device
from vllm_eagle2.draft_vocab import DraftVocab
from vllm_eagle2.head_files import EAGLE3
from vllm_eagle2.kernels import HAS_TRITON, pack_tree_mask, vocab_topk
from vllm_eagle2.kernels.warmup import StepLimits, warm_up_kernels
from vllm_eagle2.runner import VerifyCounters
from vllm_eagle2.tree import build_dynamic_tree, off_leading_chain

logger = logging.getLogger("vllm.eagle2")  # under vLLM's logger: its handlers and level

_PAD_SLOT = -1


def supports_tree_drafting(sampling_params: Any) -> bool:
    """Whether the tree verifier reproduces this request's sampler exactly.

    Penalties, logit processors and grammars look at the tokens before each position; the
    tree verifier applies temperature, top-k and top-p only. Such requests are decoded
    without drafts, which is lossless too.
    """
    sp = sampling_params
    if sp is None:
        return True
    return (
        all(getattr(sp, name) == neutral for name, neutral in _NEUTRAL_SAMPLING.items())
        and not sp.logit_bias
        and not sp.allowed_token_ids
        and not sp.bad_words
        and sp.structured_outputs is None
        and not getattr(sp, "logits_processors", None)
    )


#: Sampling settings the tree verifier does not apply, at their neutral values.
_NEUTRAL_SAMPLING = {
    "repetition_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "min_p": 0.0,
    "min_tokens": 0,
}


def drafting_blockers(defaults: dict[str, Any]) -> list[str]:
    """The settings of a model's default sampling parameters (vLLM reads them from its
    ``generation_config.json``) under which its requests get no drafts, as ``name=value``.

    Qwen's ``repetition_penalty`` 1.05 is one: every request that keeps it is decoded without
    drafts, which is lossless but no faster.
    """
    return [f"{k}={defaults[k]}" for k, v in _NEUTRAL_SAMPLING.items() if k in defaults and defaults[k] != v]


def _platform_gemm(lm_head: Any, weight: torch.Tensor) -> Any:
    """[N, H] -> [N, V'] product with ``weight`` (rows of ``lm_head``'s) by the kernel vLLM gives an
    unquantized ``lm_head`` on this platform; None for any other ``lm_head``.

    On CPU that is oneDNN with a packed weight: for 8,714 x 576 fp32 on 2 AVX2 cores, with the caches
    cold as after a target pass, 2.2 ms against torch's 3.9 ms for one row, 2.5 against 8.0 for four.
    """
    method = getattr(lm_head, "quant_method", None)
    if not isinstance(method, UnquantizedEmbeddingMethod):
        return None
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(weight, requires_grad=False)
    method.process_weights_after_loading(layer)
    return lambda hidden: method.apply(layer, hidden)


@dataclasses.dataclass
class TreeStore:
    """The trees proposed last step, for the verifier of this step.

    req_ids: request ids, in the batch order of the proposing step.
    tokens / parents / ranks: [B, N] int64, scores: [B, N] float32 (see
    :class:`vllm_eagle2.tree.DraftTree`; tokens are target token ids).
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
    off_chain: np.ndarray


class Eagle2Proposer(EagleProposer):
    """vLLM's EagleProposer with the chain loop replaced by EAGLE-2 tree drafting.

    A subclass, so every ``isinstance(drafter, EagleProposer)`` path of the runner stays on.
    """

    def __init__(self, vllm_config: Any, device: torch.device, runner: Any = None) -> None:
        super().__init__(vllm_config, device, runner)
        self.runner = runner  # vLLM's proposer does not keep it; we read the batch's request ids
        self.settings: Eagle2Settings = vllm_config.speculative_config.eagle2
        self.max_model_len = vllm_config.model_config.max_model_len
        self.trees: TreeStore | None = None
        self.target_attn_layer_names: set[str] = set()
        self._eligible: dict[str, bool] = {}
        self.draft_vocab: DraftVocab | None = None
        self.d2t: torch.Tensor | None = None  # EAGLE-3 heads: [Vd] int64, target id - draft index
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
        self._full_plan = DraftPlan(
            depth=s.depth, topk=s.topk, num_tokens=s.num_tokens, per_request=s.nodes_per_step, rate=0.0
        )
        self._step_plan: DraftPlan | None = None  # begin_step's plan, for this step's propose
        self.counters = VerifyCounters(device)
        blockers = drafting_blockers(vllm_config.model_config.get_diff_sampling_param())
        if blockers:
            logger.warning(
                "eagle2: the model's generation config sets %s by default: requests that keep it are "
                "decoded without drafts (the tree verifier applies temperature, top-k and top-p only). "
                "To draft, start vLLM with --generation-config vllm or send neutral values per request.",
                ", ".join(blockers),
            )

    # -- model ---------------------------------------------------------------------------
    def load_model(self, target_model: torch.nn.Module) -> None:
        super().load_model(target_model)
        layers = self.vllm_config.compilation_config.static_forward_context
        attn_layers = {name: layer for name, layer in layers.items() if hasattr(layer, "impl")}
        attention.wrap_attention_layers(attn_layers)
        self.target_attn_layer_names = set(attn_layers) - set(self._draft_attn_layer_names)
        if self.settings.draft_vocab_ids:
            self.draft_vocab = self._load_draft_vocab()
        self.d2t = getattr(self.model, "draft_id_to_target_id", None)

    def _load_draft_vocab(self) -> DraftVocab | None:
        """The ``lm_head`` cut to the draft vocabulary; None (the whole vocabulary) where it
        cannot be cut and the user left ``draft_vocab_size`` at ``"auto"``."""
        weight = getattr(self.model.lm_head, "weight", None)
        processor = self.model.logits_processor
        problem = None
        if weight is None or weight.dim() != 2 or not weight.is_floating_point():
            problem = "needs an unquantized lm_head"
        elif getattr(processor, "soft_cap", None):
            problem = "does not support logit soft-capping"
        if problem and self.settings.draft_vocab_auto:
            logger.info("eagle2: drafting from the whole vocabulary (a draft vocabulary %s)", problem)
            return None
        if problem:
            raise RuntimeError(f"eagle2 draft_vocab_size {problem}; set it to 0")
        ids = torch.tensor(self.settings.draft_vocab_ids, dtype=torch.long)
        logger.info(
            "eagle2: drafting from the head's %d most frequent tokens (draft_vocab_size%s)",
            len(ids),
            ": auto" if self.settings.draft_vocab_auto else "",
        )
        vocab = DraftVocab(ids, weight.detach(), scale=float(processor.scale))
        gemm = _platform_gemm(self.model.lm_head, vocab.weight)
        if gemm is not None:
            vocab.gemm = gemm
        return vocab

    def _draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, H] head outputs -> [N, V] draft logits (model dtype); V = the draft vocabulary's size.

        Never normalised here: the tree's vocabulary top-k finds each row's winners and its
        log-sum-exp in one pass, so no [N, V] float32 log-probs are materialised.
        """
        if self.draft_vocab is not None:
            return self.draft_vocab.logits(hidden)
        if self.d2t is not None:
            # An EAGLE-3 head's own vocabulary, not scattered into the target's as compute_logits does.
            return self.model.logits_processor(self.model.lm_head, hidden)
        return self.model.compute_logits(hidden)

    def _token_ids(self, draft_index: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary positions (-1 = padding) -> token ids."""
        if self.draft_vocab is not None:
            return self.draft_vocab.token_ids(draft_index)
        if self.d2t is not None:
            return torch.where(
                draft_index >= 0, draft_index + self.d2t[draft_index.clamp(min=0)], draft_index
            )
        return draft_index

    def kernel_limits(self) -> StepLimits:
        """What bounds this engine's kernel shapes (kernels/warmup.py), read from one row of
        each logits producer (their widths and dtypes, whatever the head format)."""
        s = self.settings
        with torch.inference_mode():
            draft = self._draft_logits(torch.zeros(1, self.hidden_size, dtype=self.dtype, device=self.device))
            hidden = self.runner.model_config.get_hidden_size()
            target = self.runner.model.compute_logits(
                torch.zeros(1, hidden, dtype=self.dtype, device=self.device)
            )
        return StepLimits(
            draft_vocab=draft.shape[-1],
            draft_dtype=draft.dtype,
            target_vocab=target.shape[-1],
            # vLLM's logits processors hand the sampler float32 logits.
            target_dtypes=tuple(dict.fromkeys((target.dtype, torch.float32))),
            max_topk=1 if s.tree == "chain" else s.topk,
            # The verified tree with its root, or a draft level's region and its queries.
            max_nodes=max(s.nodes_per_step, s.draft_kv_slots + s.topk) + 1,
            max_rows=self.runner.scheduler_config.max_num_batched_tokens,
        )

    def warm_up_kernels(self) -> int:
        """Compile every Triton variant a step can launch, before vLLM's JIT monitor starts
        watching; returns the launches (0 where the kernels' torch twins run)."""
        if self.device.type != "cuda" or not HAS_TRITON:
            return 0
        layers = self.vllm_config.compilation_config.static_forward_context
        start = time.perf_counter()
        launches = warm_up_kernels(self.kernel_limits(), self.device, attention.tree_caches(layers))
        logger.info("eagle2: %d kernel variants warmed up in %.1f s", launches, time.perf_counter() - start)
        return launches

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

    def calibrate_budget(self, runner: Any) -> None:
        """Time the target and one draft level for the adaptive budget (at engine start)."""
        if self.budget is None:
            return
        limit = runner.scheduler_config.max_num_batched_tokens
        sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)

        def timed(fn: Any) -> float:
            sync()
            start = time.perf_counter()
            fn()
            sync()
            return time.perf_counter() - start

        def time_target(tokens: int) -> float:
            self._calibrating = True
            try:
                return timed(lambda: runner._dummy_run(min(tokens, limit), skip_eplb=True))
            finally:
                self._calibrating = False

        def time_level(rows: int) -> float:
            rows = min(rows, limit)
            hidden = torch.zeros(rows, self.hidden_size, dtype=self.dtype, device=self.device)
            saved = self.num_speculative_tokens
            self.num_speculative_tokens = 1

            def level() -> None:
                EagleProposer.dummy_run(self, rows)
                vocab_topk(self._draft_logits(hidden), self.budget.topk)

            try:
                with torch.inference_mode():
                    return timed(level)
            finally:
                self.num_speculative_tokens = saved

        self.budget.calibrate(time_target, time_level)

    # -- drafting --------------------------------------------------------------------------
    def _eligible_rows(self, req_ids: list[str]) -> list[bool]:
        """Per request: whether the tree verifier reproduces its sampling exactly."""
        requests = getattr(self.runner, "requests", {})
        for rid in req_ids:
            if rid not in self._eligible:
                state = requests.get(rid)
                self._eligible[rid] = supports_tree_drafting(getattr(state, "sampling_params", None))
                self.counters.requests_without_drafts += not self._eligible[rid]
        return [self._eligible[rid] for rid in req_ids]

    def forget(self, req_ids: set[str]) -> None:
        for rid in req_ids:
            self._eligible.pop(rid, None)

    def begin_step(self, batch: int) -> None:
        """Plan this step's drafts for its ``batch`` requests, before vLLM prepares the drafter's inputs.

        The adaptive budget's bookkeeping of the target pass is done here. A step the budget keeps
        without drafts still runs the head's catch-up pass in :meth:`propose` (no ``lm_head``, no
        tree), as vLLM's EAGLE does every step: the head's KV must hold every token. Skipping it
        left gaps in that context, so the drafts after a run of such steps were rejected (measured
        at batch 1: top-1 acceptance 7% against 41%), which taught the budget that drafting never
        pays.
        """
        budget = self.budget
        if budget is None:
            plan = self._full_plan
        else:
            budget.target_done()
            plan = budget.plan(batch)
        self._step_plan = fit_level_rows(plan, batch, self.max_num_tokens)
        self.counters.narrowed_steps += self._step_plan is not plan

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
        opens its own (:class:`_TreeExpander`).
        """
        budget = self.budget
        cad = common_attn_metadata
        batch = cad.batch_size()
        plan, self._step_plan = self._step_plan, None
        if plan is None:
            raise RuntimeError("eagle2: propose without begin_step (the runner's propose_draft_token_ids)")
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
        if catch_up_only:
            self.trees = None
            if budget is not None:
                budget.count_step(plan, [0] * batch)
            return [[] for _ in range(batch)]
        req_ids = list(self.runner.input_batch.req_ids[:batch]) if self.runner is not None else []

        root_pos = self._get_positions(num_tokens)[sample_idx].long()  # [B] position of the root
        root_logits = self._draft_logits(last_hidden[sample_idx])
        expander = _TreeExpander(self, cad, root_pos, hidden[sample_idx])
        tree = build_dynamic_tree(
            root_logits,
            expander,
            depth=plan.depth,
            topk=plan.topk,
            num_tokens=plan.num_tokens,
            mode=self.settings.tree,
        )
        tokens = self._token_ids(tree.tokens)

        # Drafts only where the whole tree fits in max_model_len and the sampler is reproducible.
        n_out = min(num_speculative_tokens, tree.num_nodes)
        eligible = self._eligible_rows(req_ids) if req_ids else [True] * batch
        allowed = expander.fits & to_device(eligible, expander.fits.device)
        if budget is None:
            counts = allowed.long() * n_out
        else:
            budget.drafting_done()
            counts = budget.allocate(plan, tree.scores[:, :n_out], tree.depths[:, :n_out], allowed)
            budget.copy_stats()
        sent = torch.arange(n_out, device=counts.device) < counts.unsqueeze(1)
        off_chain = off_leading_chain(tree.depths[:, :n_out]) & sent
        # vLLM wants host lists: one transfer brings the drafts, their counts and their shape.
        host = torch.cat([tokens[:, :n_out], counts.unsqueeze(1), off_chain.long()], dim=1).cpu().numpy()
        self.trees = TreeStore(
            req_ids=req_ids,
            tokens=tokens,
            parents=tree.parents,
            ranks=tree.ranks,
            scores=tree.scores,
            off_chain=host[:, n_out + 1 :].astype(bool),
        )
        drafts = [row[:count] for row, count in zip(host[:, :n_out].tolist(), host[:, n_out].tolist())]
        if budget is not None:
            budget.after_sync()
            budget.count_step(plan, [len(d) for d in drafts])
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
        return last[:num_tokens], hidden[:num_tokens]


class _TreeExpander:
    """The ``draft_step`` of :func:`build_dynamic_tree`: one head pass per tree level."""

    def __init__(
        self, proposer: Eagle2Proposer, cad: Any, root_pos: torch.Tensor, root_hidden: torch.Tensor
    ) -> None:
        self.p = proposer
        self.cad = cad
        self.root_pos = root_pos  # [B]
        # Sized for the configured tree: an adaptive step may draft a narrower or shallower one.
        self.region_capacity = proposer.settings.draft_kv_slots
        # Draft KV of the tree goes right past the request's end. A request too close to
        # max_model_len gets no drafts: its writes are dropped (padding slots) and its
        # reads kept inside the block table.
        end = root_pos + 1
        self.fits = end + self.region_capacity <= proposer.max_model_len  # [B]
        self.start = torch.minimum(end, torch.full_like(end, proposer.max_model_len - self.region_capacity))
        self.parent_hidden = root_hidden.unsqueeze(1)  # [B, 1 or K, H]
        self.visible: torch.Tensor | None = None  # [B, K, region] ancestor-or-self, region slots
        self.block_table = cad.block_table_tensor[: root_pos.shape[0]]
        # Host-side bounds for the attention metadata (start <= root + 1 <= the first pass's
        # sequence length), so no level reads a length back from the device.
        self.max_seq_len = cad.max_seq_len

    def _slots(self, positions: torch.Tensor) -> torch.Tensor:
        """Cache slots [B, K] of storage positions [B, K]; requests that do not fit: padding."""
        bs = self.p.block_size
        block = self.block_table.gather(1, positions // bs).long()
        return torch.where(self.fits.unsqueeze(1), block * bs + positions % bs, _PAD_SLOT)

    def __call__(self, tokens: torch.Tensor, prev_slots: torch.Tensor, level: int) -> torch.Tensor:
        batch, k = tokens.shape
        device = tokens.device
        if self.p.budget is not None:
            self.p.budget.level_started(batch * k)
        # Hidden state fed with each node: its parent's head output.
        if level == 2:
            parent_hidden = self.parent_hidden.expand(batch, k, -1).contiguous()
        else:
            hidden_size = self.parent_hidden.shape[-1]
            parent_hidden = self.parent_hidden.gather(1, prev_slots.unsqueeze(-1).expand(-1, -1, hidden_size))
        # Region slot of this level's nodes, and what each of them may see.
        region_len = (level - 1) * k
        own = (level - 2) * k + torch.arange(k, device=device)
        visible = torch.zeros(batch, k, region_len, dtype=torch.bool, device=device)
        if self.visible is not None:
            visible[:, :, : region_len - k] = self.visible.gather(
                1, prev_slots.unsqueeze(-1).expand(-1, -1, self.visible.shape[-1])
            )
        visible[:, torch.arange(k, device=device), own] = True
        self.visible = visible

        storage = self.start.unsqueeze(1) + own.unsqueeze(0)  # [B, K]
        # Materialised: vLLM's CPU kernels index these flat, a stride-0 view would be misread.
        positions = (self.root_pos + level - 1).repeat_interleave(k).view(batch, k)
        num_tokens = batch * k
        qsl_cpu = torch.arange(0, num_tokens + 1, k, dtype=torch.int32)
        qsl = to_device(qsl_cpu, device)
        seq_lens = (self.start + region_len).to(torch.int32)
        max_seq_len = self.max_seq_len + region_len
        cad = dataclasses.replace(
            self.cad,
            query_start_loc=qsl,
            query_start_loc_cpu=qsl_cpu,
            seq_lens=seq_lens,
            num_reqs=batch,
            num_actual_tokens=num_tokens,
            max_query_len=k,
            max_seq_len=max_seq_len,
            block_table_tensor=self.block_table,
            slot_mapping=self._slots(storage).flatten(),
            positions=positions.flatten(),
            seq_lens_cpu_upper_bound=torch.full((batch,), max_seq_len, dtype=torch.int32),
            is_prefilling=None,
        )
        level_batch = attention.TreeBatch(
            rows=torch.arange(num_tokens, device=device),
            query_start_loc=qsl.long(),
            block_table=self.block_table,
            context_lens=self.start,
            region_lens=torch.full_like(self.start, region_len),
            mask=pack_tree_mask(visible),
        )
        # The head's inputs go through the proposer's persistent buffers, as vLLM's own draft loop
        # feeds them: a compiled head was traced on those (int32 ids; a guard-free compiled graph
        # reads an int64 id tensor as int32 pairs, and the drafts after the first level were noise),
        # and its CUDA graphs read them.
        p = self.p
        p.input_ids[:num_tokens] = p._token_ids(tokens).flatten()
        p.positions[:num_tokens] = positions.flatten()
        p.hidden_states[:num_tokens] = parent_hidden.flatten(0, 1)
        with attention.tree_batch(level_batch):
            last_hidden, hidden = p._run_head(cad, num_tokens, first_pass=False)
        self.parent_hidden = hidden.view(batch, k, -1)
        return self.p._draft_logits(last_hidden).view(batch, k, -1)
