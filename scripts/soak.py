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
import asyncio
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

HOST = "127.0.0.1"  # loopback only
TINY_TREE = (12, 4, 3)  # num_speculative_tokens, depth, topk
ERROR_BACKOFF_S = 0.5  # a client's pause after a failed request


def log(msg: str) -> None:
    """Progress line on stderr, flushed at once."""
    print(f"[soak] {msg}", file=sys.stderr, flush=True)


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


# ---------------------------------------------------------------------------------------------------
# the server
# ---------------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


def server_command(args: argparse.Namespace, target: Path, head: Path | None, port: int) -> list[str]:
    """The API server module (same parser and app as ``vllm serve``) on 127.0.0.1."""
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(target)]
    if args.spec:
        spec = {
            "method": "eagle2",
            "model": str(head),
            "num_speculative_tokens": args.num_speculative_tokens,
            "depth": args.depth,
            "topk": args.topk,
        }
        command += ["--speculative-config", json.dumps(spec)]
    dtype = args.dtype or ("float32" if args.tiny else "auto")
    command += ["--dtype", dtype, "--enforce-eager", "--max-model-len", str(args.max_model_len)]
    command += ["--max-num-seqs", str(max(args.clients, 1))]
    command += ["--host", HOST, "--port", str(port), *args.server_arg]
    return command


def stop_group(process: subprocess.Popen) -> None:
    """SIGTERM the server's process group, SIGKILL what is left after a grace period."""
    for sig, grace in ((signal.SIGTERM, 30.0), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            continue
    try:
        os.killpg(process.pid, signal.SIGKILL)  # children outliving the API server
    except ProcessLookupError:
        pass


def error_lines(path: Path, limit: int = 10) -> list[str]:
    """The first distinct ``...Error: message`` lines of the server log (the root cause comes first)."""
    found: list[str] = []
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return found
    for line in text.splitlines():
        if " WARNING " in line:  # e.g. the ulimit warning quotes an OSError
            continue
        match = re.search(r"\b(\w+(?:Error|Exception)): (.*)$", line)
        if match and (item := f"{match[1]}: {match[2].strip()}"[:300]) not in found:
            found.append(item)
            if len(found) == limit:
                break
    return found


def log_tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


@contextmanager
def running_server(
    command: list[str], port: int, log_path: Path, timeout_s: float
) -> Iterator[subprocess.Popen]:
    """Start the server in its own process group, wait for /health, always stop it."""
    import httpx

    with open(log_path, "wb") as sink:
        process = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        base_url = f"http://{HOST}:{port}"
        deadline = time.monotonic() + timeout_s
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"server exited with {process.returncode}:\n{log_tail(log_path)}")
            try:
                if httpx.get(f"{base_url}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"server not healthy after {timeout_s:.0f} s:\n{log_tail(log_path)}")
            time.sleep(1)
        yield process
    finally:
        stop_group(process)


# ---------------------------------------------------------------------------------------------------
# memory of the server's process tree
# ---------------------------------------------------------------------------------------------------
class RssSampler(threading.Thread):
    """Samples the summed RSS of a process and its descendants every ``interval`` seconds."""

    def __init__(self, pid: int, interval: float, t0: float) -> None:
        super().__init__(daemon=True)
        self.pid = pid
        self.interval = interval
        self.t0 = t0
        self.samples: list[dict[str, Any]] = []
        self._halt = threading.Event()

    def sample(self) -> None:
        import psutil

        try:
            root = psutil.Process(self.pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.Error:
            return
        by_process: dict[str, float] = {}
        for proc in procs:
            try:
                by_process[f"{proc.name()}[{proc.pid}]"] = float(proc.memory_info().rss)
            except psutil.Error:  # exited between listing and reading, or a zombie
                continue
        if not by_process:  # the server is gone: no sample
            return
        self.samples.append(
            {
                "t_s": time.monotonic() - self.t0,
                "rss_bytes": sum(by_process.values()),
                "by_process": by_process,
            }
        )

    def run(self) -> None:
        while not self._halt.is_set():
            self.sample()
            self._halt.wait(self.interval)

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=self.interval + 10)


# ---------------------------------------------------------------------------------------------------
# the load
# ---------------------------------------------------------------------------------------------------
@dataclass
class RequestRecord:
    """One request as the client saw it (times in seconds from the start of the load)."""

    client: int
    start_s: float
    end_s: float = 0.0
    first_token_s: float | None = None
    status: int = 0
    prompt_tokens: int = 0
    max_tokens: int = 0
    temperature: float = 0.0
    tokens: int = 0
    done: bool = False  # [DONE] arrived
    error: str | None = None  # "http_5xx", "http_4xx", "stream_error", "cut", "exception:Type"
    detail: str | None = None


@dataclass
class PromptSource:
    """Token ids to draw prompts from (special and added tokens left out)."""

    ids: list[int] = field(default_factory=list)

    @classmethod
    def of(cls, target: Path) -> PromptSource:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(target))
        banned = set(tokenizer.all_special_ids) | set(getattr(tokenizer, "added_tokens_decoder", {}))
        return cls([i for i in range(len(tokenizer)) if i not in banned])


