"""Cost of one target forward over m draft tokens: eagle2's tree path vs vLLM's causal path.

Side by side in one process, same model, same prompt, batch 1: the target's forward pass
(``GPUModelRunner._model_forward``) is timed at every step of

* eagle2 with m tree nodes per step (vLLM's CPU attention over the root and its leading
  chain, eagle2's kernel over the other tree rows with their masks, once per CPU backend
  named in ``--cpu-attention``: the C++ kernel and/or the torch twin), and
* vLLM's own ``eagle`` chain with m draft tokens (stock causal attention only),

and the median over the steps that verified exactly m drafts is reported, next to a
plain one-token decode step. Engines run in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0)
so that the timing hook reaches the model runner.

Usage: python scripts/bench_verify_forward.py --model models/smollm2-135m-instruct --head HEAD
       python scripts/bench_verify_forward.py --tiny        # seeded tiny pair, seconds
       python scripts/bench_verify_forward.py --m 2,4,8,16 --cpu-attention cpp,torch
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from vllm_eagle2.kernels import CPU_BACKEND_ENV
from vllm_eagle2_tools.cpu_env import configure_cpu_env
from vllm_eagle2_tools.smollm2 import DEFAULT_HEAD, DEFAULT_TARGET


def _timed_forwards() -> dict[int, list[float]]:
    """Patch the runner's forward to record wall time by number of scheduled tokens."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    times: dict[int, list[float]] = defaultdict(list)
    forward = GPUModelRunner._model_forward

    def timed(self, *args, **kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        start = time.perf_counter()
        out = forward(self, *args, **kwargs)
        if ids is not None:
            times[int(ids.shape[0])].append(1000 * (time.perf_counter() - start))
        return out

    GPUModelRunner._model_forward = timed
    return times


def _run(
    model: str,
    spec: dict | None,
    prompt: list[int],
    max_tokens: int,
    dtype: str,
    times: dict[int, list[float]],
) -> dict[int, list[float]]:
    from vllm import LLM, SamplingParams

    times.clear()
    llm = LLM(
        model=model,
        speculative_config=spec,
        dtype=dtype,
        enforce_eager=True,
        max_model_len=1024,
        max_num_seqs=1,
        seed=0,
    )
    try:
        llm.generate(
            [{"prompt_token_ids": prompt}],
            SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
            use_tqdm=False,
        )
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
    return {n: list(t) for n, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=str(DEFAULT_TARGET))
    parser.add_argument("--head", default=str(DEFAULT_HEAD))
    parser.add_argument("--tiny", action="store_true", help="use a seeded tiny target/head pair instead")
    parser.add_argument("--m", default="16,32,60", help="comma-separated draft counts (default 16,32,60)")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--dtype", default=None, help="default: float32 with --tiny, else bfloat16")
    parser.add_argument(
        "--cpu-attention",
        default="cpp",
        help="comma-separated CPU tree-attention backends to time the tree path with (cpp, torch)",
    )
    parser.add_argument("--output", default=None, help="write the results as JSON here")
    args = parser.parse_args()
    backends = args.cpu_attention.split(",")
    if not set(backends) <= {"cpp", "torch"}:
        parser.error(f"--cpu-attention takes cpp and/or torch, got {args.cpu_attention!r}")
    configure_cpu_env()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the timing hook must reach the runner
    times = _timed_forwards()
    if args.tiny:
        from vllm_eagle2_tools.testing import build_pair

        model, head = map(str, build_pair(Path(tempfile.mkdtemp()), "partial", seed=0))
    else:
        model, head = args.model, args.head
        for path, what in ((model, "--model"), (head, "--head")):
            if not Path(path).exists():
                sys.exit(f"{what} {path} does not exist (scripts/prepare_smollm2.py makes the model)")
    dtype = args.dtype or ("float32" if args.tiny else "bfloat16")
    prompt = [(17 * i) % 400 + 10 for i in range(args.prompt_len)]

    rows = []
    plain = _run(model, None, prompt, 8, dtype, times)
    one_token = statistics.median(plain.get(1, [float("nan")]))
    for m in (int(x) for x in args.m.split(",")):
        tree_spec = {
            "method": "eagle2",
            "model": head,
            "num_speculative_tokens": m,
            "depth": 4,
            "topk": max(4, int((m / 3) ** 0.5) + 1),
            "budget": "fixed",  # this tree every step: the measurement needs it
        }
        row: dict = {"m": m}
        for backend in backends:
            os.environ[CPU_BACKEND_ENV] = backend  # read at every attention call: in-process engines
            tree = _run(model, tree_spec, prompt, args.max_tokens, dtype, times).get(m + 1, [])
            row[f"tree_{backend}_ms"] = statistics.median(tree) if tree else None
            row[f"steps_tree_{backend}"] = len(tree)
        os.environ.pop(CPU_BACKEND_ENV)
        chain_spec = {"method": "eagle", "model": head, "num_speculative_tokens": m}
        chain = _run(model, chain_spec, prompt, args.max_tokens, dtype, times).get(m + 1, [])
        row.update(
            causal_ms=statistics.median(chain) if chain else None,
            steps_causal=len(chain),
            one_token_ms=one_token,
        )
        rows.append(row)
    print(f"target forward, batch 1, prompt {args.prompt_len} tokens, {dtype}, model {model}")
    tree_cols = " | ".join(f"eagle2 tree path ({b}) ms" for b in backends)
    print(f"| m | {tree_cols} | stock causal ms | 1-token decode ms |")
    print("|---:|" + "---:|" * (len(backends) + 2))
    for r in rows:
        cells = [r[f"tree_{b}_ms"] for b in backends] + [r["causal_ms"], r["one_token_ms"]]
        print(f"| {r['m']} | " + " | ".join("-" if c is None else f"{c:.2f}" for c in cells) + " |")
    if args.output:
        Path(args.output).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
