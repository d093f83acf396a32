"""Tree verification inside vLLM's V1 model runner (called from :mod:`vllm_eagle2.patches`; where
it sits in a step: :mod:`vllm_eagle2.engine.step`).

Per step, for the requests that carry drafts:

* :func:`prepare_tree_verification` (after ``_prepare_inputs``): recover each request's
  tree from the drafter's :class:`~vllm_eagle2.engine.step_state.ProposedTrees` (drafts without a
  matching tree, e.g. scheduler padding, are verified as a chain), give every node the
  RoPE position ``root + depth`` (its KV slot stays ``root + 1 + index``), and publish
  the per-request ancestor masks for the target forward into the step's ``tree_batch`` scope
  (``step.forward``), open around vLLM's ``execute_model``.
* :func:`sample_with_trees` (instead of the rejection sampler): verify every tree
  (greedy or sampled, per request), move the accepted nodes' target KV to the slots
  right after the root, and reorder the rows of hidden states, input ids and positions
  the same way, so that vLLM's scheduler and its EAGLE catch-up pass see an ordinary
  accepted chain.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING

import numpy as np
import torch
from vllm.v1.outputs import LogprobsTensors, SamplerOutput

from vllm_eagle2.device import cuda_path, to_device
from vllm_eagle2.engine import attention, seeding
from vllm_eagle2.engine.step_state import Eagle2Step, MatchedTrees, ProposedTrees, VerifyStep
from vllm_eagle2.kernels import PAD_PARENT, build_tree_masks
from vllm_eagle2.verify.verifier import verify_tree

if TYPE_CHECKING:
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from vllm_eagle2.engine.attention import TreeForward


def _padded_drafts(
    meta: SpecDecodeMetadata, device: torch.device, width: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Scheduled draft tokens [B, N] (-1 padded), valid mask [B, N], counts [B].

    N = ``width`` (:func:`_verify_width`), or more, should the scheduler send more. The counts
    come from the scheduler's host-side list, so nothing here syncs the device.
    """
    counts = meta.num_draft_tokens
    n = to_device(counts, device, torch.long)
    width = max(max(counts, default=0), width, 1)
    col = torch.arange(width, device=device)
    valid = col < n.unsqueeze(1)
    first = meta.cu_num_draft_tokens.to(device).long() - n
    flat = meta.draft_token_ids.to(device).long()
    idx = (first.unsqueeze(1) + col).clamp(max=max(flat.numel() - 1, 0))
    tokens = torch.where(valid, flat[idx] if flat.numel() else -1, -1)
    return tokens, valid, n


def _verify_width(runner: GPUModelRunner, counts: list[int]) -> int:
    """Draft width N the verifier pads this step's trees to.

    With the fixed budget, the configured drafts per step: fixed shapes. With the adaptive
    budget, the step's largest count rounded up to a power of two (a handful of shapes): the
    verifier's work is B * (N + 1) rows over the vocabulary, and padding a step that kept a
    few nodes per request to the upper bound (m = 60 by default) cost more than the nodes did
    (measured: batch 16 on the CPU, ~50 ms a step on top of a 36 ms pass). No request's
    samples depend on the width: seeded ones draw per output position (:mod:`.seeding`).
    """
    if runner.drafter.budget is None:
        return runner.num_spec_tokens
    top = max(max(counts, default=1), 1)
    return min(1 << (top - 1).bit_length(), max(runner.num_spec_tokens, top))


def _matched_trees(
    store: ProposedTrees | None,
    req_ids: list[str],
    tokens: torch.Tensor,
    valid: torch.Tensor,
    counts: np.ndarray,
) -> MatchedTrees:
    """Each request's drafts as its tree in ``store`` (the drafter's, proposed last step), else as a
    chain. counts: [B] drafts scheduled."""
    batch, width = tokens.shape
    device = tokens.device
    col = torch.arange(width, device=device)
    chain = (col - 1).expand(batch, width)
    off_chain = np.zeros((batch, width), dtype=bool)
    if store is None or not req_ids:
        zeros = torch.zeros(batch, width, dtype=torch.long, device=device)
        none = torch.full((batch,), -1, dtype=torch.long, device=device)
        return MatchedTrees(
            torch.where(valid, chain, -1), valid & False, zeros, zeros.float(), valid & False, none, off_chain
        )
    if store.req_ids == req_ids:  # the usual case: the batch kept its order
        src_host = np.arange(batch)
    else:
        row_of = {rid: i for i, rid in enumerate(store.req_ids)}
        src_host = np.array([row_of.get(rid, -1) for rid in req_ids], dtype=np.int64)
    found = src_host >= 0
    sent = min(width, store.off_chain.shape[1])
    off_chain[found, :sent] = store.off_chain[src_host[found], :sent]
    off_chain &= np.arange(width) < counts[:, None]
    src = to_device(src_host, device)
    take = min(width, store.tokens.shape[1])

    def stored(field: torch.Tensor, fill: float) -> torch.Tensor:
        out = torch.full((batch, width), fill, dtype=field.dtype, device=device)
        out[:, :take] = field[src.clamp(min=0), :take]
        return out

    st_tokens = stored(store.tokens, -1)
    # A prefix of a best-first tree is a tree: the budget or the scheduler may have cut it short.
    # (Only drafts that were sent can match: seeding._draft_depths makes the same match on the host.)
    n_sent = store.off_chain.shape[1]
    same = (src >= 0) & ((st_tokens == tokens) | ~valid).all(dim=1) & (valid.sum(1) <= n_sent)
    known = same.unsqueeze(1) & valid
    parents = torch.where(known, stored(store.parents, -1), chain)
    return MatchedTrees(
        parents=torch.where(valid, parents, -1),
        known=known,
        ranks=stored(store.ranks, 0),
        scores=stored(store.scores, 0.0),
        grafted=stored(store.grafted, False) & known,
        lookup_buckets=torch.where(src >= 0, store.lookup_buckets[src.clamp(min=0)], -1),
        off_chain=off_chain,
    )