async def one_request(
    client: Any, base_url: str, body: dict[str, Any], record: RequestRecord, t0: float
) -> None:
    """Stream one completion into ``record``; never raises."""
    try:
        async with client.stream("POST", f"{base_url}/v1/completions", json=body) as reply:
            record.status = reply.status_code
            if reply.status_code >= 400:
                record.error = "http_5xx" if reply.status_code >= 500 else "http_4xx"
                record.detail = (await reply.aread()).decode(errors="replace")[:300]
                return
            async for line in reply.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line.removeprefix("data: ")
                if data == "[DONE]":
                    record.done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    record.error = "stream_error"
                    record.detail = json.dumps(chunk["error"])[:300]
                    continue
                for choice in chunk.get("choices", []):
                    got = len(choice.get("token_ids") or [])
                    if got and record.first_token_s is None:
                        record.first_token_s = time.monotonic() - t0
                    record.tokens += got
        if record.error is None and not record.done:
            record.error = "cut"
    except Exception as error:  # noqa: BLE001 - every failure is a result here
        record.error = f"exception:{type(error).__name__}"
        record.detail = str(error)[:300]
    finally:
        record.end_s = time.monotonic() - t0


async def run_load(
    args: argparse.Namespace,
    base_url: str,
    model: str,
    prompts: PromptSource,
    server_alive: Callable[[], bool],
) -> list[RequestRecord]:
    """``args.clients`` clients send requests back to back until ``args.duration_s`` has passed.

    The load ends early when the server process has exited; after a failed request a client
    waits a moment before its next one (no tight loop against a dead server).
    """
    import httpx

    t0 = time.monotonic()
    records: list[RequestRecord] = []
    limits = httpx.Limits(max_connections=args.clients, max_keepalive_connections=args.clients)
    timeout = httpx.Timeout(args.request_timeout_s, connect=10.0)

    async def client_loop(index: int, client: httpx.AsyncClient) -> None:
        rng = random.Random(args.seed * 100_003 + index)
        while time.monotonic() - t0 < args.duration_s and server_alive():
            length = rng.randint(5, args.max_prompt_tokens)
            max_tokens = rng.randint(1, args.max_tokens)
            sampled = rng.random() < 0.5
            body: dict[str, Any] = {
                "model": model,
                "prompt": [rng.choice(prompts.ids) for _ in range(length)],
                "max_tokens": max_tokens,
                "temperature": 0.8 if sampled else 0.0,
                "ignore_eos": True,
                "return_token_ids": True,
                "stream": True,
            }
            if sampled:
                body["seed"] = rng.randrange(2**31)
            record = RequestRecord(index, time.monotonic() - t0, prompt_tokens=length, max_tokens=max_tokens)
            record.temperature = body["temperature"]
            records.append(record)
            try:
                await asyncio.wait_for(
                    one_request(client, base_url, body, record, t0), args.request_timeout_s
                )
            except asyncio.TimeoutError:
                record.error, record.end_s = "exception:Timeout", time.monotonic() - t0
            if record.error is not None:
                await asyncio.sleep(ERROR_BACKOFF_S)

    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        tasks = [asyncio.create_task(client_loop(i, client)) for i in range(args.clients)]
        # Hard bound: the last requests start before duration_s and each is bounded by its timeout.
        _, pending = await asyncio.wait(tasks, timeout=args.duration_s + args.request_timeout_s + 30)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    return records


