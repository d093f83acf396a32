"""The soak test's server: an OpenAI API server process on 127.0.0.1, and its memory.

:func:`running_server` starts it in its own process group, waits for ``/health`` and always stops it
(SIGTERM, then SIGKILL); :class:`RssSampler` samples the resident memory of its process tree.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

HOST = "127.0.0.1"  # loopback only


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
