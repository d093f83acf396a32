"""On a CUDA device: every Triton kernel against its torch twin, natively, and CUDA-graph capture.

Marked ``gpu`` and skipped (reported as skipped) without CUDA. Run them on a GPU machine with
``TRITON_INTERPRET=0 python -m pytest -m gpu tests/test_gpu.py``.
"""

from __future__ import annotations

import os

import pytest
import torch

from vllm_eagle2_tools.gpu_bench import Shapes, run_checks

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.fixture(scope="module")
def checks() -> dict[str, str]:
    assert os.environ.get("TRITON_INTERPRET", "0") in ("", "0"), "run with TRITON_INTERPRET=0 on a GPU"
    return run_checks(Shapes(), torch.device("cuda"))


def _outcomes(checks: dict[str, str], prefix: str) -> dict[str, str]:
    found = {name: outcome for name, outcome in checks.items() if name.startswith(prefix)}
    assert found, f"no check named {prefix!r}"
    return found


@pytest.mark.parametrize(
    "prefix",
    [
        "vocab_topk",
        "tree on device equals tree on CPU",
        "masks kernel equals twin",
        "greedy verification on device equals CPU",
        "tree attention kernel vs twin",
        "tree build replayed from a CUDA graph",
        "greedy verification replayed from a CUDA graph",
        "node allocation on device equals CPU",
        "node allocation replayed from a CUDA graph",
    ],
)
def test_gpu_check(checks: dict[str, str], prefix: str) -> None:
    outcomes = _outcomes(checks, prefix)
    assert all(v == "ok" for v in outcomes.values()), outcomes


def test_training_attention_packed_on_device_equals_per_sequence() -> None:
    """The trainer's one-call attention on CUDA (efficient SDPA under a mask) equals its
    per-sequence loop, outputs and gradients, at three unrolled depths."""
    from vllm_eagle2_tools.training.head import packed_attention, per_sequence_attention

    gen = torch.Generator(device="cuda").manual_seed(0)
    lens = [300, 7, 129, 1, 64]
    t = sum(lens)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device="cuda", requires_grad=True)

    q, keys, values = rand(t, 9, 64), [rand(t, 3, 64) for _ in range(3)], [rand(t, 3, 64) for _ in range(3)]
    leaves = [q, *keys, *values]
    want = per_sequence_attention(q, keys, values, lens)
    want_grads = torch.autograd.grad(want.square().sum(), leaves)
    got = packed_attention(q, keys, values, lens)
    got_grads = torch.autograd.grad(got.square().sum(), leaves)
    torch.testing.assert_close(got, want, atol=2e-4, rtol=2e-4)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, atol=2e-3, rtol=2e-3)


def _compiled_variants() -> int:
    """Kernels Triton has compiled so far, over every kernel of the step."""
    from test_kernel_warmup import KERNELS

    return sum(len(c[0]) for module, name in KERNELS for c in getattr(module, name).device_caches.values())


def test_after_the_warm_up_no_step_shape_compiles_a_kernel() -> None:
    """The warm-up compiles every variant: launches at every shape a step makes compile nothing
    (counted in Triton's own per-device kernel caches), in the model's bf16 and in float32."""
    import dataclasses

    from test_kernel_warmup import LIMITS, _cache, serve_every_shape

    from vllm_eagle2.kernels.warmup import warm_up_kernels

    device = torch.device("cuda")
    limits = dataclasses.replace(
        LIMITS, draft_dtype=torch.bfloat16, target_dtypes=(torch.bfloat16, torch.float32), max_rows=600
    )
    cache = _cache(device, torch.bfloat16)
    warm_up_kernels(limits, device, [cache])
    torch.cuda.synchronize()
    warmed = _compiled_variants()
    serve_every_shape(cache, limits)
    torch.cuda.synchronize()
    assert _compiled_variants() == warmed
