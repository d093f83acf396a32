"""Soak test: a vLLM server (eagle2 or no speculation) under a bounded, concurrent streaming load.

Starts ``python -m vllm.entrypoints.openai.api_server`` on 127.0.0.1 (the ``vllm`` command of the
CPU wheel is broken), then runs ``--clients`` concurrent clients for ``--duration-s`` seconds. Each
client sends streamed completions one after another with mixed token-id prompts (5 tokens up to
``--max-prompt-tokens``), mixed ``max_tokens`` (1 up to ``--max-tokens``), greedy or temperature 0.8
sampling, and per-request seeds. Meanwhile the resident memory (RSS) of the server's process tree
(API server, engine core, workers) is sampled every ``--sample-interval-s`` seconds.

The report (stdout, and ``--output`` as JSON): requests/s and generated tokens/s, p50/p99 latency
and time to first token, errors (HTTP 5xx and 4xx, errors inside streams, cut streams, client
exceptions), the server's health after the load, memory after the warm-up against memory at the
end (growth above ``--memory-growth-limit`` is flagged), and vLLM's own counters (preemptions,
mean acceptance length). The server is stopped by the script in every case (its process group is
sent SIGTERM, then SIGKILL), also on Ctrl-C or SIGTERM. Exit status 0 when there were no errors,
no memory growth flag and the server stayed healthy; 1 otherwise.

Reading the memory figures: the workers' RSS rises for the first minute or two of a load while
glibc's heap settles (its mmap threshold adapts to the tensor sizes; ``MALLOC_MMAP_THRESHOLD_=131072``
in the environment shows the difference), so a 60-second run can cross a 10% limit without any
leak. ``growth_second_half`` (end against the middle of the load) and ``by_process_mib`` tell which
process keeps growing; hunt leaks with ``--duration-s 600`` or more.

Only 127.0.0.1 is contacted. Examples::

    .venv/bin/python scripts/soak.py --tiny --duration-s 60 --output soak.json
    .venv/bin/python scripts/soak.py --tiny --no-spec --clients 32
    .venv/bin/python scripts/soak.py --target models/smollm2-135m-instruct --head heads/smollm2-135m-eagle \\
        --dtype bfloat16 --num-speculative-tokens 16 --depth 5 --topk 4
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from pathlib import Path
from typing import Any

from vllm_eagle2_tools.soak import TINY_TREE, log, soak


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    model = parser.add_argument_group("model")
    model.add_argument(
        "--tiny", action="store_true", help="seeded tiny 'partial' target/head pair (built here)"
    )
    model.add_argument("--target", type=Path, help="target model folder (Hugging Face format)")
    model.add_argument("--head", type=Path, help="EAGLE head folder (needed with --spec unless --tiny)")
    model.add_argument("--dtype", default=None, help="float32 (default with --tiny), bfloat16, auto, ...")
    model.add_argument("--max-model-len", type=int, default=512)
    spec = parser.add_argument_group("speculation")
    spec.add_argument("--spec", dest="spec", action="store_true", default=True, help="eagle2 (default)")
    spec.add_argument("--no-spec", dest="spec", action="store_false", help="no speculative decoding")
    spec.add_argument("--num-speculative-tokens", type=int, default=TINY_TREE[0])
    spec.add_argument("--depth", type=int, default=TINY_TREE[1])
    spec.add_argument("--topk", type=int, default=TINY_TREE[2])
    load = parser.add_argument_group("load")
    load.add_argument("--clients", type=int, default=16, help="concurrent streaming clients")
    load.add_argument("--duration-s", type=float, default=60.0, help="seconds during which requests start")
    load.add_argument("--warmup-s", type=float, default=10.0, help="first seconds left out of the rates")
    load.add_argument("--max-prompt-tokens", type=int, default=200)
    load.add_argument("--max-tokens", type=int, default=48)
    load.add_argument("--request-timeout-s", type=float, default=120.0)
    load.add_argument("--seed", type=int, default=0, help="seed of the request mix")
    server = parser.add_argument_group("server")
    server.add_argument("--port", type=int, default=0, help="0: a free port")
    server.add_argument("--startup-timeout-s", type=float, default=300.0)
    server.add_argument("--server-arg", action="append", default=[], help="extra server argument (repeat)")
    server.add_argument("--server-log", type=Path, help="server output file (default: a temporary file)")
    report = parser.add_argument_group("report")
    report.add_argument("--sample-interval-s", type=float, default=2.0, help="RSS sampling period")
    report.add_argument("--memory-growth-limit", type=float, default=0.10, help="flag RSS growth above this")
    report.add_argument("--output", type=Path, help="write the report here as JSON")
    args = parser.parse_args(argv)
    if args.tiny == (args.target is not None):
        parser.error("give exactly one of --tiny and --target")
    if args.spec and not args.tiny and args.head is None:
        parser.error("--spec needs --head (or use --tiny, or --no-spec)")
    if args.clients < 1 or args.duration_s <= 0 or args.max_tokens < 1 or args.max_prompt_tokens < 5:
        parser.error("--clients, --duration-s, --max-tokens must be positive, --max-prompt-tokens >= 5")
    if args.max_prompt_tokens + args.max_tokens > args.max_model_len:
        parser.error("--max-prompt-tokens + --max-tokens must fit in --max-model-len")
    return args


def _raise_exit(signum: int, _frame: Any) -> None:
    raise SystemExit(128 + signum)  # unwinds through the finally blocks: the server is stopped


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _raise_exit)
    signal.signal(signal.SIGHUP, _raise_exit)
    report = soak(args)
    text = json.dumps(report, indent=2)
    if args.output:
        args.output.write_text(text + "\n")
        log(f"report written to {args.output}")
    brief = {k: report[k] for k in ("requests", "latency_s", "server", "ok")}
    brief["errors"] = {k: report["errors"][k] for k in ("total", "http_5xx", "by_kind")}
    brief["memory"] = {k: v for k, v in report["memory"].items() if k != "samples"}
    print(json.dumps(brief, indent=2))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
