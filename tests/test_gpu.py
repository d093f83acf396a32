"""On a CUDA device: every Triton kernel against its torch twin, natively, and CUDA-graph capture.

Marked ``gpu`` and skipped (reported as skipped) without CUDA. Run them on a GPU machine with
``TRITON_INTERPRET=0 python -m pytest -m gpu tests/test_gpu.py``.
"""

from __future__ import annotations

import os

import pytest
import torch

from vllm_eagle2.gpu_bench import Shapes, run_checks

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