def prepare_tree_verification(
    runner: GPUModelRunner, step: Eagle2Step, meta: SpecDecodeMetadata | None
) -> None:
    """Positions and attention masks for the trees of this step (after ``_prepare_inputs``);
    sets ``step.verify`` (None without drafts).

    Runs inside ``execute_model``'s ``tree_batch`` scope (``step.forward``) and publishes the
    masks there. Reads
    nothing back from the device: which drafts need a tree mask is known on the host
    (:attr:`MatchedTrees.off_chain`). A step whose trees are all chains needs no masks, no new
    positions and no KV moves: vLLM's causal attention verifies it as it is.

    Raises:
        RuntimeError: no ``tree_batch`` scope is active.
    """
    forward = step.forward if step is not None else None
    if forward is None:
        raise RuntimeError("eagle2: no tree batch is active (expected inside execute_model's step)")
    step.verify = None
    if meta is None or max(meta.num_draft_tokens, default=0) == 0:
        return
    runner.drafter.counters.drafts += sum(meta.num_draft_tokens)
    device = runner.positions.device
    batch = len(meta.num_draft_tokens)
    counts = np.asarray(meta.num_draft_tokens, dtype=np.int64)
    tokens, valid, n = _padded_drafts(meta, device, _verify_width(runner, meta.num_draft_tokens))
    trees = _matched_trees(
        runner.drafter.proposed, list(runner.input_batch.req_ids[:batch]), tokens, valid, counts
    )
    runner.drafter.counters.unmatched_drafts += (valid & ~trees.known).sum()
    width = tokens.shape[1]
    row_start_host = runner.query_start_loc.np[:batch].astype(np.int64)
    row_start = to_device(row_start_host, device)
    verify = step.verify = VerifyStep(
        tokens=tokens,
        parents=trees.parents,
        num_drafts=n,
        num_drafts_host=counts,
        row_start=row_start,
        depths=torch.where(valid, torch.arange(width, device=device) + 1, 0),  # node i of a chain
        trees=trees,
    )
    spec = np.flatnonzero(trees.off_chain.any(axis=1))  # the requests whose trees branch
    if spec.size:
        _publish_tree_masks(runner, forward, verify, valid, spec, row_start_host)


