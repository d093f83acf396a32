"""Reliability of eagle2 under KV-cache pressure, client aborts and concurrent load.

Three scenarios on the "partial" tiny pair (eagle2 with m=12, depth=4, topk=3, float32, eager):

1. Preemption. An offline engine whose KV cache holds about three of eight requests
   (``num_gpu_blocks_override`` blocks of 32 tokens) preempts running requests and resumes them by
   recomputation. The greedy outputs equal those of a no-speculation engine with the same small cache
   and of a roomy one; every KV block comes back to the free pool when the requests finish, also when
   a running and a preempted request are aborted half-way. Two eagle2 engines go through this: the
   fixed budget, and eagle2's default, the adaptive one (on fixed step costs, so that its decisions
   do not depend on timing); both verify branching trees under the pressure.

   These engines run in a child interpreter with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the engine
   core lives in that process, so its scheduler's block pool can be read directly. Doing that in the
   pytest process itself would leave it changed for every later test module: vLLM's CPU worker
   replaces ``torch.set_num_threads`` with a no-op, drops torch to one thread, reseeds the global
   RNGs and freezes ``vllm.envs`` into a cache.

2. Abort mid-stream. One eagle2 server per module (``python -m vllm.entrypoints.openai.api_server``
   on 127.0.0.1, as in ``tests/test_serve.py``, but with the fixed budget, so that this module and
   that one, which serves the adaptive budget, cover both). A streamed completion is cut after a
   few chunks while others run; they finish with the text of the offline no-speculation run, the
   server stays healthy, answers a new request, and its KV cache is empty afterwards.

3. Bounded load. 64 concurrent streaming clients with prompts of 5..200 tokens, ``max_tokens``
   1..48, greedy and seeded sampling at temperature 0.8. Every request completes with status 200;
   greedy answers equal the offline no-speculation run; the same load sent twice gives the same
   answers (seeded sampling is reproducible whatever the batch it lands in). The server prefills
   every prompt in one piece (see SERVER_BATCH_TOKENS); a seeded request with a prefill cut in
   chunks is tested offline, where the cut is deterministic.

Every wait is bounded (child process, server start, each request, each load round).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from vllm_eagle2.budget.costs import COSTS_ENV
from vllm_eagle2.patches import FIX_VLLM_CPU_ENV
from vllm_eagle2_tools.testing import build_pair

SPEC = {"method": "eagle2", "num_speculative_tokens": 12, "depth": 4, "topk": 3, "budget": "fixed"}
#: The same tree under eagle2's default budget, the adaptive one, on fixed step costs (seconds = a + b *
#: tokens; COSTS_ENV) under which it drafts a few nodes per request, sized from the acceptance seen.
ADAPTIVE_SPEC = {key: value for key, value in SPEC.items() if key != "budget"}
STEP_COSTS = '{"target": [0.02, 0.0005], "level": [0.001, 0.0001], "overhead": 0.002}'
#: The small-cache engines: no speculation, and eagle2 under each budget.
SMALL_ENGINES = ("plain_small", "eagle2_small", "adaptive_small")
SERVER_MAX_MODEL_LEN = 512

# --- preemption: 8 requests of ~100 prompt + 100 generated tokens; the cache holds ~3 of them -------
PRESSURE_BLOCK_SIZE = 32  # the CPU attention backend wants multiples of 32
PRESSURE_BLOCKS = 24  # 768 token slots (one block is vLLM's null block)
PRESSURE_MAX_MODEL_LEN = 256  # must fit the cache: 8 blocks
PRESSURE_REQUESTS = 8
PRESSURE_MAX_TOKENS = 100
PRESSURE_BATCH_TOKENS = 128  # prompts are prefilled in chunks as well
SEEDED_PROMPT_TOKENS = 200  # > PRESSURE_BATCH_TOKENS: a prefill in two chunks
SEEDED_MAX_TOKENS = 16
OFFLINE_SECONDS = 400

# --- server -------------------------------------------------------------------------------------------
STARTUP_SECONDS = 180
REQUEST_SECONDS = 120
ABORT_STREAMS = 4  # stream 0 is cut after ABORT_AFTER_CHUNKS chunks
ABORT_AFTER_CHUNKS = 3
ABORT_MAX_TOKENS = 48
ABORTED_MAX_TOKENS = 400  # the cut stream could not finish before the cut
LOAD_CLIENTS = 64
# Every prompt of a load round is prefilled in one piece (64 x 200 < 16384): where a prefill is cut
# depends on arrival timing, and a cut prefill is tested offline, where the cut is deterministic
# (PRESSURE_BATCH_TOKENS).
SERVER_BATCH_TOKENS = 16384
LOAD_ROUND_SECONDS = 240
METRICS_SECONDS = 30


def pressure_prompt(index: int, group: int) -> list[int]:
    """A ~100-token prompt of ordinary tokens (ids 6..505; 0..5 are special)."""
    seed = group * PRESSURE_REQUESTS + index
    return [(seed * 131 + 7 * i) % 500 + 6 for i in range(90 + index)]


@dataclass(frozen=True)
class LoadRequest:
    """One request of the load: a token-id prompt, a length and greedy or seeded sampling."""

    prompt: list[int]
    max_tokens: int
    temperature: float
    seed: int | None

    def body(self, model: str) -> dict[str, Any]:
        """The JSON body of a /v1/completions request (``stream`` is added when sending)."""
        body: dict[str, Any] = {
            "model": model,
            "prompt": self.prompt,
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "ignore_eos": True,  # tiny models emit </s> anywhere; fixed lengths compare better
            "return_token_ids": True,
        }
        if self.seed is not None:
            body["seed"] = self.seed
        return body


def load_requests() -> list[LoadRequest]:
    """LOAD_CLIENTS requests: every 2nd greedy, the rest seeded sampling; lengths mixed, fixed seed."""
    rng = random.Random(20240611)
    requests = []
    for i in range(LOAD_CLIENTS):
        length = rng.randint(5, 200)
        prompt = [rng.randint(6, 511) for _ in range(length)]
        greedy = i % 2 == 0
        requests.append(
            LoadRequest(prompt, rng.randint(1, 48), 0.0 if greedy else 0.8, None if greedy else 1000 + i)
        )
    return requests


def abort_prompts() -> list[list[int]]:
    """Prompts of the abort test; stream 0 is the one that gets cut."""
    rng = random.Random(7)
    return [[rng.randint(6, 511) for _ in range(rng.randint(8, 60))] for _ in range(ABORT_STREAMS)]


# ---------------------------------------------------------------------------------------------------
# offline engines, in a child interpreter (see the module docstring)
# ---------------------------------------------------------------------------------------------------
def _token_ids(outputs: list[Any]) -> list[list[int]]:
    """The generated token ids of each ``RequestOutput``."""
    return [list(o.outputs[0].token_ids) for o in outputs]


def _counter(llm: Any, name: str) -> float:
    """A counter of ``llm.get_metrics()`` (0 when absent)."""
    return sum(m.value for m in llm.get_metrics() if m.name == name and hasattr(m, "value"))


def _small_cache_llm(target: str, spec: dict[str, Any] | None) -> Any:
    """An engine whose KV cache holds about three of the PRESSURE_REQUESTS requests."""
    from vllm import LLM

    return LLM(
        model=target,
        speculative_config=spec,
        dtype="float32",
        enforce_eager=True,
        max_model_len=PRESSURE_MAX_MODEL_LEN,
        max_num_seqs=PRESSURE_REQUESTS,
        block_size=PRESSURE_BLOCK_SIZE,
        num_gpu_blocks_override=PRESSURE_BLOCKS,
        max_num_batched_tokens=PRESSURE_BATCH_TOKENS,
        seed=0,
        disable_log_stats=False,
    )


def _run_under_pressure(llm: Any, greedy: Any) -> dict[str, Any]:
    """Group 0 through ``generate``; group 1 stepped by hand, aborting a preempted and a running request."""
    from vllm.v1.request import RequestStatus

    core = llm.llm_engine.engine_core.engine_core  # InprocClient -> EngineCore
    scheduler = core.scheduler
    pool = scheduler.kv_cache_manager.block_pool
    preemptions: list[dict[str, int]] = []
    preempt = scheduler._preempt_request

    def recording_preempt(request: Any, *args: Any, **kwargs: Any) -> None:
        preemptions.append({"outputs": request.num_output_tokens, "computed": request.num_computed_tokens})
        preempt(request, *args, **kwargs)

    scheduler._preempt_request = recording_preempt
    free_start = pool.get_num_free_blocks()
    prompts = [{"prompt_token_ids": pressure_prompt(i, 0)} for i in range(PRESSURE_REQUESTS)]
    outputs = llm.generate(prompts, greedy, use_tqdm=False)
    result: dict[str, Any] = {
        "ids": _token_ids(outputs),
        "free_start": free_start,
        "free_after_generate": pool.get_num_free_blocks(),
        "preemptions": preemptions[:],
        "num_preemptions_metric": _counter(llm, "vllm:num_preemptions"),
        "drafts": _counter(llm, "vllm:spec_decode_num_drafts"),
        "accepted": _counter(llm, "vllm:spec_decode_num_accepted_tokens"),
        "eagle2": llm.collective_rpc("eagle2_stats")[0],  # None without eagle2
    }

    engine = llm.llm_engine
    for i in range(PRESSURE_REQUESTS):
        engine.add_request(f"b{i}", {"prompt_token_ids": pressure_prompt(i, 1)}, greedy)
    finished: dict[str, list[int]] = {}
    aborted: dict[str, int] = {}
    for _ in range(2000):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = list(out.outputs[0].token_ids)
        if aborted:
            continue
        stalled = [r for r in scheduler.waiting if r.status == RequestStatus.PREEMPTED]
        running = [r for r in scheduler.running if r.num_output_tokens > 0]
        if stalled and running:
            victims = [stalled[0], running[0]]
            aborted = {r.request_id.rsplit("-", 1)[0]: r.num_output_tokens for r in victims}
            engine.abort_request([r.request_id for r in victims], internal=True)
    result["abort"] = {
        "finished": finished,
        "aborted": aborted,
        "free_end": pool.get_num_free_blocks(),
        "unfinished": engine.has_unfinished_requests(),
    }
    result["free_end"] = pool.get_num_free_blocks()
    result["num_gpu_blocks"] = pool.num_gpu_blocks
    result["reset_prefix_cache"] = llm.reset_prefix_cache()
    scheduler._preempt_request = preempt
    return result


def _seeded(llm: Any, runs: int) -> dict[str, Any]:
    """A seeded sampled request with a long prompt, ``runs`` times; the error if the engine fails.

    On the small-cache engines the first run prefills the prompt in two chunks and the second
    finds it in the prefix cache (one step): seeded sampling must not see the difference.
    """
    from vllm import SamplingParams

    prompt = {"prompt_token_ids": [(5 + 11 * i) % 500 + 6 for i in range(SEEDED_PROMPT_TOKENS)]}
    params = SamplingParams(temperature=0.8, seed=4321, max_tokens=SEEDED_MAX_TOKENS, ignore_eos=True)
    done: list[list[int]] = []
    try:
        for _ in range(runs):
            done += _token_ids(llm.generate([prompt], params, use_tqdm=False))
    except Exception as error:  # noqa: BLE001 - reported to the test, which fails on it
        return {"runs": done, "error": f"{type(error).__name__}: {error}"}
    return {"runs": done, "error": None}


def offline_main(job_path: str) -> None:
    """Child-process entry: run the offline engines of ``job_path`` and write the results next to it."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    # The engines without eagle2 need the plugin's opt-in fix of vLLM's CPU generator rewind to
    # survive a seeded chunked prefill at all (eagle2 engines get it without asking).
    os.environ[FIX_VLLM_CPU_ENV] = "1"
    import gc

    from vllm import LLM, SamplingParams

    from vllm_eagle2_tools.engine import scoped_env

    job = json.loads(Path(job_path).read_text())
    target, head = job["target"], job["head"]
    greedy = SamplingParams(temperature=0.0, max_tokens=PRESSURE_MAX_TOKENS, ignore_eos=True)
    results: dict[str, Any] = {}
    specs = (None, {**SPEC, "model": head}, {**ADAPTIVE_SPEC, "model": head})
    for name, spec in zip(SMALL_ENGINES, specs):
        started = time.monotonic()
        with scoped_env({COSTS_ENV: STEP_COSTS}):  # read by the adaptive budget at start-up
            llm = _small_cache_llm(target, spec)
        try:
            results[name] = _run_under_pressure(llm, greedy)
            results[name]["seeded"] = _seeded(llm, runs=2)  # last: a failure here kills the engine
        finally:
            try:
                llm.llm_engine.engine_core.shutdown()
            except Exception:  # noqa: BLE001 - an engine that died in _seeded
                pass
            del llm
            gc.collect()
        results[name]["seconds"] = time.monotonic() - started

    started = time.monotonic()
    roomy = LLM(
        model=target,
        dtype="float32",
        enforce_eager=True,
        max_model_len=SERVER_MAX_MODEL_LEN,
        max_num_seqs=LOAD_CLIENTS,
        seed=0,
        disable_log_stats=False,
    )
    try:
        pressure = [
            {"prompt_token_ids": pressure_prompt(i, g)} for g in (0, 1) for i in range(PRESSURE_REQUESTS)
        ]
        ids = _token_ids(roomy.generate(pressure, greedy, use_tqdm=False))
        server_jobs = job["server"]
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _, n in server_jobs]
        outputs = roomy.generate([{"prompt_token_ids": p} for p, _ in server_jobs], params, use_tqdm=False)
        results["roomy"] = {
            "pressure": [ids[:PRESSURE_REQUESTS], ids[PRESSURE_REQUESTS:]],
            "server": [{"ids": list(o.outputs[0].token_ids), "text": o.outputs[0].text} for o in outputs],
            "num_preemptions_metric": _counter(roomy, "vllm:num_preemptions"),
            "seeded": _seeded(roomy, runs=1),  # prefilled in one step
            "seconds": time.monotonic() - started,
        }
    finally:
        roomy.llm_engine.engine_core.shutdown()
    Path(job_path).with_suffix(".out.json").write_text(json.dumps(results))


