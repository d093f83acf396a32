"""Step-time profiling of an in-process engine: timers wrapped around the runner and drafter.

The library half of ``scripts/profile_step.py`` (its docstring says what each part measures):
:class:`Timers` wraps methods from outside (nothing of the plugin changes), :func:`install_timers`
puts them on the hot functions, :func:`breakdown` turns the seconds into milliseconds per engine
step, :func:`run` times one engine, :func:`markdown` writes the table and :func:`profile` runs no
speculation and one eagle2 tree side by side and writes ``--output`` (JSON) and its ``.md``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from vllm_eagle2_tools.bench.config import NEVER_COSTS, vocab_label
from vllm_eagle2_tools.datasets import load_prompts
from vllm_eagle2_tools.engine import build_llm, prepare_env, shutdown_llm, warm_up
from vllm_eagle2_tools.machine import cpu_description, cpu_note
from vllm_eagle2_tools.progress import stderr_log

log = stderr_log("profile_step")


PARTS = (
    "target forward",
    "tree masks / positions",
    "verification",
    "KV moves",
    "draft: catch-up pass",
    "draft: expansion passes",
    "draft: tree build",
    "other (sampler, bookkeeping)",
    "engine overhead",
)


class Timers:
    """Accumulated seconds and call counts per name; ``wrap`` patches a method or function."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._sync: Callable[[], None] = lambda: None
        import torch

        if torch.cuda.is_available():
            self._sync = torch.cuda.synchronize

    def wrap(self, owner: Any, attr: str, name: str | Callable[..., str]) -> None:
        """Replace ``owner.attr`` with a timed twin; ``name`` may be computed from the call's kwargs."""
        fn = getattr(owner, attr)

        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            key = name(**kwargs) if callable(name) else name
            self._sync()
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._sync()
                self.seconds[key] += time.perf_counter() - t0
                self.calls[key] += 1

        setattr(owner, attr, timed)

    def reset(self) -> None:
        self.seconds.clear()
        self.calls.clear()


