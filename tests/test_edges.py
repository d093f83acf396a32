"""eagle2 exact at the edges of what vLLM users run by default.

* The adaptive budget's decisions under adverse prices: a request that may not draft (penalised)
  gets no drafts, however the budget prices drafting.
* A request near ``max_model_len`` stops drafting alone; the batch's other requests go on, and no
  zero-filled draft is ever verified.
* Tensor parallelism: ranks that time their passes apart still decide alike (TP=2 on this CPU,
  compiled, every default, one core per rank).
* The verifier's widest step, run inside vLLM's memory profile.

Float32 tiny models, greedy, against the same engine without speculation.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import run_llm

from vllm_eagle2.budget.costs import COSTS_ENV
from vllm_eagle2_tools.testing import build_pair

MAX_MODEL_LEN = 256
M = 12  # drafts per step at most: vLLM stopped the whole batch within M tokens of the limit
#: Prices under which a drafting step costs far less than a plain one (overheads learnt apart can
#: say so): a budget that priced "may not draft" as zero gain sent drafts to such requests.
ADVERSE_COSTS = json.dumps(
    {"target": [0.02, 0.0005], "level": [0.001, 0.0001], "overhead": 0.05, "draft_overhead": 0.0}
)


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[Path, Path]:
    return build_pair(tmp_path_factory.mktemp("edges") / "partial", "partial", seed=0)


def batch() -> tuple[list[dict], list]:
    """Prompts and their sampling: a request whose prompt nearly fills the context, plain requests,
    and penalised ones (repetition, presence, frequency penalties), a penalised one first."""
    from vllm import SamplingParams

    rng = random.Random(3)
    lengths = [7, 230, 20, 11, 40, 5, 63, 16]
    prompts = [{"prompt_token_ids": [rng.randrange(6, 512) for _ in range(n)]} for n in lengths]
    plain = dict(temperature=0.0, ignore_eos=True)
    params = [
        SamplingParams(max_tokens=40, repetition_penalty=1.3, **plain),
        SamplingParams(max_tokens=MAX_MODEL_LEN - 230, **plain),
        SamplingParams(max_tokens=40, **plain),
        SamplingParams(max_tokens=40, presence_penalty=0.5, **plain),
        SamplingParams(max_tokens=40, **plain),
        SamplingParams(max_tokens=40, frequency_penalty=0.5, **plain),
        SamplingParams(max_tokens=40, **plain),
        SamplingParams(max_tokens=40, **plain),
    ]
    return prompts, params


PENALISED = {7, 11, 5}  # prompt lengths of the penalised requests
NEAR_LIMIT = 230


def tokens_of(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.fixture(scope="module")
def reference(pair) -> list[list[int]]:
    prompts, params = batch()
    return tokens_of(run_llm(pair[0], None, prompts, params, max_model_len=MAX_MODEL_LEN)[0])


@pytest.fixture(scope="module")
def adverse(pair) -> tuple[list[list[int]], dict, list[dict[int, tuple[int, int]]]]:
    """eagle2's default budget under adverse prices on that batch: (tokens, metrics, per step the
    drafts sent: prompt length -> (tokens so far, drafts))."""
    from vllm.v1.core.sched.scheduler import Scheduler

    steps: list[dict[int, tuple[int, int]]] = []
    stock = Scheduler.update_draft_token_ids

    def recording(self, draft_token_ids):
        row = {}
        for rid, drafts in zip(draft_token_ids.req_ids, draft_token_ids.draft_token_ids):
            request = self.requests.get(rid)
            if request is not None and not request.is_finished():
                row[request.num_prompt_tokens] = (request.num_tokens, len(drafts))
        steps.append(row)
        return stock(self, draft_token_ids)

    prompts, params = batch()
    spec = {"method": "eagle2", "model": str(pair[1]), "num_speculative_tokens": M, "depth": 4, "topk": 3}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Scheduler, "update_draft_token_ids", recording)
        mp.setenv(COSTS_ENV, ADVERSE_COSTS)
        outputs, metrics = run_llm(pair[0], spec, prompts, params, max_model_len=MAX_MODEL_LEN)
    return tokens_of(outputs), metrics, steps


def test_penalised_and_near_limit_requests_keep_the_targets_output(adverse, reference):
    tokens, metrics, _ = adverse
    assert tokens == reference
    assert metrics["vllm:spec_decode_num_drafts"] > 0 and metrics["vllm:spec_decode_num_accepted_tokens"] > 0
    assert metrics["eagle2"]["kv_moves"] > 0, metrics["eagle2"]  # branching trees, accepted off-chain


def test_a_request_that_may_not_draft_gets_none_under_prices_that_favour_drafting(adverse):
    _, metrics, steps = adverse
    assert metrics["eagle2"]["requests_without_drafts"] == len(PENALISED)
    sent = {n: sum(drafts for _, drafts in (s[n] for s in steps if n in s)) for n in (7, 11, 5, 20, 40, 63)}
    assert all(sent[n] == 0 for n in PENALISED), sent
    assert all(sent[n] > 0 for n in (20, 40, 63)), sent


def test_a_request_near_the_context_limit_stops_drafting_alone(adverse):
    _, _, steps = adverse
    near = [s for s in steps if NEAR_LIMIT in s and s[NEAR_LIMIT][0] + M > MAX_MODEL_LEN]
    assert near, "the long request never came within M tokens of max_model_len"
    # Its drafts stay inside the context; the others drafted on meanwhile (vLLM stopped them all).
    assert all(
        tokens + drafts <= MAX_MODEL_LEN
        for tokens, drafts in (s[NEAR_LIMIT] for s in steps if NEAR_LIMIT in s)
    )
    assert sum(drafts for s in near for n, (_, drafts) in s.items() if n != NEAR_LIMIT) > 0


def test_no_verified_draft_is_one_that_no_proposed_tree_holds(adverse):
    """vLLM zero-fills the drafts of a step whose drafter it skips; none may reach verification."""
    stats = adverse[1]["eagle2"]
    assert stats["drafts"] > 0 and stats["unmatched_drafts"] == 0, stats


# --- tensor parallelism -------------------------------------------------------------------------

#: One process, two engines at TP=2 on the same prompts: no speculation (eager), then eagle2 with
#: only method and model set, compiled (vLLM's default mode). Prints one JSON line.
TP2_RUN = textwrap.dedent(
    """
    import json, random, sys
    from vllm_eagle2_tools.cpu_env import configure_cpu_env
    configure_cpu_env(quiet=True)
    from vllm import LLM, SamplingParams

    def run(spec, compiled):
        llm = LLM(model=sys.argv[1], speculative_config=spec, dtype="float32", enforce_eager=not compiled,
                  max_model_len=512, max_num_seqs=16, max_num_batched_tokens=512, seed=0,
                  disable_log_stats=False, tensor_parallel_size=2, distributed_executor_backend="mp")
        rng = random.Random(0)
        lengths = [3, 120, 17, 64, 9, 33, 90, 5, 40, 12, 70, 25, 8, 50, 30, 15]
        prompts = [{"prompt_token_ids": [rng.randrange(6, 512) for _ in range(n)]} for n in lengths]
        params = SamplingParams(temperature=0.0, max_tokens=80, ignore_eos=True)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        out = {"tokens": [list(o.outputs[0].token_ids) for o in outputs]}
        out["metrics"] = {m.name: m.value for m in llm.get_metrics() if hasattr(m, "value")}
        if spec:
            out["budgets"] = llm.collective_rpc("eagle2_budget_summary")
            out["stats"] = llm.collective_rpc("eagle2_stats")
        llm.llm_engine.engine_core.shutdown()
        return out

    reference = run(None, compiled=False)
    eagle2 = run({"method": "eagle2", "model": sys.argv[2]}, compiled=True)
    print("RESULT " + json.dumps({"reference": reference, "eagle2": eagle2}))
    """
)


@pytest.fixture(scope="module")
def tp2(pair) -> dict:
    """Both TP=2 engines, one core per rank, in a child process: a rank that hangs fails the test
    at the timeout instead of stalling the suite."""
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "0|1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    env.pop(COSTS_ENV, None)  # every default, the budget's timings included
    # Its own process group: on a hang the workers go too (a hung rank left alone spins on a core).
    proc = subprocess.Popen(
        [sys.executable, "-c", TP2_RUN, str(pair[0]), str(pair[1])],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=1200)
    except subprocess.TimeoutExpired:
        stdout, stderr = "", "(killed)"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    if stderr == "(killed)":
        pytest.fail("TP=2 engines gave no result in 1200 s: a rank hung?")
    lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, stderr[-4000:]
    return json.loads(lines[-1].removeprefix("RESULT "))


def test_tp2_defaults_compiled_equal_no_speculation_at_tp2(tp2):
    assert tp2["eagle2"]["tokens"] == tp2["reference"]["tokens"]
    metrics, stats = tp2["eagle2"]["metrics"], tp2["eagle2"]["stats"]
    assert metrics["vllm:spec_decode_num_drafts"] > 0 and metrics["vllm:spec_decode_num_accepted_tokens"] > 0
    assert stats[0]["unmatched_drafts"] == 0, stats


def test_tp2_ranks_timing_apart_take_the_same_decisions(tp2):
    """Plans (shapes), head skips, drafts per step and per request, calibration: the budget's
    counters on both ranks. Only the current prices may differ (each rank learns its own clock, and
    takes rank 0's at each step's plan)."""
    ranks = tp2["eagle2"]["budgets"]
    assert len(ranks) == 2
    same = [{k: v for k, v in rank.items() if k != "prices_ms"} for rank in ranks]
    assert same[0] == same[1]
    # Decisions were taken, step by step: drafts per step varied. (Whether the head's levels pay
    # beside the lookup chains sits near break-even for tiny models, so which shapes win is the
    # machine's: asserting two shapes failed on a machine whose prices never planned the head.)
    assert len(same[0]["drafts_per_step"]) >= 2, same[0]


# --- the verifier's peak memory -----------------------------------------------------------------


def test_the_memory_profile_runs_the_verifier_at_its_widest(monkeypatch):
    """vLLM's profile of its own sampler never sees a tree step's verification: its logits gather
    [max_num_seqs, m + 1, V] and top-k / top-p (the tree rows' K/V is the cache's, kept nowhere else)."""
    from vllm_eagle2.engine import startup
    from vllm_eagle2.verify import verifier

    seen = {}
    verify = verifier.verify_tree

    def recording(tokens, parents, logits, **kwargs):
        seen.update(
            logits=tuple(logits.shape), sampled=kwargs["temperature"] is not None, top_p=kwargs["top_p"]
        )
        return verify(tokens, parents, logits, **kwargs)

    monkeypatch.setattr(verifier, "verify_tree", recording)
    runner = SimpleNamespace(
        max_num_reqs=6,
        num_spec_tokens=5,
        max_num_tokens=64,
        device=torch.device("cpu"),
        dtype=torch.float32,
    )
    startup.profile_verification(runner, vocab=100)
    assert seen["logits"] == (6, 5 + 1, 100) and seen["sampled"] and seen["top_p"] is not None
