"""The engine-independent pieces of an eagle2 step on a CUDA device: timings and kernel checks.

vLLM is not needed: the draft logits, the target logits and the paged KV cache are random
tensors of a real model's shapes (speed does not depend on their values), so this runs on
any machine with torch and Triton. ``scripts/bench_gpu.py`` is its command line; the
``gpu``-marked tests run :func:`run_checks` on a GPU.

Pieces, per batch size B:

* ``vocab top-k``: :func:`vllm_eagle2.kernels.vocab_topk` over ``[B * topk, V]`` draft logits
  (one tree level), beside the path it replaces: float32 log-softmax then ``torch.topk``;
* ``tree build``: :func:`vllm_eagle2.tree.build_dynamic_tree` with precomputed draft logits
  (the head's passes are not timed), eager and replayed from a CUDA graph;
* ``masks``: :func:`vllm_eagle2.kernels.build_tree_masks` of the kept tree;
* ``verify greedy`` / ``verify T=1``: :func:`vllm_eagle2.verify.verifier.verify_tree` over target
  logits ``[B, m + 1, V]``, eager and from a CUDA graph;
* ``tree attention``: :func:`vllm_eagle2.kernels.paged_tree_attention` (one layer) of q tree
  queries per request over C context tokens in a paged cache, beside torch SDPA over the same
  number of dense tokens.

Each row gives the wall time per call (synchronised), the GPU kernel time and the kernel
launches per call (from torch's profiler).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F

from vllm_eagle2.budget.decisions import allocate_nodes
from vllm_eagle2.kernels import build_tree_masks, paged_tree_attention, vocab_topk
from vllm_eagle2.tree import build_dynamic_tree
from vllm_eagle2.verify.verifier import verify_tree

__all__ = ["Shapes", "Timing", "bench_attention", "bench_tree_core", "run_checks"]


@dataclass(frozen=True)
class Shapes:
    """A target and tree configuration (defaults: Llama-3-8B, the paper's tree)."""

    vocab: int = 128_256
    depth: int = 6
    topk: int = 10
    num_nodes: int = 60
    heads: int = 32
    kv_heads: int = 8
    head_size: int = 128
    block_size: int = 16
    dtype: torch.dtype = torch.bfloat16


@dataclass
class Timing:
    """One benchmark row: wall microseconds per call (median), GPU kernel time, launches."""

    piece: str
    variant: str
    batch: int
    wall_us: float
    gpu_us: float | None = None
    launches: float | None = None
    context: int | None = None
    queries: int | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_call(
    fn: Callable[[], Any], device: torch.device, *, repeats: int = 20, warmup: int = 3
) -> tuple[float, float | None, float | None]:
    """(wall us per call, GPU kernel us per call, kernel launches per call) of ``fn``."""
    for _ in range(warmup):
        fn()
    _sync(device)
    walls = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        _sync(device)
        walls.append((time.perf_counter() - start) * 1e6)
    wall = statistics.median(walls)
    if device.type != "cuda":
        return wall, None, None
    from torch.profiler import ProfilerActivity, profile

    calls = max(3, repeats // 4)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        _sync(device)
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    gpu = sum(getattr(e, "device_time", getattr(e, "cuda_time", 0.0)) for e in kernels) / calls
    return wall, gpu, len(kernels) / calls


def capture(fn: Callable[[], Any], device: torch.device) -> tuple[Callable[[], None], Any]:
    """Capture ``fn`` in a CUDA graph; returns (replay, the graph's output tensors)."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(2):  # warm up kernels and the allocator outside the graph
            fn()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph.replay, out


class _TreeCase:
    """Random draft logits for every level and random target logits of one batch."""

    def __init__(self, shapes: Shapes, batch: int, device: torch.device, seed: int = 0) -> None:
        gen = torch.Generator(device=device).manual_seed(seed)
        s = shapes
        self.shapes, self.batch = s, batch
        randn = lambda *shape: torch.randn(*shape, generator=gen, device=device, dtype=torch.float32)  # noqa: E731
        # Draft logits with a few confident tokens, as a trained head's are.
        self.root = (3 * randn(batch, s.vocab)).to(s.dtype)
        self.levels = (3 * randn(s.depth - 1, batch, s.topk, s.vocab)).to(s.dtype)
        self.target = (3 * randn(batch, s.num_nodes + 1, s.vocab)).to(s.dtype)
        self.temperature = torch.ones(batch, device=device)

    def build(self):
        levels = self.levels
        return build_dynamic_tree(
            self.root,
            lambda tokens, prev_slots, level: levels[level - 2],
            depth=self.shapes.depth,
            topk=self.shapes.topk,
            num_nodes=self.shapes.num_nodes,
        )

    def verify(self, tree, *, sampled: bool):
        return verify_tree(
            tree.tokens,
            tree.parents,
            self.target,
            temperature=self.temperature if sampled else None,
        )


def bench_tree_core(
    shapes: Shapes, batch: int, device: torch.device, *, repeats: int = 20, baseline: Any = None
) -> list[Timing]:
    """Timings of the tree build, masks, verification and the vocabulary top-k at one batch size.

    ``baseline``: optional namespace with an earlier release's ``tree``, ``verify`` and ``kernels``
    modules, timed beside (variant "baseline"); its tree build is given float32 log-probs
    precomputed, as its proposer did.
    """
    case = _TreeCase(shapes, batch, device)
    rows: list[Timing] = []

    def add(piece: str, variant: str, fn: Callable[[], Any]) -> None:
        rows.append(Timing(piece, variant, batch, *time_call(fn, device, repeats=repeats)))

    flat = case.levels[0].view(-1, shapes.vocab)
    add("vocab top-k", "fused", lambda: vocab_topk(flat, shapes.topk))
    add(
        "vocab top-k", "fp32 log-softmax + torch.topk", lambda: flat.float().log_softmax(-1).topk(shapes.topk)
    )
    tree = case.build()
    add("tree build", "eager", case.build)
    add("masks", "eager", lambda: build_tree_masks(tree.parents, check_values=False))
    add("verify greedy", "eager", lambda: case.verify(tree, sampled=False))
    add("verify T=1", "eager", lambda: case.verify(tree, sampled=True))
    if baseline is not None:
        root_lp = case.root.float().log_softmax(-1)
        levels_lp = case.levels.float().log_softmax(-1)

        def old_build():
            return baseline.tree.build_dynamic_tree(
                root_lp,
                lambda tokens, prev_slots, level: levels_lp[level - 2],
                depth=shapes.depth,
                topk=shapes.topk,
                num_nodes=shapes.num_nodes,
            )

        old_verify = baseline.verify.verify_tree
        add("tree build", "baseline", old_build)
        add("masks", "baseline", lambda: baseline.kernels.build_tree_masks(tree.parents))
        add("verify greedy", "baseline", lambda: old_verify(tree.tokens, tree.parents, case.target))
        add(
            "verify T=1",
            "baseline",
            lambda: old_verify(tree.tokens, tree.parents, case.target, temperature=case.temperature),
        )
        del root_lp, levels_lp
    if device.type == "cuda":
        for piece, fn in (
            ("tree build", case.build),
            ("verify greedy", lambda: case.verify(tree, sampled=False)),
            ("verify T=1", lambda: case.verify(tree, sampled=True)),
        ):
            try:
                replay, _ = capture(fn, device)
            except Exception as exc:  # noqa: BLE001 - a failed capture is a result, reported as such
                print(f"[gpu_bench] {piece}: CUDA graph capture failed: {exc}")
                continue
            add(piece, "CUDA graph", replay)
    return rows


class _AttentionCase:
    """A paged cache of R requests with C context tokens, q tree queries each (last q of q region)."""

    def __init__(
        self, shapes: Shapes, requests: int, context: int, queries: int, device: torch.device
    ) -> None:
        s = shapes
        gen = torch.Generator(device=device).manual_seed(1)
        per_req = math.ceil((context + queries) / s.block_size)
        blocks = requests * per_req
        rand = lambda *shape: torch.randn(*shape, generator=gen, device=device).to(s.dtype)  # noqa: E731
        self.kv = rand(blocks, s.kv_heads, s.block_size, 2 * s.head_size)  # vLLM's CUDA "LBHNC" layout
        self.key, self.value = self.kv[..., : s.head_size], self.kv[..., s.head_size :]
        # Blocks of a request scattered over the cache, as after a while of serving.
        perm = torch.randperm(blocks, generator=gen, device=device).to(torch.int32)
        self.block_table = perm.view(requests, per_req)
        self.query = rand(requests * queries, s.heads, s.head_size)
        self.qsl = torch.arange(requests + 1, device=device, dtype=torch.int32) * queries
        self.context_lens = torch.full((requests,), context, device=device, dtype=torch.int32)
        self.region_lens = torch.full((requests,), queries, device=device, dtype=torch.int32)
        # A random tree over the region: each query sees itself and a random earlier query.
        parents = (
            torch.arange(queries, device=device)
            - 1
            - torch.randint(0, 3, (queries,), generator=gen, device=device)
        )
        parents = parents.clamp(min=-1).expand(requests, queries)
        self.mask = build_tree_masks(parents).packed
        self.scale = s.head_size**-0.5
        self.max_context = context
        # Dense reference: the same number of tokens, contiguous, no mask.
        self.q_dense = rand(requests, s.heads, queries, s.head_size)
        self.k_dense = rand(requests, s.kv_heads, context + queries, s.head_size)
        self.v_dense = rand(requests, s.kv_heads, context + queries, s.head_size)

    def tree(self, backend: str = "auto", plan_cache: dict | None = None) -> torch.Tensor:
        return paged_tree_attention(
            self.query,
            self.key,
            self.value,
            self.block_table,
            self.qsl,
            self.context_lens,
            self.region_lens,
            self.mask,
            self.scale,
            backend=backend,
            plan_cache=plan_cache,
        )

    def dense(self) -> torch.Tensor:
        return F.scaled_dot_product_attention(self.q_dense, self.k_dense, self.v_dense, enable_gqa=True)


def bench_attention(
    shapes: Shapes,
    requests: int,
    context: int,
    queries: int,
    device: torch.device,
    *,
    repeats: int = 20,
    baseline: Any = None,
) -> list[Timing]:
    """One layer of tree attention (plan shared across calls, as across a forward's layers) and SDPA."""
    case = _AttentionCase(shapes, requests, context, queries, device)
    plan: dict = {}
    variants = [("tree attention", lambda: case.tree(plan_cache=plan)), ("dense SDPA", case.dense)]
    if baseline is not None:
        old = baseline.kernels.paged_tree_attention
        args = (case.query, case.key, case.value, case.block_table, case.qsl)
        rest = (case.context_lens, case.region_lens, case.mask, case.scale)
        variants.append(("baseline tree attention", lambda: old(*args, *rest)))
    rows = []
    for variant, fn in variants:
        wall, gpu, launches = time_call(fn, device, repeats=repeats)
        rows.append(Timing("attention", variant, requests, wall, gpu, launches, context, queries))
    return rows


def _allocation_case(shapes: Shapes, batch: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Arguments of :func:`allocate_nodes` for ``batch`` random trees of ``shapes.num_nodes`` nodes:
    path values best first per row, depths 1..depth, one request without drafts, a linear step cost."""
    gen = torch.Generator(device="cpu").manual_seed(1)
    n = shapes.num_nodes
    values = (-3 * torch.rand(batch, n, generator=gen)).sort(dim=1, descending=True).values
    depths = torch.randint(1, shapes.depth + 1, (batch, n), generator=gen).sort(dim=1).values
    allowed = torch.ones(batch, dtype=torch.bool)
    allowed[3] = False
    correction = torch.linspace(1.0, 0.5, shapes.depth + 1)
    step_seconds = 0.02 + 2e-4 * torch.arange(batch * n + 1, dtype=torch.float32)
    return tuple(x.to(device) for x in (values, depths, allowed, correction, step_seconds))


def run_checks(shapes: Shapes, device: torch.device) -> dict[str, str]:
    """Every kernel against its torch twin on ``device``, CUDA graphs against eager.

    Returns check name -> "ok" or what differed.
    """
    results: dict[str, str] = {}

    def check(name: str, ok: bool, detail: str = "") -> None:
        results[name] = "ok" if ok else f"FAILED {detail}".strip()

    gen = torch.Generator(device=device).manual_seed(0)
    for dtype in (torch.float32, shapes.dtype):
        logits = (3 * torch.randn(37, shapes.vocab, generator=gen, device=device)).to(dtype)
        logits[0, 5] = float("nan")
        logits[1, 7] = float("inf")
        for k in (1, shapes.topk):
            got = vocab_topk(logits, k, backend="triton")
            want = vocab_topk(logits, k, backend="torch")
            check(
                f"vocab_topk {str(dtype).removeprefix('torch.')} k={k}",
                torch.allclose(got[0], want[0], atol=1e-5, rtol=0) and bool((got[0] > -math.inf).all()),
                f"max diff {(got[0] - want[0]).abs().max().item():.3g}",
            )

    # Float32 draft logits drawn as such: bf16 values cast up would tie, and tied tokens may
    # be ranked differently by the kernel (lowest index first) and torch.topk.
    case = _TreeCase(replace(shapes, dtype=torch.float32), 4, device)
    tree = case.build()
    cpu_tree = build_dynamic_tree(
        case.root.cpu(),
        lambda tokens, prev_slots, level: case.levels[level - 2].cpu(),
        depth=shapes.depth,
        topk=shapes.topk,
        num_nodes=shapes.num_nodes,
    )
    check(
        "tree on device equals tree on CPU",
        torch.equal(tree.tokens.cpu(), cpu_tree.tokens) and torch.equal(tree.parents.cpu(), cpu_tree.parents),
    )
    masks = build_tree_masks(tree.parents, backend="triton")
    twin = build_tree_masks(tree.parents, backend="torch")
    check(
        "masks kernel equals twin",
        torch.equal(masks.packed, twin.packed) and torch.equal(masks.depths, twin.depths),
    )
    greedy = case.verify(tree, sampled=False)
    cpu_greedy = verify_tree(cpu_tree.tokens, cpu_tree.parents, case.target.cpu())
    check(
        "greedy verification on device equals CPU",
        torch.equal(greedy.output_tokens.cpu(), cpu_greedy.output_tokens),
    )

    alloc = _allocation_case(shapes, 16, device)
    kept = allocate_nodes(*alloc)
    check(
        "node allocation on device equals CPU",
        torch.equal(kept.cpu(), allocate_nodes(*(x.cpu() for x in alloc))),
    )

    for queries in (8, shapes.num_nodes):
        att = _AttentionCase(shapes, 3, 300, queries, device)
        got = att.tree(backend="triton", plan_cache={}).float()
        want = att.tree(backend="torch").float()
        err = (got - want).abs().max().item()
        check(f"tree attention kernel vs twin q={queries}", err < 2e-2, f"max abs diff {err:.3g}")

    if device.type == "cuda":
        for name, fn in (
            ("tree build", case.build),
            ("greedy verification", lambda: case.verify(tree, sampled=False)),
            ("node allocation", lambda: allocate_nodes(*alloc)),
        ):
            eager = fn()
            try:
                replay, out = capture(fn, device)
            except Exception as exc:  # noqa: BLE001 - reported as the check's outcome
                check(f"{name} replayed from a CUDA graph equals eager", False, f"capture failed: {exc}")
                continue
            replay()
            _sync(device)
            if name == "node allocation":
                same = torch.equal(out, eager)
            else:
                fields = (
                    ("tokens", "parents") if name == "tree build" else ("output_tokens", "accepted_nodes")
                )
                same = all(torch.equal(getattr(out, f), getattr(eager, f)) for f in fields)
            check(f"{name} replayed from a CUDA graph equals eager", same)
    return results
