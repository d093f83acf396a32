"""The CPU tree kernel (C++) and its torch twin, on vLLM's own KV layouts, against a float64 reference.

Caches are written by vLLM's own cache-write op wherever this machine runs it for the layout
("vec", "vec16"; "amx" on AMX CPUs), else by eagle2's torch twin of that writer, which the layout
tests check against vLLM's wherever both run. Slots no request wrote hold NaN: reading one would show.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from vllm_eagle2.kernels import (
    CPU_KV_LAYOUTS,
    build_tree_masks,
    check_cpu_kv_layout,
    cpu_layout,
    cpu_tree_attention,
    pack_tree_mask,
    plan_cpu_tree_attention,
    read_kv_slots,
    write_kv_slots,
)
from vllm_eagle2.kernels import tree_attention_cpu as cta
from vllm_eagle2.kernels._cpp import load_cpu_ops

BS = 32  # vLLM's CPU blocks hold multiples of 32 tokens
BACKENDS = ["cpp", "torch"]
SENTINEL = 7.0  # output rows the kernel must leave alone


def vllm_writes(isa: str, dtype: torch.dtype) -> bool:
    """Whether vLLM's own cache writer runs here for ``isa`` (its AMX build needs an AMX CPU)."""
    from vllm import _custom_ops as ops

    kv = torch.zeros(1, 1, BS, 128, dtype=dtype)
    k, v = kv.view(1, 1, 2 * BS, 64).chunk(2, dim=2)
    try:
        ops.cpu_attn_reshape_and_cache(torch.ones(1, 1, 64, dtype=dtype), torch.ones(1, 1, 64, dtype=dtype),
                                       k, v, torch.zeros(1, dtype=torch.long), isa)  # fmt: skip
    except RuntimeError:
        return False
    return True


