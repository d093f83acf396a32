"""The head's catch-up, deferred over steps that send no drafts.

Each step the head runs once over the tokens the target just accepted (the catch-up pass), so
that its KV cache holds every token: its later drafts read that context (skipping the pass left
gaps, and the drafts after a run of such steps were rejected: top-1 acceptance 7% against 41%
on SmolLM2). A step that sends no drafts needs nothing else from the head. Its catch-up rows wait
here instead: the target's hidden state at each request's position, the token sampled after it,
and the position. They run as one head pass when drafting resumes, before that step's own
catch-up: a step without drafts then costs what a plain step costs, and the head's context has no
gap. A request that finishes while its rows wait never costs the head anything (at batch 16 on
CPU, where drafting seldom pays, the head's catch-up was 3.5% of every step).

Two bounds make the rows run earlier: all of them must fit one head pass, and under prefix caching
a row in a full KV block (which the prefix cache may hand to a later request, whose drafts would
read the head's K/V there) waits at most :data:`MAX_STEPS` steps. Rows of a request's last, partial
block are its own: they wait until it drafts again or leaves.

Steps wait that discard no sample (no partial prefill): each scheduled token is then a catch-up
row, a decoding request's one token as a new request's whole prompt. A step that verified drafts
(lookup chains sent alone, or a probe's tree) waits too: its rows are in chain order after
verification, and those past the accepted drafts are dropped when the rows run, as the request's
next rows begin at or before them; so the head's catch-up waits all through a run of lookup
chains. A request's rows are consecutive positions that end where its next catch-up begins. Rows
whose request left the batch, or came back at another position (preempted, then recomputed), are
dropped: that request's catch-up covers its context again.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from vllm_eagle2.device import to_device

if TYPE_CHECKING:
    from vllm.v1.attention.backend import CommonAttentionMetadata
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from vllm_eagle2.engine.step_state import Eagle2Step


class CatchUpHead(Protocol):
    """The drafter as the waiting rows see it (:class:`~vllm_eagle2.engine.proposer.Eagle2Proposer`).

    method: ``"eagle"`` or ``"eagle3"`` (whose head reads the target's auxiliary rows);
    block_size: the KV cache's block size; catch_up_pass: one causal head pass over rows of
    tokens [R] (target ids), positions [R] and the target's hidden states [R, H'], with ``cad``'s
    attention metadata, writing the head's K/V at those positions.
    """

    method: str
    block_size: int

    def catch_up_pass(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        cad: CommonAttentionMetadata,
    ) -> None: ...


#: Under prefix caching, the steps rows in full KV blocks may wait: how far prefix-cached blocks
#: may lag in head KV.
MAX_STEPS = 16


@dataclass
class WaitingStep:
    """One deferred step's catch-up rows: its scheduled tokens, grouped by request in batch order.

    req_ids: the step's B requests; counts: [B] int64 host, each one's rows; positions: [T] int64
    host, each row's position; hidden: [T, H'] the target's hidden states there (an EAGLE-3 head's
    auxiliary ones, concatenated, as vLLM hands them to the drafter); tokens: [T] the token that
    follows each row (the next scheduled one, or the one sampled after a request's last row).
    """

    req_ids: list[str]
    counts: np.ndarray
    positions: np.ndarray
    hidden: torch.Tensor
    tokens: torch.Tensor

    @property
    def starts(self) -> np.ndarray:
        """[B] int64 host, each request's first position."""
        return self.positions[np.cumsum(self.counts) - self.counts]


@dataclass
class CatchUpRows:
    """Rows to run in one head pass, grouped by request in batch order, positions ascending.

    batch_rows: [R'] int64 host, each request's row in the current batch; counts: [R'] int64 host,
    its rows; positions: [R] int64 host; hidden: [R, H']; tokens: [R] (device, as stored).
    """

    batch_rows: np.ndarray
    counts: np.ndarray
    positions: np.ndarray
    hidden: torch.Tensor
    tokens: torch.Tensor


class DeferredCatchUp:
    """Catch-up rows of steps without drafts, until the head runs them (host bookkeeping only).

    max_rows: the head's widest pass; block_size: the prefix cache's block (0: no prefix caching,
    no row is shared); max_steps: the steps a row in a full block may wait.
    """

    def __init__(self, max_rows: int, block_size: int = 0, max_steps: int = MAX_STEPS) -> None:
        self.max_rows = max_rows
        self.block_size = block_size
        self.max_steps = max_steps
        self.waiting: list[WaitingStep] = []
        self._first: dict[str, int] = {}  # request id -> its first waiting position
        self.deferred_steps = 0
        self.flushes = 0
        self.rows_run = 0
        self.rows_dropped = 0

    @property
    def rows(self) -> int:
        return sum(len(s.positions) for s in self.waiting)

    def has_room(self, rows: int, req_ids: list[str], starts: np.ndarray, ends: np.ndarray) -> bool:
        """Whether a step of ``rows`` rows may wait: all waiting rows still fit one head pass, and
        none in a full block has waited ``max_steps`` steps.

        req_ids: the step's B requests; starts / ends: [B] int64 host, each one's first row this
        step and its context after the step."""
        if self.rows + rows > self.max_rows:
            return False
        if len(self.waiting) < self.max_steps or not self.block_size:
            return True
        # Host arrays (no device read); requests without waiting rows start with this step's.
        first = np.fromiter(map(self._first.get, req_ids, starts.tolist()), np.int64, len(req_ids))
        # A request's waiting rows span [first, end): one lies in a full block once a block ends there.
        return not (first // self.block_size < ends // self.block_size).any()

    def defer(self, step: WaitingStep) -> None:
        """Keep a step's rows; its tensors must be copies (the runner reuses its buffers)."""
        self.waiting.append(step)
        self.deferred_steps += 1
        # Earlier steps' first positions stand (host arrays: no device read).
        self._first = {**dict(zip(step.req_ids, step.starts.tolist())), **self._first}

    def take(self, batch_rows: dict[str, int], next_positions: np.ndarray) -> CatchUpRows | None:
        """The waiting rows that still belong where they were, and an empty queue; None if none do.

        batch_rows: request id -> its row in the current batch; next_positions: [B] int64 host, the
        first position of each row's catch-up this step. A verifying step's rows past a request's
        accepted drafts are replaced: the request's next rows begin at or before them. A request's
        other rows are kept only when they are the consecutive positions that end right before
        ``next_positions``."""
        waiting, self.waiting, self._first = self.waiting, [], {}
        if not waiting:
            return None
        # One group per (waiting step, request): its batch row now, its first position, its rows.
        group_rows = np.concatenate(
            [np.array([batch_rows.get(r, -1) for r in s.req_ids], dtype=np.int64) for s in waiting]
        )
        group_counts = np.concatenate([s.counts for s in waiting])
        group_starts = np.concatenate([s.starts for s in waiting])
        group_steps = np.repeat(np.arange(len(waiting)), [len(s.counts) for s in waiting])
        # Each group holds positions up to where the request's next group (or this step) starts.
        by_request = np.lexsort((group_steps, group_rows))
        ends = np.append(group_starts[by_request][1:], 0)
        last_of_request = np.append(group_rows[by_request][1:] != group_rows[by_request][:-1], True)
        ends[last_of_request] = next_positions[group_rows[by_request][last_of_request].clip(min=0)]
        group_ends = np.empty_like(ends)
        group_ends[by_request] = ends
        owners = np.repeat(group_rows, group_counts)
        positions = np.concatenate([s.positions for s in waiting])
        replaced = (owners >= 0) & (positions >= np.repeat(group_ends, group_counts))
        rows = np.where(replaced, -1, owners)
        order = np.lexsort((positions, rows))
        rows, positions = rows[order], positions[order]
        present = rows >= 0
        counts = np.bincount(rows[present], minlength=len(next_positions))
        first = np.full(len(next_positions), np.iinfo(np.int64).max)
        last = np.full(len(next_positions), -1)
        np.minimum.at(first, rows[present], positions[present])
        np.maximum.at(last, rows[present], positions[present])
        # Consecutive (distinct positions, no gap) and ending right before this step's catch-up.
        whole = (counts > 0) & (last + 1 == next_positions) & (last - first + 1 == counts)
        distinct = np.ones(len(rows), dtype=bool)
        distinct[1:] = (rows[1:] != rows[:-1]) | (positions[1:] != positions[:-1])
        whole &= np.bincount(rows[present & distinct], minlength=len(next_positions)) == counts
        keep = present & whole[rows.clip(min=0)]
        # A kept request's replaced rows were rejected drafts, not dropped context.
        rejected = replaced & whole[owners.clip(min=0)]
        self.rows_dropped += int(len(rows) - keep.sum() - rejected.sum())
        if not keep.any():
            return None
        index = torch.from_numpy(order[keep]).to(waiting[0].hidden.device)
        kept_rows = np.flatnonzero(whole)
        self.flushes += 1
        self.rows_run += int(keep.sum())
        return CatchUpRows(
            batch_rows=kept_rows,
            counts=counts[kept_rows],
            positions=positions[keep],
            hidden=torch.cat([s.hidden for s in waiting]).index_select(0, index),
            tokens=torch.cat([s.tokens for s in waiting]).index_select(0, index),
        )

    def summary(self) -> dict[str, int]:
        return {
            "catch_up_deferred_steps": self.deferred_steps,
            "catch_up_flushes": self.flushes,
            "catch_up_rows_run": self.rows_run,
            "catch_up_rows_dropped": self.rows_dropped,
        }


def rows_may_wait(
    step: Eagle2Step | None, batch: int, sampled: torch.Tensor | list[list[int]], discarded: np.ndarray
) -> bool:
    """Whether a step's catch-up rows may wait: it discards no sample (``discarded``: [B] bool host,
    a partial prefill's), ``sampled`` is the device tensor of its samples, and the target's
    hidden-state rows (:class:`~.step_state.Eagle2Step`) are at hand. A step that verified drafts
    may wait too: its accepted rows are in chain order by now (the verifier moved them)."""
    if step is None or batch == 0 or not step.hidden_states or not isinstance(sampled, torch.Tensor):
        return False
    return not discarded.any()


def step_rows(
    req_ids: list[str],
    query_start_loc: np.ndarray,
    starts: np.ndarray,
    input_ids: torch.Tensor,
    hidden: torch.Tensor,
    sampled: torch.Tensor,
    drafts: np.ndarray | None = None,
) -> WaitingStep:
    """A step's catch-up rows, as the head's first pass would read them (copies).

    req_ids: the B requests; query_start_loc: [B + 1] host, their rows; starts: [B] host, each one's
    first position; input_ids: the scheduled tokens (the first T); hidden: the target's rows;
    sampled: [B, W] the tokens sampled for each request (-1 past those it accepted); drafts: [B]
    int64 host, the drafts each one verified (None: none did).

    A request's rows are followed by the next scheduled token, but its last ``1 + drafts``: root
    and drafts, in chain order after verification, are followed by its samples, the accepted drafts
    and the token after them. Rows past the accepted drafts are kept too (the accepted count lies
    on the device): :meth:`DeferredCatchUp.take` drops them.
    """
    counts = np.diff(query_start_loc).astype(np.int64)
    total = int(query_start_loc[-1])
    within = np.arange(total) - np.repeat(query_start_loc[:-1], counts)
    positions = np.repeat(starts.astype(np.int64), counts) + within
    drafts = np.zeros_like(counts) if drafts is None else drafts
    column = within - np.repeat(counts - 1 - drafts, counts)  # of the request's samples; < 0: none
    from_sampled = column >= 0
    index = np.repeat(np.arange(len(counts)) * sampled.shape[1], counts) + column.clip(min=0)
    device = input_ids.device
    tokens = torch.empty_like(input_ids[:total])
    tokens[:-1] = input_ids[1:total]
    samples = sampled.reshape(-1).to(tokens.dtype)[to_device(index, device)]
    tokens = torch.where(to_device(from_sampled, device), samples, tokens)
    return WaitingStep(list(req_ids), counts, positions, hidden[:total].clone(), tokens)


def waiting_rows_metadata(
    cad: CommonAttentionMetadata, rows: CatchUpRows, block_size: int
) -> tuple[CommonAttentionMetadata, torch.Tensor]:
    """vLLM's attention metadata for one causal head pass over ``rows``, from this step's ``cad``
    (its block table, in batch order); and the rows' positions [R] on the device.

    Request j of the pass is batch row ``rows.batch_rows[j]``: its queries are its waiting rows,
    its context ends right after the last of them, and each row's K/V goes to its position's slot.
    """
    device = cad.query_start_loc.device
    ends_at = np.cumsum(rows.counts)
    qsl_cpu = torch.zeros(len(rows.counts) + 1, dtype=torch.int32)
    qsl_cpu[1:] = torch.from_numpy(ends_at).to(torch.int32)
    seq_lens = torch.from_numpy(rows.positions[ends_at - 1] + 1).to(torch.int32)
    positions = to_device(rows.positions, device)
    block_table = cad.block_table_tensor[to_device(rows.batch_rows, device)]
    owner = torch.repeat_interleave(
        torch.arange(len(rows.counts), device=device), to_device(rows.counts, device)
    )
    slots = block_table[owner, positions // block_size].long() * block_size + positions % block_size
    metadata = dataclasses.replace(
        cad,
        query_start_loc=to_device(qsl_cpu, device),
        query_start_loc_cpu=qsl_cpu,
        seq_lens=to_device(seq_lens, device),
        num_reqs=len(rows.counts),
        num_actual_tokens=len(rows.positions),
        max_query_len=int(rows.counts.max()),
        max_seq_len=int(seq_lens.max()),
        block_table_tensor=block_table,
        slot_mapping=slots,
        positions=positions,
        seq_lens_cpu_upper_bound=seq_lens,
        is_prefilling=None,
    )
    return metadata, positions


def rows_wait(
    queue: DeferredCatchUp,
    head: CatchUpHead,
    runner: GPUModelRunner,
    batch: int,
    step: Eagle2Step,
    sampled: torch.Tensor | list[list[int]],
    cad: CommonAttentionMetadata | None,
) -> bool:
    """Keep this step's catch-up rows in ``queue``, if they may wait (:func:`rows_may_wait`); with
    the queue at its length, run them with the waiting ones, in one head pass. ``runner``: vLLM's
    model runner, whose step inputs the rows are copied from; ``step``: the
    :class:`~.step_state.Eagle2Step`. Returns whether the rows waited (False: the step's own
    catch-up pass runs them, after the waiting rows)."""
    if cad is None or not rows_may_wait(step, batch, sampled, runner.discard_request_mask.np[:batch]):
        return False
    qsl = runner.query_start_loc.np[: batch + 1]
    total = int(qsl[-1])
    req_ids = runner.input_batch.req_ids[:batch]
    starts = runner.input_batch.num_computed_tokens_cpu[:batch]
    ends = starts + np.diff(qsl)
    full = not queue.has_room(total, req_ids, starts, ends)
    # With the queue full, propose runs the waiting rows, then this step's catch-up: where the rows
    # would not fit one pass, and where the step verified drafts (which of its rows were accepted
    # the host learns only from the next step's positions).
    if full and (queue.rows + total > queue.max_rows or step.verify is not None):
        return False
    hidden = step.hidden_states  # EAGLE-3: the auxiliary rows, as vLLM hands the drafter them
    rows = torch.cat(hidden[1:], dim=-1) if head.method == "eagle3" else hidden[0]
    drafts = None if step.verify is None else step.verify.num_drafts_host
    queue.defer(step_rows(req_ids, qsl, starts, runner.input_ids.gpu, rows, sampled, drafts))
    if full:
        run_waiting(queue, head, runner, cad, ends)
    return True


def run_waiting(
    queue: DeferredCatchUp,
    head: CatchUpHead,
    runner: GPUModelRunner,
    cad: CommonAttentionMetadata,
    next_positions: np.ndarray,
) -> None:
    """The rows waiting in ``queue``, in one causal head pass that writes the head's KV at their
    positions, before the catch-up at ``next_positions`` ([B] host, each request's next row) reads
    it. ``cad``: this step's attention metadata (its block table)."""
    if not queue.waiting:
        return
    req_ids = runner.input_batch.req_ids[: len(next_positions)]
    waiting = queue.take({rid: i for i, rid in enumerate(req_ids)}, next_positions)
    if waiting is None:
        return
    caught_up, positions = waiting_rows_metadata(cad, waiting, head.block_size)
    head.catch_up_pass(waiting.tokens, positions, waiting.hidden, caught_up)