def _publish_tree_masks(
    runner: GPUModelRunner,
    forward: TreeForward,
    verify: VerifyStep,
    valid: torch.Tensor,
    spec: np.ndarray,
    row_start: np.ndarray,
) -> None:
    """Give the tree nodes of the branching requests ``spec`` ([S] host rows) their RoPE positions,
    and publish the masks of their drafts off the leading chain into ``forward`` (the step's
    ``tree_batch`` scope). valid: [B, N] bool, the scheduled drafts; row_start: [B] host, each
    request's root row."""
    trees, n = verify.trees, verify.num_drafts
    batch, width = valid.shape
    device = valid.device
    # The region of each request is [root, nodes...]: root = region index 0.
    region_parents = torch.cat(
        [
            torch.full((batch, 1), -1, dtype=torch.long, device=device),
            torch.where(valid, trees.parents + 1, PAD_PARENT),
        ],
        dim=1,
    )
    masks = build_tree_masks(region_parents, check_values=False)  # valid by construction
    root_pos = runner.positions[verify.row_start]
    # RoPE position of node i is root + depth; its row and KV slot stay root + 1 + i. Written as a
    # delta (0 off the trees): padding entries may alias other requests' rows and must write nothing.
    node_rows = (verify.row_start.unsqueeze(1) + 1 + torch.arange(width, device=device)).clamp(
        max=runner.positions.shape[0] - 1
    )
    want = root_pos.unsqueeze(1) + masks.depths[:, 1:] - 1
    delta = torch.where(valid, want - runner.positions[node_rows], 0)
    runner.positions.index_add_(0, node_rows.flatten(), delta.flatten().to(runner.positions.dtype))

    # Only the drafts off the leading chain are recomputed with their masks. The others keep the
    # stock kernel's result, which saves work and keeps its rounding: the KV of an accepted chain
    # is then the one plain decoding writes (bf16, MT-bench, batch 16: eagle2's greedy outputs
    # identical to plain decoding in 51 of 64 answers, 46 when every row was recomputed). Query i
    # of a request reads mask row ``region[i]``: its off-chain drafts' region rows, in order.
    need = trees.off_chain[spec]
    q = need.sum(axis=1)
    qsl = np.zeros(spec.size + 1, dtype=np.int64)
    qsl[1:] = np.cumsum(q)
    region = 1 + np.argsort(~need, axis=1, kind="stable")[:, : int(q.max())]
    rows = (row_start[spec, None] + region)[np.arange(region.shape[1]) < q[:, None]]
    spec_t = to_device(spec, device)
    words = masks.packed.shape[-1]
    region_t = to_device(region, device)
    block_table = runner.input_batch.block_table[0].get_device_tensor(batch)
    tails = np.zeros(batch, dtype=np.int64)
    tails[spec] = q  # the off-chain drafts are the last of a request's rows (a leading chain's suffix)
    forward.publish(
        attention.TreeBatch(
            rows=to_device(rows, device),
            query_start_loc=to_device(qsl, device),
            block_table=block_table[spec_t],
            context_lens=root_pos[spec_t],
            region_lens=n[spec_t] + 1,
            mask=masks.packed[spec_t].gather(1, region_t.unsqueeze(-1).expand(-1, -1, words)),
            tails=tails,
        )
    )
    verify.depths = (masks.depths[:, 1:] - 1).clamp(min=0)  # mask depths count the root as 1
    runner.drafter.counters.count_tree_rows(spec.size, rows.size)


def sample_with_trees(
    runner: GPUModelRunner, step: Eagle2Step, logits: torch.Tensor, meta: SpecDecodeMetadata
) -> SamplerOutput:
    """Verify ``step.verify``'s trees; returns vLLM's SamplerOutput ([B, N + 1] int32, -1 padded)."""
    verify = step.verify
    sampling = runner.input_batch.sampling_metadata
    device = logits.device
    batch, width = verify.tokens.shape
    n = verify.num_drafts
    # Logits rows of request r: [root, node 0, ..., node n_r - 1], ending at cu_num_sampled[r].
    first_row = meta.cu_num_sampled_tokens.to(device).long() - (n + 1)
    col = torch.arange(width + 1, device=device)
    row_idx = first_row.unsqueeze(1) + torch.minimum(col.unsqueeze(0), n.unsqueeze(1))
    # vLLM's own sampler draws every request's token at its root, as in a step without
    # drafts: requests without a tree take it, so a request samples the same way whatever
    # else is in the batch. A seeded request's generator was seeded for this position
    # (seeding.reseed), and its tree's rows are vLLM's samples too, one generator per output
    # position: its tokens do not depend on its drafts (verified by sample-match, drawing no
    # uniforms from its generator).
    plain = runner.sampler(
        logits=logits[first_row], sampling_metadata=replace(sampling, max_num_logprobs=None)
    )
    has_drafts = n > 0
    target = logits[row_idx]  # [B, N + 1, V]; rows without drafts repeat their root
    seeded = seeding.seeded_rows(runner, meta.num_draft_tokens)  # host lists: no device sync
    root = plain.sampled_token_ids.view(-1)
    choices = seeding.seeded_choices(runner, seeded, target, root, sampling) if seeded.rows else None
    result = verify_tree(
        verify.tokens,
        verify.parents,
        target,
        temperature=None if sampling.all_greedy else sampling.temperature,
        top_k=sampling.top_k,
        top_p=sampling.top_p,
        choices=choices,
    )
    # Requests without drafts keep vLLM's own sample at the root.
    out_tokens = torch.where(has_drafts.unsqueeze(1), result.output_tokens, -1)
    out_tokens[:, 0] = torch.where(has_drafts, out_tokens[:, 0], root.long())
    accepted = torch.where(has_drafts.unsqueeze(1), result.accepted_nodes, -1)
    num_accepted = torch.where(has_drafts, result.num_accepted, 0)
    out_width = out_tokens.shape[1]
    logprobs = None
    if sampling.max_num_logprobs is not None:
        # Output token j is the target's choice after path node j - 1 (the root for j = 0).
        path_rows = torch.cat(
            [torch.zeros(batch, 1, dtype=torch.long, device=device), accepted + 1],
            dim=1,
        )[:, :out_width]
        rows = logits[first_row.unsqueeze(1) + path_rows.clamp(min=0)].flatten(0, 1)
        logprobs = runner.sampler.gather_logprobs(
            runner.sampler.compute_logprobs(rows),
            sampling.max_num_logprobs,
            token_ids=out_tokens.flatten().clamp(min=0),
        )
        logprobs = LogprobsTensors(*logprobs[:3])
    if verify.branched:
        _move_accepted_path(runner, step, accepted, num_accepted)
    trees = verify.trees
    budget, lookup = runner.drafter.budget, runner.drafter.lookup
    if budget is not None:  # the head's calibration: its own nodes only
        budget.acceptance.record(
            verify.parents, verify.depths, trees.ranks, trees.scores, trees.known & ~trees.grafted, accepted
        )
    if lookup is not None:
        lookup.record(trees.grafted, trees.lookup_buckets, verify.parents, verify.depths, accepted)
    return SamplerOutput(sampled_token_ids=out_tokens.to(torch.int32), logprobs_tensors=logprobs)