def install_timers() -> Timers:
    """Wrap the runner's and eagle2's hot functions (after the plugin patched vLLM)."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    import vllm_eagle2.engine.expansion as expansion
    import vllm_eagle2.engine.proposer as proposer
    import vllm_eagle2.engine.verification as tree_runner
    from vllm_eagle2 import patches
    from vllm_eagle2.engine.head_vocab import HeadVocabulary

    patches.apply()
    t = Timers()
    t.wrap(GPUModelRunner, "execute_model", "execute_model")
    t.wrap(GPUModelRunner, "sample_tokens", "sample_tokens")
    t.wrap(tree_runner, "prepare_tree_verification", "tree masks / positions")
    t.wrap(tree_runner, "sample_with_trees", "verification+kv")
    t.wrap(tree_runner, "_move_accepted_path", "KV moves")
    t.wrap(proposer, "build_dynamic_tree", "tree build+expansion")
    t.wrap(expansion.TreeExpander, "__call__", "draft: expansion passes")
    t.wrap(
        proposer.Eagle2Proposer,
        "_run_head",
        lambda first_pass=False, **_: "head forward (catch-up)" if first_pass else "head forward (expansion)",
    )
    t.wrap(proposer.Eagle2Proposer, "propose", "propose")
    t.wrap(HeadVocabulary, "logits", "draft lm_head")
    return t


def breakdown(t: Timers, wall: float) -> dict[str, Any]:
    """Milliseconds per engine step for each part of :data:`PARTS` (see the module docstring)."""
    s = t.seconds
    steps = max(t.calls["execute_model"], 1)
    expansion = s["draft: expansion passes"]
    catch_up = s["propose"] - s["tree build+expansion"]
    parts = {
        "target forward": s["execute_model"] - s["tree masks / positions"],
        "tree masks / positions": s["tree masks / positions"],
        "verification": s["verification+kv"] - s["KV moves"],
        "KV moves": s["KV moves"],
        "draft: catch-up pass": catch_up,
        "draft: expansion passes": expansion,
        "draft: tree build": s["tree build+expansion"] - expansion,
        "other (sampler, bookkeeping)": s["sample_tokens"] - s["verification+kv"] - s["propose"],
    }
    parts["engine overhead"] = wall - s["execute_model"] - s["sample_tokens"]
    return {
        "steps": steps,
        "wall_seconds": round(wall, 3),
        "ms_per_step": {k: round(1000 * v / steps, 3) for k, v in parts.items()},
        "share": {k: round(v / wall, 4) for k, v in parts.items()},
        "head_forward_ms_per_step": {
            k: round(1000 * s[k] / steps, 3)
            for k in ("head forward (catch-up)", "head forward (expansion)", "draft lm_head")
        },
    }


def run(
    label: str,
    spec: dict[str, Any] | None,
    args: argparse.Namespace,
    prompts: list[Any],
    timers: Timers,
    env: dict[str, str] | None = None,
) -> dict:
    """One engine: warm up, time ``generate`` with ``timers`` on, return the breakdown."""
    from vllm import SamplingParams

    llm = build_llm(
        args.model,
        spec,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        max_num_seqs=args.batch_size,
        env=env,
        eager=True,  # a breakdown of the step's host time, comparable with the earlier sittings
    )
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=args.tiny)
    warm_up(llm, prompts)
    timers.reset()
    t0 = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    out = breakdown(timers, wall)
    out.update(label=label, spec=spec, tokens=tokens, tokens_per_s=round(tokens / wall, 2))
    out["tokens_per_step"] = round(tokens / out["steps"], 3)  # all requests of the batch together
    if spec is not None:  # what the drafter did: drafts, catch-up rows run and dropped, the budget's
        out["eagle2_stats"] = llm.collective_rpc("eagle2_stats")[0]
    shutdown_llm(llm)
    del llm
    log(f"{label}: {tokens} tokens in {wall:.1f} s, {out['steps']} steps")
    return out


def markdown(rows: list[dict[str, Any]]) -> str:
    """Table: one column per run, one row per part (ms per step and share of the wall time)."""
    head = "| part | " + " | ".join(r["label"] for r in rows) + " |"
    lines = [head, "|---|" + "---|" * len(rows)]
    for part in PARTS:
        cells = []
        for r in rows:
            ms = r["ms_per_step"].get(part, 0.0)
            cells.append(f"{ms:.2f} ms ({100 * r['share'].get(part, 0.0):.0f}%)" if abs(ms) >= 0.005 else "-")
        lines.append(f"| {part} | " + " | ".join(cells) + " |")
    for key in rows[-1]["head_forward_ms_per_step"]:
        cells = [f"{r['head_forward_ms_per_step'][key]:.2f} ms" if r["spec"] else "-" for r in rows]
        lines.append(f"| of the draft parts: {key} | " + " | ".join(cells) + " |")
    lines.append(
        "| **step (wall / steps)** | "
        + " | ".join(f"**{1000 * r['wall_seconds'] / r['steps']:.2f} ms**" for r in rows)
        + " |"
    )
    lines.append("| tokens per step | " + " | ".join(f"{r['tokens_per_step']:.2f}" for r in rows) + " |")
    lines.append("| output tokens/s | " + " | ".join(f"{r['tokens_per_s']:.1f}" for r in rows) + " |")
    return "\n".join(lines)


def profile(args: argparse.Namespace) -> str:
    """Profile no speculation and eagle2 (``args`` as parsed by ``scripts/profile_step.py``).

    Writes ``args.output`` (JSON) and the Markdown beside it; returns the Markdown text.
    """
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the runner must live in this process
    prepare_env(quiet=True)
    if args.tiny:
        from vllm_eagle2_tools.cpu_env import SCRATCH
        from vllm_eagle2_tools.testing import build_pair

        args.model, args.head = build_pair(SCRATCH / "profile-tiny", "partial", seed=0)
        args.dtype = "float32"
    args.model, args.head = Path(args.model).resolve(), Path(args.head).resolve()
    timers = install_timers()
    if args.tiny:
        # The tiny pair has its own 512-token vocabulary: seeded token ids, no dataset package needed.
        rng = random.Random(0)
        prompts = [
            {"prompt_token_ids": [rng.randrange(6, 512) for _ in range(24)]} for _ in range(args.num_prompts)
        ]
        args.dataset = "random ids"
    else:
        prompts = load_prompts(args.dataset, args.model, args.num_prompts, chat=True)
    m, d, k = args.num_speculative_tokens, args.depth, args.topk
    spec = {
        "method": "eagle2",
        "model": str(args.head),
        "num_speculative_tokens": m,
        "depth": d,
        "topk": k,
        "tree": args.tree,
        "draft_vocab_size": args.draft_vocab,
        "budget": "fixed",  # this tree every step: the measurement needs it
    }
    label = f"eagle2 {args.tree} m={m} d={d} k={k}" + vocab_label(args.draft_vocab)
    env = None
    if args.never:
        # the adaptive budget under costs where no draft pays: what a step without drafts costs
        from vllm_eagle2.budget.costs import COSTS_ENV

        spec["budget"], label, env = "adaptive", "eagle2 never drafting", {COSTS_ENV: NEVER_COSTS}
    elif args.adaptive:
        # the adaptive budget on measured costs, as served: these sizes are its upper bounds
        spec["budget"], label = "adaptive", f"{label} adaptive"
    rows = [run("no speculation", None, args, prompts, timers), run(label, spec, args, prompts, timers, env)]
    cpu = cpu_description()
    text = (
        f"Step-time breakdown: {args.model.name} + {args.head.name}, {args.dataset}, {len(prompts)} prompts, "
        f"max {args.max_tokens} tokens, batch {args.batch_size}, {args.dtype}, temperature 0, "
        f"{os.cpu_count()} CPUs{cpu_note(cpu)}; ms per engine step (share of generate's wall time)."
        f"\n\n{markdown(rows)}\n"
    )
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(
        json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "cpu": cpu, "runs": rows}, indent=1)
    )
    args.output.with_suffix(".md").write_text(text)
    return text