def kill_group(process: subprocess.Popen, term_grace: float = 30.0) -> None:
    """SIGTERM a process group (leader and children), then SIGKILL what is left."""
    for sig, grace in ((signal.SIGTERM, term_grace), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            continue
    try:
        os.killpg(process.pid, signal.SIGKILL)  # children outliving the leader
    except ProcessLookupError:
        pass


def log_tail(path: Path, lines: int = 60) -> str:
    """The last ``lines`` lines of a log file."""
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The "partial" tiny (target, head) pair."""
    return build_pair(tmp_path_factory.mktemp("reliability_models"), "partial", seed=0)


@pytest.fixture(scope="module")
def offline(pair: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Results of the child interpreter: small-cache runs (plain, eagle2) and roomy references."""
    work = tmp_path_factory.mktemp("reliability_offline")
    job = work / "job.json"
    server_jobs = [(r.prompt, r.max_tokens) for r in load_requests() if r.temperature == 0.0]
    server_jobs += [(p, ABORT_MAX_TOKENS) for p in abort_prompts()]
    job.write_text(json.dumps({"target": str(pair[0]), "head": str(pair[1]), "server": server_jobs}))
    here = Path(__file__).resolve().parent
    code = (
        f"import sys; sys.path.insert(0, {str(here)!r}); "
        "import test_reliability; test_reliability.offline_main(sys.argv[1])"
    )
    log = work / "offline.log"
    with open(log, "wb") as sink:
        process = subprocess.Popen(
            [sys.executable, "-c", code, str(job)],
            stdout=sink,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        process.wait(timeout=OFFLINE_SECONDS)
    except subprocess.TimeoutExpired:
        kill_group(process, term_grace=5)
        pytest.fail(
            f"offline engines still running after {OFFLINE_SECONDS} s:\n{log_tail(log)}", pytrace=False
        )
    finally:
        kill_group(process, term_grace=5)
    if process.returncode != 0:
        pytest.fail(f"offline engines exited with {process.returncode}:\n{log_tail(log)}", pytrace=False)
    return json.loads(job.with_suffix(".out.json").read_text())


def test_requests_are_preempted_mid_generation(offline: dict[str, Any]) -> None:
    """The small cache preempts requests that already have output; the roomy one does not."""
    for name in SMALL_ENGINES:
        run = offline[name]
        assert run["num_preemptions_metric"] > 0, name
        assert any(p["outputs"] > 0 for p in run["preemptions"]), (name, run["preemptions"])
    assert offline["roomy"]["num_preemptions_metric"] == 0


@pytest.mark.parametrize("name", ["eagle2_small", "adaptive_small"])
def test_eagle2_verifies_branching_trees_under_preemption(offline: dict[str, Any], name: str) -> None:
    """Under either budget, drafts were verified and accepted, branching trees recomputed with
    their masks, and accepted off-chain nodes' K/V moved, while requests were preempted."""
    run = offline[name]
    assert run["drafts"] > 0 and run["accepted"] > 0, run
    assert run["eagle2"]["tree_rows"] > 0 and run["eagle2"]["kv_moves"] > 0, run["eagle2"]


def test_greedy_output_under_preemption_equals_no_speculation(offline: dict[str, Any]) -> None:
    """Preempted and resumed eagle2 requests give the tokens of no speculation (small and roomy cache)."""
    roomy = offline["roomy"]["pressure"][0]
    for name in SMALL_ENGINES:
        assert offline[name]["ids"] == roomy, name
    assert all(len(ids) == PRESSURE_MAX_TOKENS for ids in roomy)


def test_every_kv_block_is_freed_after_preempted_requests_finish(offline: dict[str, Any]) -> None:
    """After the preempted requests finish, the block pool has every block back."""
    for name in SMALL_ENGINES:
        run = offline[name]
        assert run["free_start"] == run["num_gpu_blocks"] - 1 == PRESSURE_BLOCKS - 1, name  # null block
        assert run["free_after_generate"] == run["free_start"], name
        assert run["free_end"] == run["free_start"], name
        assert run["reset_prefix_cache"], name  # vLLM's own check that no block is held


def test_seeded_sampling_with_a_chunked_prefill(offline: dict[str, Any]) -> None:
    """A seeded request whose prompt is prefilled in chunks runs, and draws as without chunks."""
    # vLLM 0.32 un-draws the sample of a partial prefill with Generator.set_offset, which CPU
    # generators do not have: "RuntimeError: CPU Generator does not use offset" kills the engine.
    for name in (*SMALL_ENGINES, "roomy"):
        assert offline[name]["seeded"]["error"] is None, (name, offline[name]["seeded"]["error"])
    # The fixed budget's trees do not change run to run (the adaptive budget's do, and with them the
    # draws: tests/test_engine_requests.py).
    chunked, cached = offline["eagle2_small"]["seeded"]["runs"]
    assert chunked == cached  # two prefill chunks or one step: the same seeded draws
    assert offline["plain_small"]["seeded"]["runs"] == offline["roomy"]["seeded"]["runs"] * 2


def test_abort_of_preempted_and_running_requests_frees_their_blocks(offline: dict[str, Any]) -> None:
    """Aborting a preempted and a running request frees their blocks; the others are unchanged."""
    for name in SMALL_ENGINES:
        abort = offline[name]["abort"]
        assert len(abort["aborted"]) == 2 and not abort["unfinished"], (name, abort["aborted"])
        assert abort["free_end"] == offline[name]["free_start"], name
        reference = offline["roomy"]["pressure"][1]
        expected = {f"b{i}": ids for i, ids in enumerate(reference) if f"b{i}" not in abort["aborted"]}
        assert abort["finished"] == expected, name


# ---------------------------------------------------------------------------------------------------
# the server
# ---------------------------------------------------------------------------------------------------
def free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def server(
    pair: tuple[Path, Path], offline: dict[str, Any], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """Base URL of an eagle2 server on 127.0.0.1; started after the offline engines have exited."""
    target, head = pair
    port = free_port()
    log = tmp_path_factory.mktemp("reliability_server") / "server.log"
    command = [
        *(sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(target)),
        *("--speculative-config", json.dumps({**SPEC, "model": str(head)})),
        *("--dtype", "float32", "--enforce-eager", "--max-model-len", str(SERVER_MAX_MODEL_LEN)),
        *("--max-num-seqs", str(LOAD_CLIENTS), "--max-num-batched-tokens", str(SERVER_BATCH_TOKENS)),
        *("--host", "127.0.0.1", "--port", str(port)),
    ]
    with open(log, "wb") as sink:
        process = subprocess.Popen(
            command,
            stdout=sink,
            stderr=subprocess.STDOUT,
            env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"},
            start_new_session=True,
        )
    base_url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_SECONDS
        while True:
            if process.poll() is not None:
                pytest.fail(f"server exited with {process.returncode}:\n{log_tail(log)}", pytrace=False)
            try:
                if httpx.get(f"{base_url}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"server not healthy after {STARTUP_SECONDS} s:\n{log_tail(log)}", pytrace=False)
            time.sleep(1)
        yield base_url
        assert process.poll() is None, f"server died during the tests:\n{log_tail(log)}"
    finally:
        kill_group(process)


@pytest.fixture(scope="module")
def model(pair: tuple[Path, Path]) -> str:
    """The served model name (the target's folder)."""
    return str(pair[0])


@dataclass
class Stream:
    """What a client saw of one streamed completion."""

    status: int = 0
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    chunks: int = 0
    finish_reason: str | None = None
    done: bool = False  # the server sent [DONE]
    error: str | None = None


async def stream_completion(
    client: httpx.AsyncClient, base_url: str, body: dict[str, Any], cut_after: int | None = None
) -> Stream:
    """POST a streamed completion and read it.

    With ``cut_after``, the connection is closed after that many chunks (the client goes away).
    """
    seen = Stream()
    async with client.stream("POST", f"{base_url}/v1/completions", json={**body, "stream": True}) as reply:
        seen.status = reply.status_code
        if reply.status_code != 200:
            seen.error = (await reply.aread()).decode(errors="replace")[:500]
            return seen
        async for line in reply.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line.removeprefix("data: ")
            if data == "[DONE]":
                seen.done = True
                break
            chunk = json.loads(data)
            if "error" in chunk:
                seen.error = json.dumps(chunk["error"])[:500]
                continue
            for choice in chunk.get("choices", []):
                seen.token_ids += choice.get("token_ids") or []
                seen.text += choice.get("text") or ""
                seen.finish_reason = choice.get("finish_reason") or seen.finish_reason
            seen.chunks += 1
            if cut_after is not None and seen.chunks >= cut_after:
                break  # leaving the context closes the half-read response: the connection drops
    return seen


def async_client(connections: int) -> httpx.AsyncClient:
    """An async client allowing ``connections`` simultaneous connections, with bounded timeouts."""
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    return httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(REQUEST_SECONDS, connect=10))


def metric_values(base_url: str) -> dict[str, float]:
    """``/metrics`` samples summed over labels, keyed by name (finish reasons kept apart)."""
    from prometheus_client.parser import text_string_to_metric_families

    page = httpx.get(f"{base_url}/metrics", timeout=30)
    page.raise_for_status()
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(page.text):
        for sample in family.samples:
            name = sample.name
            if "finished_reason" in sample.labels:
                name += f"[{sample.labels['finished_reason']}]"
            values[name] = values.get(name, 0.0) + sample.value
    return values


def wait_until_idle(base_url: str, model: str) -> dict[str, float]:
    """Send a one-token request, then poll /metrics until nothing runs or waits; returns the metrics."""
    reply = httpx.post(
        f"{base_url}/v1/completions",
        json={"model": model, "prompt": [7, 8, 9], "max_tokens": 1, "temperature": 0.0},
        timeout=REQUEST_SECONDS,
    )
    assert reply.status_code == 200, reply.text
    deadline = time.monotonic() + METRICS_SECONDS
    while True:
        values = metric_values(base_url)
        if (
            values.get("vllm:num_requests_running", 0) == 0
            and values.get("vllm:num_requests_waiting", 0) == 0
        ):
            return values
        assert time.monotonic() < deadline, {k: v for k, v in values.items() if "num_requests" in k}
        time.sleep(0.5)


def test_abort_mid_stream_spares_the_other_streams(server: str, model: str, offline: dict[str, Any]) -> None:
    """A client leaving mid-stream aborts its request only; the server keeps serving."""
    prompts = abort_prompts()
    expected = offline["roomy"]["server"][-ABORT_STREAMS:]
    before = metric_values(server).get("vllm:generation_tokens_total", 0.0)

    async def run() -> list[Stream]:
        async with async_client(ABORT_STREAMS) as client:
            cut = {"model": model, "prompt": prompts[0], "max_tokens": ABORTED_MAX_TOKENS, "temperature": 0.0}
            calls = [
                stream_completion(client, server, {**cut, "ignore_eos": True}, cut_after=ABORT_AFTER_CHUNKS)
            ]
            for prompt in prompts[1:]:
                body = LoadRequest(prompt, ABORT_MAX_TOKENS, 0.0, None).body(model)
                calls.append(stream_completion(client, server, body))
            return await asyncio.wait_for(asyncio.gather(*calls), timeout=REQUEST_SECONDS)

    streams = asyncio.run(run())
    assert streams[0].status == 200 and streams[0].chunks == ABORT_AFTER_CHUNKS and not streams[0].done
    for seen, want in zip(streams[1:], expected[1:]):
        assert (seen.status, seen.error, seen.done, seen.finish_reason) == (200, None, True, "length")
        assert (seen.token_ids, seen.text) == (want["ids"], want["text"])

    assert httpx.get(f"{server}/health", timeout=10).status_code == 200

    async def again() -> Stream:
        async with async_client(1) as client:
            body = LoadRequest(prompts[1], ABORT_MAX_TOKENS, 0.0, None).body(model)
            return await asyncio.wait_for(stream_completion(client, server, body), timeout=REQUEST_SECONDS)

    seen = asyncio.run(again())
    assert (seen.status, seen.done, seen.token_ids, seen.text) == (
        200,
        True,
        expected[1]["ids"],
        expected[1]["text"],
    )
    values = wait_until_idle(server, model)
    # Nothing runs, and the cut request generated far fewer than its max_tokens: it was aborted.
    others = (
        (ABORT_STREAMS - 1) * ABORT_MAX_TOKENS + ABORT_MAX_TOKENS + 1
    )  # + the new one + wait_until_idle's
    generated = values["vllm:generation_tokens_total"] - before
    assert others + ABORT_AFTER_CHUNKS <= generated < others + ABORTED_MAX_TOKENS // 2, generated
    assert values["vllm:kv_cache_usage_perc"] == 0.0  # the cut request's blocks are back


LoadRounds = list[tuple[list[Stream | BaseException], float]]


@pytest.fixture(scope="module")
def load_rounds(server: str, model: str) -> LoadRounds:
    """The same LOAD_CLIENTS concurrent streamed requests, sent twice; (results, seconds) per round."""
    requests = load_requests()

    async def one_round() -> list[Stream | BaseException]:
        async with async_client(LOAD_CLIENTS) as client:
            calls = [stream_completion(client, server, r.body(model)) for r in requests]
            return await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), LOAD_ROUND_SECONDS)

    rounds = []
    for _ in range(2):
        started = time.monotonic()
        rounds.append((asyncio.run(one_round()), time.monotonic() - started))
    return rounds


def test_concurrent_load_completes_without_errors(load_rounds: LoadRounds) -> None:
    """Every request of both rounds completes with status 200 and its full length."""
    requests = load_requests()
    for results, _ in load_rounds:
        failures = [r if isinstance(r, BaseException) else r.error for r in results]
        assert [f for f in failures if f is not None] == []
        assert [r.status for r in results] == [200] * LOAD_CLIENTS
        assert all(r.done and r.finish_reason == "length" for r in results)
        assert [len(r.token_ids) for r in results] == [q.max_tokens for q in requests]


def test_concurrent_greedy_answers_equal_no_speculation(
    load_rounds: LoadRounds, offline: dict[str, Any]
) -> None:
    """Greedy answers under concurrent load equal the offline run without speculation."""
    greedy = [i for i, r in enumerate(load_requests()) if r.temperature == 0.0]
    expected = offline["roomy"]["server"][: len(greedy)]
    for results, _ in load_rounds:
        got = [{"ids": results[i].token_ids, "text": results[i].text} for i in greedy]
        assert got == expected


def test_seeded_sampling_under_load_is_reproducible(load_rounds: LoadRounds) -> None:
    """The same seeded requests give the same answers in both rounds (batches differ)."""
    sampled = [i for i, r in enumerate(load_requests()) if r.temperature > 0.0]
    (first, _), (second, _) = load_rounds
    assert [first[i].token_ids for i in sampled] == [second[i].token_ids for i in sampled]
    assert [first[i].text for i in sampled] == [second[i].text for i in sampled]


def test_server_is_healthy_and_its_kv_cache_empty_after_load(
    load_rounds: LoadRounds, server: str, model: str
) -> None:
    """After the load the server is healthy, idle, and holds no KV block; drafts were verified and
    accepted under the load (the counter's samples are ``_total`` on the page)."""
    assert httpx.get(f"{server}/health", timeout=10).status_code == 200
    values = wait_until_idle(server, model)
    assert values["vllm:kv_cache_usage_perc"] == 0.0
    assert values["vllm:spec_decode_num_accepted_tokens_total"] > 0, values