# ---------------------------------------------------------------------------------------------------
# the report
# ---------------------------------------------------------------------------------------------------
def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile ``q`` in [0, 100]; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def server_counters(base_url: str) -> dict[str, float]:
    """A few of vLLM's /metrics counters (summed over labels)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    wanted = {
        "vllm:num_preemptions_total",
        "vllm:spec_decode_num_drafts_total",
        "vllm:spec_decode_num_accepted_tokens_total",
        "vllm:spec_decode_num_draft_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:kv_cache_usage_perc",
        "vllm:num_requests_running",
    }
    page = httpx.get(f"{base_url}/metrics", timeout=30)
    page.raise_for_status()
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(page.text):
        for sample in family.samples:
            if sample.name in wanted:
                values[sample.name] = values.get(sample.name, 0.0) + sample.value
    return values


def summarize(
    args: argparse.Namespace,
    records: list[RequestRecord],
    samples: list[dict[str, Any]],
    load_s: float,
    health: int | None,
    counters: dict[str, float],
    server_alive: bool,
) -> dict[str, Any]:
    """The report: throughput, latency, errors, memory, vLLM counters, and an overall ``ok``."""
    measured = [r for r in records if r.start_s >= args.warmup_s and r.error is None]
    window = max(load_s - args.warmup_s, 1e-9)
    latencies = [r.end_s - r.start_s for r in measured]
    ttfts = [r.first_token_s - r.start_s for r in measured if r.first_token_s is not None]
    errors: dict[str, int] = {}
    for r in records:
        if r.error is not None:
            errors[r.error] = errors.get(r.error, 0) + 1
    error_examples = [asdict(r) for r in records if r.error is not None][:5]

    after_warmup = next((s for s in samples if s["t_s"] >= args.warmup_s), samples[-1] if samples else None)
    end = samples[-1] if samples else None
    growth = None
    if after_warmup and end and after_warmup["rss_bytes"] > 0:
        growth = end["rss_bytes"] / after_warmup["rss_bytes"] - 1.0
    memory_flag = growth is not None and growth > args.memory_growth_limit
    # RSS also grows while KV-cache pages are touched for the first time; a leak keeps growing in
    # the second half of the load as well.
    middle = next((s for s in samples if s["t_s"] >= load_s / 2), None)
    second_half = (
        end["rss_bytes"] / middle["rss_bytes"] - 1.0 if middle and end and middle["rss_bytes"] else None
    )
    mib = 1 << 20
    memory = {
        "after_warmup_mib": after_warmup["rss_bytes"] / mib if after_warmup else None,
        "end_mib": end["rss_bytes"] / mib if end else None,
        "peak_mib": max(s["rss_bytes"] for s in samples) / mib if samples else None,
        "growth": growth,
        "growth_second_half": second_half,
        "growth_limit": args.memory_growth_limit,
        "growth_flagged": memory_flag,
        "by_process_mib": {
            name: {
                "after_warmup": round(rss / mib, 1),
                "end": round(end["by_process"].get(name, 0.0) / mib, 1),
            }
            for name, rss in (after_warmup["by_process"].items() if after_warmup and end else [])
        },
        "samples": [{"t_s": round(s["t_s"], 1), "rss_mib": round(s["rss_bytes"] / mib, 1)} for s in samples],
    }
    drafts = counters.get("vllm:spec_decode_num_drafts_total", 0.0)
    accepted = counters.get("vllm:spec_decode_num_accepted_tokens_total", 0.0)
    report = {
        "config": {
            "model": "tiny partial pair" if args.tiny else str(args.target),
            "spec": (
                {"method": "eagle2", "m": args.num_speculative_tokens, "depth": args.depth, "topk": args.topk}
                if args.spec
                else None
            ),
            "clients": args.clients,
            "duration_s": args.duration_s,
            "warmup_s": args.warmup_s,
            "max_prompt_tokens": args.max_prompt_tokens,
            "max_tokens": args.max_tokens,
        },
        "requests": {
            "total": len(records),
            "ok": sum(r.error is None for r in records),
            "measured_after_warmup": len(measured),
            "requests_per_s": len(measured) / window,
            "generated_tokens_per_s": sum(r.tokens for r in measured) / window,
            "load_s": load_s,
        },
        "latency_s": {
            "p50": percentile(latencies, 50),
            "p99": percentile(latencies, 99),
            "max": max(latencies, default=None),
            "ttft_p50": percentile(ttfts, 50),
            "ttft_p99": percentile(ttfts, 99),
        },
        "errors": {
            "total": sum(errors.values()),
            "http_5xx": errors.get("http_5xx", 0),
            "by_kind": errors,
            "examples": error_examples,
        },
        "server": {
            "health_after_load": health,
            "alive_after_load": server_alive,
            "preemptions": counters.get("vllm:num_preemptions_total"),
            "mean_acceptance_length": 1.0 + accepted / drafts if drafts else None,
            "kv_cache_usage_after_load": counters.get("vllm:kv_cache_usage_perc"),
        },
        "memory": memory,
    }
    report["ok"] = bool(records) and not errors and not memory_flag and health == 200 and server_alive
    return report


# ---------------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------------
def _raise_exit(signum: int, _frame: Any) -> None:
    raise SystemExit(128 + signum)  # unwinds through the finally blocks: the server is stopped


def soak(args: argparse.Namespace) -> dict[str, Any]:
    """Start the server, run the load, sample memory, stop the server; returns the report."""
    from vllm_eagle2.cpu_env import configure_cpu_env

    configure_cpu_env()
    scratch = Path(tempfile.mkdtemp(prefix="vllm_eagle2_soak_"))
    try:
        if args.tiny:
            from vllm_eagle2.tiny_models import build_pair

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
