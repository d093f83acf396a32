"""Soak test of a vLLM server (eagle2 or no speculation) under a bounded, concurrent streaming load.

The library behind ``scripts/soak.py`` (its docstring describes the load and the report):
:mod:`.server` starts and stops the server and samples its memory, :mod:`.load` runs the clients,
:mod:`.report` summarizes; :func:`soak` does all of it for the script's parsed arguments.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from vllm_eagle2_tools.progress import stderr_log
from vllm_eagle2_tools.soak.load import PromptSource, RequestRecord, run_load
from vllm_eagle2_tools.soak.report import percentile, server_counters, summarize
from vllm_eagle2_tools.soak.server import (
    HOST,
    RssSampler,
    error_lines,
    free_port,
    log_tail,
    running_server,
    server_command,
)

TINY_TREE = (12, 4, 3)  # num_speculative_tokens, depth, topk

__all__ = [
    "HOST",
    "TINY_TREE",
    "PromptSource",
    "RequestRecord",
    "RssSampler",
    "log",
    "percentile",
    "server_command",
    "soak",
    "summarize",
]


log = stderr_log("soak")


def soak(args: argparse.Namespace) -> dict[str, Any]:
    """Start the server, run the load, sample memory, stop the server; returns the report."""
    from vllm_eagle2_tools.cpu_env import configure_cpu_env

    configure_cpu_env()
    scratch = Path(tempfile.mkdtemp(prefix="vllm_eagle2_soak_"))
    try:
        if args.tiny:
            from vllm_eagle2_tools.testing import build_pair

            target, head = build_pair(scratch / "models", "partial", seed=0)
            log(f"tiny pair built in {scratch / 'models'}")
        else:
            target, head = args.target, args.head
        prompts = PromptSource.of(target)
        port = args.port or free_port()
        base_url = f"http://{HOST}:{port}"
        log_path = args.server_log or scratch / "server.log"
        command = server_command(args, target, head if args.spec else None, port)
        kind = "eagle2" if args.spec else "no speculation"
        log(f"starting the server on {base_url} ({kind}); log: {log_path}")
        started = time.monotonic()
        with running_server(command, port, log_path, args.startup_timeout_s) as process:
            ready = time.monotonic() - started
            log(f"server healthy after {ready:.0f} s; {args.clients} clients for {args.duration_s:.0f} s")
            t0 = time.monotonic()
            sampler = RssSampler(process.pid, args.sample_interval_s, t0)
            sampler.start()
            try:
                alive = lambda: process.poll() is None  # noqa: E731
                records = asyncio.run(run_load(args, base_url, str(target), prompts, alive))
            finally:
                sampler.sample()  # the end point
                sampler.stop()
            load_s = time.monotonic() - t0
            server_alive = process.poll() is None
            health: int | None = None
            counters: dict[str, float] = {}
            try:
                import httpx

                health = httpx.get(f"{base_url}/health", timeout=10).status_code
                counters = server_counters(base_url)
            except Exception as error:  # noqa: BLE001 - reported as an unhealthy server
                log(f"server did not answer after the load: {error!r}")
            report = summarize(args, records, sampler.samples, load_s, health, counters, server_alive)
            if not report["ok"]:
                report["server_errors"] = error_lines(log_path)
                report["server_log_tail"] = log_tail(log_path)
        return report
    finally:
        shutil.rmtree(scratch, ignore_errors=True)  # the tiny pair and the default server log
