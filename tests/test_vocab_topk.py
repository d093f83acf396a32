"""vocab_topk: the Triton kernel (run by the interpreter here) against its torch twin."""

from __future__ import annotations

import math

import pytest
import torch

from vllm_eagle2.kernels import HAS_TRITON, vocab_topk
from vllm_eagle2.kernels.vocab_topk import _vocab_topk_triton

needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")


def reference(
    logits: torch.Tensor, k: int, scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Straight from the definition: full float64 log-softmax, NaN/+inf as -inf, stable order.

    With scale [R], the rows are the float32 products ``logits.float() * scale`` (rounded
    as the kernels round them, so that ties and orders match), then widened.
    """
    x = logits.float() if scale is None else logits.float() * scale.unsqueeze(1)
    x = x.double().nan_to_num(nan=-math.inf, posinf=-math.inf, neginf=-math.inf)
    order = x.sort(dim=-1, descending=True, stable=True)
    return (x - x.logsumexp(-1, keepdim=True)).gather(1, order.indices[:, :k]), order.indices[:, :k]


def random_logits(rows: int, vocab: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, vocab, generator=gen) * 4).to(dtype)


def assert_matches_reference(
    logits: torch.Tensor,
    k: int,
    values: torch.Tensor,
    indices: torch.Tensor,
    scale: torch.Tensor | None = None,
):
    ref_values, ref_indices = reference(logits, k, scale)
    assert values.dtype == torch.float32 and indices.dtype == torch.int64
    assert values.shape == indices.shape == (logits.shape[0], k)
    assert ((indices >= 0) & (indices < logits.shape[1])).all()
    # The winners' raw logits are exactly the reference's k best (ties may swap indices).
    clean = logits.float() if scale is None else logits.float() * scale.unsqueeze(1)
    clean = clean.nan_to_num(nan=-math.inf, posinf=-math.inf, neginf=-math.inf)
    assert torch.equal(clean.gather(1, indices), clean.gather(1, ref_indices))
    torch.testing.assert_close(values.double(), ref_values, atol=1e-5, rtol=1e-6, equal_nan=False)
    # Where the row's k best values are distinct, the indices are determined.
    distinct = (ref_values[:, 1:] != ref_values[:, :-1]).all(1)
    assert torch.equal(indices[distinct], ref_indices[distinct])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("k", [1, 10, 24])
def test_torch_twin_matches_the_definition(dtype, k):
    logits = random_logits(5, 3001, dtype)
    assert_matches_reference(logits, k, *vocab_topk(logits, k, backend="torch"))


def test_auto_backend_on_cpu_is_the_torch_twin():
    logits = random_logits(3, 500, torch.float32)
    for got, want in zip(vocab_topk(logits, 7), vocab_topk(logits, 7, backend="torch"), strict=True):
        assert torch.equal(got, want)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [1, 10, 24])
def test_triton_matches_the_definition(dtype, k):
    # V not a multiple of the tile; several chunks per row, several tiles per chunk.
    logits = random_logits(3, 4099, dtype, seed=k)
    assert_matches_reference(logits, k, *_vocab_topk_triton(logits, k, num_chunks=3, tile=256))


@needs_triton
def test_triton_default_chunking_matches_the_twin():
    logits = random_logits(2, 5000, torch.float32, seed=3)
    values, indices = vocab_topk(logits, 10, backend="triton")
    want_values, want_indices = vocab_topk(logits, 10, backend="torch")
    torch.testing.assert_close(values, want_values, atol=1e-5, rtol=0)
    assert torch.equal(indices, want_indices)


@needs_triton
@pytest.mark.parametrize("k", [1, 10])
def test_triton_with_fewer_logits_per_chunk_than_k(k):
    # 40 logits over 20 chunks: many chunks hold fewer than k candidates.
    logits = random_logits(2, 40, torch.float32, seed=1)
    assert_matches_reference(logits, k, *_vocab_topk_triton(logits, k, num_chunks=20, tile=16))


@needs_triton
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_nan_and_pos_inf_count_as_neg_inf(backend):
    logits = random_logits(4, 1000, torch.float32, seed=2)
    logits[0, ::2] = math.nan
    logits[1, :500] = math.inf
    logits[2, 3:] = -math.inf  # only 3 finite logits: the other winners are -inf
    logits[3, 10] = math.nan
    logits[3, 11] = math.inf
    values, indices = vocab_topk(logits, 5, backend=backend)
    assert not values.isnan().any() and not (values == math.inf).any()
    assert (indices[0] % 2 == 1).all() and (indices[1] >= 500).all()
    assert sorted(indices[2, :3].tolist()) == [0, 1, 2] and (values[2, 3:] == -math.inf).all()
    assert values[2, :3].exp().sum().item() == pytest.approx(1.0, abs=1e-5)
    assert_matches_reference(logits, 5, values, indices)


@needs_triton
@pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning", "ignore:invalid value:RuntimeWarning")
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_rows_without_a_finite_logit_give_neg_inf_and_valid_indices(backend):
    logits = torch.full((3, 300), -math.inf)
    logits[1] = math.nan
    logits[2, ::2] = math.inf
    values, indices = vocab_topk(logits, 4, backend=backend)
    assert (values == -math.inf).all()
    assert ((indices >= 0) & (indices < 300)).all()
    if backend == "triton":  # lowest index first among ties
        assert indices.tolist() == [[0, 1, 2, 3]] * 3


@needs_triton
def test_triton_ties_go_to_the_lower_index():
    logits = torch.zeros(2, 700)
    logits[1, 600:] = 1.0
    values, indices = _vocab_topk_triton(logits, 6, num_chunks=4, tile=64)
    assert indices.tolist() == [[0, 1, 2, 3, 4, 5], [600, 601, 602, 603, 604, 605]]
    assert torch.equal(values[0], torch.full((6,), -math.log(700)))


@needs_triton
def test_triton_reads_strided_rows():
    base = random_logits(6, 1200, torch.float32, seed=4)
    logits = base[::2, 100:1100]  # row stride 2400, last dim contiguous
    assert_matches_reference(logits, 8, *_vocab_topk_triton(logits, 8, num_chunks=2, tile=128))


def random_scale(rows: int, seed: int = 0) -> torch.Tensor:
    """[R] float32 multipliers 1 / T, T in [0.3, 2.5), and one row unscaled."""
    gen = torch.Generator().manual_seed(seed)
    scale = 1 / (0.3 + 2.2 * torch.rand(rows, generator=gen))
    scale[0] = 1.0
    return scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [1, 10])
def test_torch_twin_with_scale_is_the_scaled_log_softmax(dtype, k):
    logits = random_logits(5, 3001, dtype, seed=5)
    scale = random_scale(5)
    values, indices = vocab_topk(logits, k, scale=scale, backend="torch")
    assert_matches_reference(logits, k, values, indices, scale)
    # Scale 1 / T is the top-k of log_softmax(logits / T).
    want = (logits.double() / (1 / scale.double()).unsqueeze(1)).log_softmax(-1).topk(k).values
    torch.testing.assert_close(values.double(), want, atol=1e-5, rtol=1e-6)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [1, 10])
def test_triton_with_scale_matches_the_twin(dtype, k):
    # Several chunks and tiles per row, V not a multiple of the tile.
    logits = random_logits(4, 4099, dtype, seed=10 + k)
    scale = random_scale(4, seed=k)
    values, indices = _vocab_topk_triton(logits, k, scale=scale, num_chunks=3, tile=256)
    assert_matches_reference(logits, k, values, indices, scale)  # indices too, where untied
    want_values, _ = vocab_topk(logits, k, scale=scale, backend="torch")
    torch.testing.assert_close(values, want_values, atol=1e-5, rtol=0)
    # The public entry point with the default chunking agrees too.
    values, indices = vocab_topk(logits, k, scale=scale, backend="triton")
    assert_matches_reference(logits, k, values, indices, scale)


@needs_triton
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # the interpreter's numpy
def test_triton_with_scale_keeps_ties_and_filters_after_scaling():
    # Row 0: bf16 ties at the maximum, the lowest index must win at any positive scale.
    # Row 1: a NaN and a finite logit whose product overflows to +inf: both count as -inf.
    logits = torch.zeros(2, 600)
    logits[0, [450, 17, 300]] = 3.0
    logits[1, 5] = math.nan
    logits[1, 6] = 3e38
    logits[1, 7] = 2.0
    scale = torch.tensor([0.37, 10.0])
    values, indices = _vocab_topk_triton(logits.bfloat16(), 2, scale=scale, num_chunks=3, tile=64)
    assert indices.tolist() == [[17, 300], [7, 0]]
    assert_matches_reference(logits.bfloat16(), 2, values, indices, scale)
    twin_values, _ = vocab_topk(logits.bfloat16(), 2, scale=scale, backend="torch")
    torch.testing.assert_close(values, twin_values, atol=1e-5, rtol=0)


@pytest.mark.parametrize("scale", [torch.ones(3), torch.ones(2, 1), torch.ones(2, dtype=torch.long)])
def test_bad_scale_raises_value_error(scale):
    with pytest.raises(ValueError, match="scale"):
        vocab_topk(torch.zeros(2, 3), 1, scale=scale)


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((torch.zeros(3), 1), "logits"),
        ((torch.zeros(2, 3, dtype=torch.long), 1), "logits"),
        ((torch.zeros(2, 3), 0), "k"),
        ((torch.zeros(2, 3), 4), "k"),
    ],
)
def test_bad_arguments_raise_value_error(args, match):
    with pytest.raises(ValueError, match=match):
        vocab_topk(*args)
    with pytest.raises(ValueError, match="backend"):
        vocab_topk(torch.zeros(2, 3), 1, backend="cuda")