def _move_accepted_path(
    runner: GPUModelRunner, step: Eagle2Step, accepted: torch.Tensor, num_accepted: torch.Tensor
) -> None:
    """Make rows (and KV slots) root + 1 .. root + k hold the accepted path, in order."""
    if accepted.numel() == 0:
        return
    k = torch.arange(accepted.shape[1], device=accepted.device)
    on_path = k.unsqueeze(0) < num_accepted.unsqueeze(1)
    # Off the path the pair is the root onto itself: a no-op that no other pair writes to (entries
    # past a request's drafts would alias the next request's rows).
    verify = step.verify
    root = verify.row_start.unsqueeze(1)
    dst = torch.where(on_path, root + 1 + k, root)
    src = torch.where(on_path, root + 1 + accepted, root)
    # Only an off-chain node lands away from its own row: its K/V moves from its slot in the cache.
    moved = on_path & (accepted != k)
    runner.drafter.counters.count_kv_moves(moved)
    slot_of = runner.input_batch.block_table[0].slot_mapping.gpu
    src_slots, dst_slots = slot_of[src].long(), slot_of[dst].long()
    if cuda_path(accepted.device):
        # Fixed shape, no sync: every (request, depth) pair is written; a no-op writes to slot -1,
        # which the cache writers skip.
        kv_src, kv_dst = src_slots.flatten(), torch.where(moved, dst_slots, -1).flatten()
        src, dst = src.flatten(), dst.flatten()
    else:
        # On the CPU a compaction costs no device sync and spares the cache writes of the no-ops.
        kv_src, kv_dst = src_slots[moved], dst_slots[moved]
        src, dst = src[moved], dst[moved]
        if src.numel() == 0:
            return
    layers = runner.vllm_config.compilation_config.static_forward_context
    attention.move_kv(runner.drafter.target_attn_layer_names, layers, kv_src, kv_dst)
    # The catch-up pass of the drafter reads these rows as the accepted chain.
    for hidden in step.hidden_states:
        hidden[dst] = hidden[src]
    runner.input_ids.gpu[dst] = runner.input_ids.gpu[src]
    runner.positions[dst] = runner.positions[src]


@dataclass
class VerifyCounters:
    """What an engine's tree verification exercised (``LLM.collective_rpc("eagle2_stats")``).

    Host counts, but for ``kv_moves`` ([1] int64 on the device, read only by :meth:`summary`, so
    that counting costs the step no sync).
    """

    device: torch.device
    drafts: int = 0  # draft tokens verified
    branched_steps: int = 0  # steps with at least one branching tree
    tree_rows: int = 0  # draft rows recomputed with their tree mask
    narrowed_steps: int = 0  # steps whose topk was cut so that a level fits max_num_batched_tokens
    kv_moves: torch.Tensor | None = None  # accepted off-chain nodes whose K/V was moved
    # Drafts verified that no proposed tree holds (zero-filled or stale drafts): 0 in a healthy engine.
    unmatched_drafts: torch.Tensor | None = None

    def __post_init__(self) -> None:
        self.kv_moves = torch.zeros(1, dtype=torch.long, device=self.device)
        self.unmatched_drafts = torch.zeros(1, dtype=torch.long, device=self.device)

    def count_tree_rows(self, requests: int, rows: int) -> None:
        self.branched_steps += requests > 0
        self.tree_rows += rows

    def count_kv_moves(self, moved: torch.Tensor) -> None:
        self.kv_moves += moved.sum()

    def summary(self) -> dict[str, int]:
        devices = ("kv_moves", "unmatched_drafts")
        counts = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("device", *devices)}
        return {**counts, **{name: int(getattr(self, name).item()) for name in devices}}