def write_cache(
    isa: str, kv: torch.Tensor, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor
) -> None:
    if vllm_writes(isa, kv.dtype):
        from vllm import _custom_ops as ops

        nb, hkv, bs, d2 = kv.shape
        k, v = kv.view(nb, hkv, 2 * bs, d2 // 2).chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(key, value, k, v, slots, isa)
    else:
        write_kv_slots(kv, cpu_layout(isa), slots, key, value)


@dataclass
class Case:
    query: torch.Tensor  # [N, H, D], strided
    kv: torch.Tensor  # the layer's cache
    isa: str
    args: tuple  # plan_cpu_tree_attention's positional arguments
    num_rows: int
    keys: list[torch.Tensor]  # per request [C + T, Hkv, D]
    values: list[torch.Tensor]
    masks: list[torch.Tensor]  # per request [q, T] bool
    first: list[int]
    scale: float

    def plan(self):  # noqa: ANN201
        return plan_cpu_tree_attention(
            *self.args, num_blocks=self.kv.shape[0], block_size=self.kv.shape[2], num_rows=self.num_rows
        )


def region_rows(t: int, q: int, kind: str, rng: random.Random) -> torch.Tensor:
    """[q, T] bool: the visibility of the region's last q tokens."""
    if kind == "causal":
        return torch.ones(t, t, dtype=torch.bool).tril()[t - q :]
    if kind == "empty":
        return torch.zeros(q, t, dtype=torch.bool)
    parents = [rng.randrange(-1, i) for i in range(t)]  # -1: a root; parents precede children
    packed = build_tree_masks(torch.tensor([parents], dtype=torch.long)).packed[0]  # [T, W] int32
    j = torch.arange(t)
    dense = ((packed[:, j // 32] >> (j % 32).to(torch.int32)) & 1).bool()
    return dense[t - q :]


def make_case(
    requests: list[tuple[int, int, int, str]],
    *,
    isa: str = "vec",
    dtype: torch.dtype = torch.float32,
    h: int = 9,
    hkv: int = 3,
    d: int = 64,
    seed: int = 0,
) -> Case:
    """requests: (context C, region T, queries q, mask kind) each; every request's rows in the
    forward are one causal row before its q tree rows (as a root before its tree)."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    r = len(requests)
    n_blocks = [(c + t + BS - 1) // BS for c, t, _, _ in requests]
    nb = sum(n_blocks) + 2
    perm = torch.randperm(nb, generator=gen).tolist()
    max_blocks = max(n_blocks) + 1
    table = torch.full((r, max_blocks), -5, dtype=torch.int32)  # never read past a sequence
    kv = torch.full((nb, hkv, BS, 2 * d), float("nan"), dtype=dtype)
    keys, values, masks, first, slots = [], [], [], [], []
    row = 0
    for i, (c, t, q, kind) in enumerate(requests):
        blocks = [perm.pop() for _ in range(n_blocks[i])]
        table[i, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        keys.append(torch.randn(c + t, hkv, d, generator=gen).to(dtype))
        values.append(torch.randn(c + t, hkv, d, generator=gen).to(dtype))
        slots.append(torch.tensor([blocks[s // BS] * BS + s % BS for s in range(c + t)], dtype=torch.long))
        masks.append(region_rows(t, q, kind, rng))
        first.append(row + 1)
        row += 1 + q
    write_cache(isa, kv, torch.cat(slots), torch.cat(keys), torch.cat(values))
    q_lens = torch.tensor([q for _, _, q, _ in requests])
    qsl = torch.cat([torch.zeros(1, dtype=torch.long), q_lens.cumsum(0)])
    rows = torch.cat(
        [torch.arange(f, f + q) for f, (_, _, q, _) in zip(first, requests)] + [torch.zeros(0).long()]
    )
    max_q = int(q_lens.max()) + 1
    words = max((t + 31) // 32 for _, t, _, _ in requests) + 1
    mask = torch.randint(-(2**31), 2**31, (r, max_q, words), generator=gen, dtype=torch.int64).to(torch.int32)
    for i, (_, t, q, _) in enumerate(requests):
        if q:
            mask[i, :q] = pack_tree_mask(torch.nn.functional.pad(masks[i], (0, 32 * words - t)))
    query = torch.randn(row + 2, h, d + 5, generator=gen).to(dtype)[:, :, :d]  # a slice of a fused qkv
    ctx = torch.tensor([c for c, _, _, _ in requests], dtype=torch.int32)
    reg = torch.tensor([t for _, t, _, _ in requests])
    args = (rows, qsl, table, ctx, reg, mask)
    return Case(query, kv, isa, args, row + 2, keys, values, masks, first, d**-0.5)


def reference(case: Case, requests: list[tuple[int, int, int, str]]) -> torch.Tensor:
    """float64 softmax over each query's visible tokens, from the logical K/V."""
    out = torch.full(case.query.shape, SENTINEL, dtype=torch.float64)
    h, hkv = case.query.shape[1], case.kv.shape[1]
    for i, (c, _, q, _) in enumerate(requests):
        for j in range(q):
            seen = torch.cat([torch.ones(c, dtype=torch.bool), case.masks[i][j]])
            row = case.first[i] + j
            if not seen.any():
                out[row] = 0.0
                continue
            for head in range(h):
                k = case.keys[i][seen, head // (h // hkv)].double()
                v = case.values[i][seen, head // (h // hkv)].double()
                p = torch.softmax(k @ case.query[row, head].double() * case.scale, 0)
                out[row, head] = p @ v
    return out


def run(case: Case, backend: str) -> torch.Tensor:
    out = torch.full(
        (case.num_rows, case.query.shape[1], 2 * case.query.shape[2]), SENTINEL, dtype=case.query.dtype
    )
    out = out[:, :, ::2]  # strided, like a view of the layer's output
    cpu_tree_attention(case.query, case.kv, case.isa, case.plan(), case.scale, out, backend=backend)
    return out


def assert_matches(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    if dtype == torch.float32:
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    else:  # one rounding to bf16 of a float32 result: within 2 of its ulps, plus float32 sums
        torch.testing.assert_close(got.double(), want, atol=2**-10, rtol=2**-7)


@pytest.fixture(scope="module", autouse=True)
def _kernel_built() -> None:
    """The C++ kernel is part of the package: a machine that cannot build it fails here, loudly."""
    load_cpu_ops()


#: Context 0, one query, a region over 32 tokens (two mask words), a query seeing nothing (C = 0,
#: empty mask row), a request without tree rows, and a context long enough that the batch is split
#: along it over the threads (then merged).
REQUESTS = [(5, 9, 8, "tree"), (0, 12, 11, "tree"), (37, 40, 39, "tree"), (70, 3, 1, "causal"),
            (0, 4, 3, "empty"), (18, 6, 0, "tree"), (700, 17, 16, "tree")]  # fmt: skip

LAYOUTS = [("vec", torch.float32), ("vec", torch.bfloat16), ("vec", torch.float16), ("amx", torch.bfloat16),
           ("vec16", torch.float32)]  # fmt: skip


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("isa", "dtype"), LAYOUTS)
def test_tree_rows_match_reference(backend: str, isa: str, dtype: torch.dtype) -> None:
    d = 80 if isa == "vec16" else 64  # vLLM takes vec16 for head sizes off multiples of 32
    case = make_case(REQUESTS, isa=isa, dtype=dtype, d=d)
    got = run(case, backend)
    assert not got.isnan().any()
    assert_matches(got, reference(case, REQUESTS), dtype)


@pytest.mark.parametrize(("isa", "dtype"), LAYOUTS)
def test_kernel_matches_its_twin_on_random_trees(isa: str, dtype: torch.dtype) -> None:
    rng = random.Random(5)
    for seed in range(3):
        reqs = [
            (rng.randrange(0, 300), t, rng.randrange(0, t + 1), "tree") for t in rng.sample(range(1, 65), 5)
        ]
        case = make_case(reqs, isa=isa, dtype=dtype, d=80 if isa == "vec16" else 64, seed=seed)
        assert_matches(run(case, "cpp"), run(case, "torch").double(), dtype)


@pytest.mark.parametrize(("h", "hkv", "d"), [(4, 4, 32), (8, 1, 128), (6, 2, 96)])
def test_head_groupings_and_sizes(h: int, hkv: int, d: int) -> None:
    reqs = REQUESTS[:4]
    for isa, dtype in (("vec", torch.float32), ("amx", torch.bfloat16)):
        case = make_case(reqs, isa=isa, dtype=dtype, h=h, hkv=hkv, d=d, seed=3)
        assert_matches(run(case, "cpp"), reference(case, reqs), dtype)


def test_rows_beyond_one_tile_and_one_chunk() -> None:
    """64 queries x 8 heads per kv head (many row tiles), and a region past the chunk of 256 tokens."""
    reqs = [(300, 64, 64, "tree"), (2, 300, 33, "causal")]
    case = make_case(reqs, h=8, hkv=1, seed=4)
    assert_matches(run(case, "cpp"), reference(case, reqs), torch.float32)


def test_split_context_is_the_unsplit_result(monkeypatch: pytest.MonkeyPatch) -> None:
    """One request over 2,000 tokens on 2 threads is split along the context and merged; on one
    thread it is not: the same rows within float32 rounding."""
    reqs = [(2000, 9, 8, "tree")]
    case = make_case(reqs, seed=8)
    plan = case.plan().plan
    assert torch.ops.eagle2_cpu.tree_attention_work(plan, 3, 3, 1)[1] == 0  # 3 kv heads: 3 items, whole
    items, splits = torch.ops.eagle2_cpu.tree_attention_work(plan, 3, 3, 2)
    assert splits == items > 3  # each kv head's rows over several ranges of the context
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = run(case, "cpp")
    finally:
        torch.set_num_threads(threads)
    torch.set_num_threads(max(2, threads))
    try:
        split = run(case, "cpp")
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(split, alone, atol=1e-6, rtol=1e-5)
    assert_matches(split, reference(case, reqs), torch.float32)


def test_layers_share_a_plan() -> None:
    """The plan is the forward's: a second layer (other queries, other cache contents) reads it too."""
    case = make_case(REQUESTS[:3], seed=6)
    plan = case.plan()
    for _ in range(2):
        out = torch.full((case.num_rows, *case.query.shape[1:]), SENTINEL)
        cpu_tree_attention(case.query, case.kv, "vec", plan, case.scale, out, backend="cpp")
        assert_matches(out, reference(case, REQUESTS[:3]), torch.float32)
        case.query.mul_(-1.5)
        for logical in (case.keys, case.values):
            for t in logical:
                t.mul_(0.5)
        case.kv.mul_(0.5)


def test_a_plan_for_another_cache_is_refused() -> None:
    case = make_case(REQUESTS[:2], seed=2)
    plan = case.plan()
    bigger = torch.cat([case.kv, case.kv[:1]])
    out = torch.empty(case.num_rows, *case.query.shape[1:])
    with pytest.raises(RuntimeError, match="validated for another cache"):
        cpu_tree_attention(case.query, bigger, "vec", plan, case.scale, out, backend="cpp")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda a: (a[0].flip(0), *a[1:]), "consecutive"),
        (lambda a: (*a[:2], a[2].clone().fill_(10**6), *a[3:]), "block_table entry"),
        (lambda a: (*a[:4], a[4] * 0, a[5]), "do not fit"),
        (lambda a: (a[0], a[1][:-1], *a[2:]), "disagree on R"),
    ],
    ids=["rows-not-consecutive", "block-out-of-range", "region-shorter-than-queries", "lengths-disagree"],
)
@pytest.mark.parametrize("backend", BACKENDS)
def test_plan_refuses_bad_indices(
    change, message: str, backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:  # noqa: ANN001
    monkeypatch.setenv(cta.CPU_BACKEND_ENV, backend)
    case = make_case(REQUESTS[:3], seed=1)
    with pytest.raises(ValueError, match=message):
        plan_cpu_tree_attention(
            *change(case.args), num_blocks=case.kv.shape[0], block_size=BS, num_rows=case.num_rows
        )


def test_plan_twin_packs_what_the_kernel_packs(monkeypatch: pytest.MonkeyPatch) -> None:
    case = make_case(REQUESTS, seed=9)
    plans = {}
    for backend in BACKENDS:
        monkeypatch.setenv(cta.CPU_BACKEND_ENV, backend)
        plans[backend] = case.plan().plan
    assert torch.equal(plans["cpp"], plans["torch"])
    assert plans["cpp"][1:, 1].tolist() == [q for _, _, q, _ in REQUESTS]


def test_unknown_isa_is_refused_naming_it() -> None:
    with pytest.raises(ValueError, match="'neon'.*reads \\['amx', 'vec', 'vec16'\\]"):
        cpu_layout("neon")
    assert sorted(CPU_KV_LAYOUTS) == ["amx", "vec", "vec16"]


@pytest.mark.parametrize(
    ("isa", "dtype"),
    [("vec", torch.float32), ("vec", torch.bfloat16), ("vec16", torch.bfloat16), ("amx", torch.bfloat16)],
)
def test_layout_round_trip_through_vllms_writer(isa: str, dtype: torch.dtype) -> None:
    """vLLM's cache-write op stores what eagle2 reads, and eagle2's twin of it writes the same bytes.

    vLLM writes "amx" only for bf16 on AMX CPUs: elsewhere its op refuses, and this test says so."""
    if not vllm_writes(isa, dtype):
        pytest.skip(f"vLLM's {isa!r} writer does not run on this CPU for {dtype}")
    check_cpu_kv_layout(isa, dtype, 64, BS)
    gen = torch.Generator().manual_seed(0)
    key, value = torch.randn(2, 40, 2, 64, generator=gen).to(dtype)
    slots = torch.randperm(3 * BS, generator=gen)[:40]
    ours, theirs = (torch.zeros(3, 2, BS, 128, dtype=dtype) for _ in range(2))
    write_kv_slots(ours, cpu_layout(isa), slots, key, value)
    write_cache(isa, theirs, slots, key, value)
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("layout", ["vec", "amx", "flash"])
def test_slots_read_back_what_was_written(layout: str) -> None:
    gen = torch.Generator().manual_seed(3)
    kv = torch.full((4, 2, BS, 128), float("nan"), dtype=torch.bfloat16)
    key, value = torch.randn(2, 50, 2, 64, generator=gen).to(torch.bfloat16)
    slots = torch.randperm(4 * BS, generator=gen)[:50]
    write_kv_slots(kv, layout, torch.cat([slots, torch.tensor([-1])]), torch.cat([key, key[:1]]),
                   torch.cat([value, value[:1]]))  # fmt: skip
    got_k, got_v = read_kv_slots(kv, layout, slots)
    assert torch.equal(got_k, key) and torch.equal(got_v, value)
    assert kv.isnan().sum() == kv.numel() - 2 * 50 * 2 * 64  # the slot -1 wrote nothing


def test_build_finds_ninja_in_an_unactivated_venv(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """vLLM's ninja sits in the venv's bin/, which is not on PATH when .venv/bin/python runs directly."""
    from vllm_eagle2.kernels import _cpp

    (tmp_path / "ninja").touch()
    monkeypatch.setattr(_cpp.sys, "executable", str(tmp_path / "python"))
    monkeypatch.setenv("PATH", "/nonexistent")
    _cpp._ninja_on_path()
    assert os.environ["PATH"] == f"{tmp_path}{os.pathsep}/nonexistent"


def test_backend_is_chosen_by_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_compiler() -> None:
        raise RuntimeError("could not build eagle2's C++ CPU kernels: no compiler")

    monkeypatch.setenv(cta.CPU_BACKEND_ENV, "torch")
    assert cta.cpu_backend() == "torch"
    monkeypatch.setenv(cta.CPU_BACKEND_ENV, "cpp")
    assert cta.cpu_backend() == "cpp"
    monkeypatch.setattr(cta, "load_cpu_ops", no_compiler)
    with pytest.raises(RuntimeError, match="no compiler"):  # forced: no silent fallback
        cta.cpu_backend()
    monkeypatch.setenv(cta.CPU_BACKEND_ENV, "triton")
    with pytest.raises(ValueError, match="VLLM_EAGLE2_CPU_ATTENTION must be 'cpp' or 'torch'"):
        cta.cpu_backend()


def test_auto_falls_back_to_the_twin_when_the_kernel_cannot_be_built(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def no_compiler() -> None:
        raise RuntimeError("could not build eagle2's C++ CPU kernels: no compiler")

    monkeypatch.setattr(cta, "load_cpu_ops", no_compiler)
    monkeypatch.setattr(cta, "_cpp_state", {})  # as in a fresh process
    monkeypatch.delenv(cta.CPU_BACKEND_ENV, raising=False)
    case = make_case(REQUESTS[:3], seed=5)
    with caplog.at_level("WARNING"):
        got = run(case, "auto")
        run(case, "auto")
    assert_matches(got, reference(case, REQUESTS[:3]), torch.float32)
    warnings = [r for r in caplog.records if "falls back" in r.getMessage()]
    assert len(warnings) == 1 and "no compiler" in warnings[0].getMessage()


def check_every_layout() -> None:
    """The kernel against the reference on every layout and dtype (the wider build's check)."""
    for isa, dtype in LAYOUTS:
        case = make_case(REQUESTS, isa=isa, dtype=dtype, d=80 if isa == "vec16" else 64, seed=11)
        assert_matches(run(case, "cpp"), reference(case, REQUESTS), dtype)


_WIDE_BUILD = """
import sys
from torch.utils import cpp_extension
from vllm_eagle2.kernels import _cpp
_cpp._ninja_on_path()
cpp_extension.load(name="eagle2_cpu_lanes16_" + _cpp._cpu_tag(), sources=[str(s) for s in _cpp._SOURCES],
                   extra_cflags=[*_cpp._FLAGS, "-DEAGLE2_LANES=16"], extra_ldflags=["-fopenmp"],
                   is_python_module=False)
_cpp._loaded = True  # this build, not the machine's own
sys.path.insert(0, sys.argv[1])
import test_cpu_tree_attention as t
t.check_every_layout()
print("16 lanes: every layout matches")
"""


def test_the_avx512_width_on_any_cpu() -> None:
    """AVX-512 machines run the kernel 16 floats to a vector (32 tokens a step, one amx token group
    a vector): built at that width here too, it matches the reference on every layout."""
    done = subprocess.run(
        [sys.executable, "-c", _WIDE_BUILD, str(Path(__file__).parent)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "16 lanes: every layout matches" in done.stdout
