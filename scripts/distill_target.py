"""Self-distillation data for the head trainer: the target's own replies, generated with vLLM.

An EAGLE head has to predict the *target's* next token. Human-written replies (ShareGPT) are a
different distribution from what the target writes at inference time; the target's own replies to the
same prompts match it exactly, and are far more predictable. This script takes the first user turn of
ShareGPT conversations (or MT-bench's 80 first-turn questions), renders them with the target's chat
template, generates the target's reply with vLLM (no speculation, large batch) and writes one JSON
line per conversation::

    {"id": "<ShareGPT id or mtbench-<question_id>>", "messages": [{"role": "user", ...},
                                                                  {"role": "assistant", ...}]}

``scripts/train_eagle_head.py --distilled FILE`` trains on such files; ``--eval-distilled FILE``
holds one out for evaluation (e.g. the MT-bench answers, the benchmark's own distribution).

ShareGPT conversations are taken in a seeded shuffled order after skipping ``--skip`` of them, so
several invocations with different ``--skip`` produce disjoint files. The trainer drops distilled
conversations whose id is in its held-out ShareGPT set.

Replies are appended to ``--output`` every ``--chunk`` prompts; a cut run resumes where it stopped.

Example (SmolLM2-135M, bf16, 2 CPU cores: measured 670 generated tokens/s for the 80 MT-bench
answers at batch 80, about 400-500 tokens/s for ShareGPT prompts at batch 128)::

    .venv/bin/python scripts/distill_target.py --source sharegpt --num-prompts 2000 \\
        --output scratch/distill/sharegpt-0.jsonl
    .venv/bin/python scripts/distill_target.py --source mtbench --output scratch/distill/mtbench.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from vllm_eagle2_tools.cpu_env import configure_cpu_env
from vllm_eagle2_tools.datasets import mtbench_questions, sharegpt_first_turns
from vllm_eagle2_tools.progress import stderr_log
from vllm_eagle2_tools.smollm2 import DEFAULT_TARGET

log = stderr_log("distill_target")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", type=Path, default=DEFAULT_TARGET, help="HF target folder")
    p.add_argument("--source", choices=["sharegpt", "mtbench"], default="sharegpt")
    p.add_argument("--num-prompts", type=int, default=1000, help="ShareGPT prompts (mtbench: all 80)")
    p.add_argument("--skip", type=int, default=0, help="ShareGPT prompts to skip in the seeded order")
    p.add_argument("--max-prompt-tokens", type=int, default=512, help="longer prompts are left out")
    p.add_argument("--max-tokens", type=int, default=512, help="reply length cap")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = the target's greedy replies")
    p.add_argument("--batch-size", type=int, default=128, help="vLLM max_num_seqs")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--kv-cache-gib", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--chunk", type=int, default=256, help="prompts per generate call, written when done")
    p.add_argument("--output", type=Path, required=True, help="JSONL file to write (resumed if it exists)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Generate and write the replies; returns the exit status."""
    args = parse_args(argv)
    import os

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(args.kv_cache_gib))
    configure_cpu_env(quiet=True)
    target = args.target.resolve()
    if not (target / "config.json").exists():
        raise SystemExit(f"error: no config.json in {target} (run scripts/prepare_smollm2.py first)")
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    tok = AutoTokenizer.from_pretrained(str(target))
    if args.source == "mtbench":
        prompts = mtbench_questions()
    else:
        prompts = sharegpt_first_turns(args.seed)[args.skip : args.skip + args.num_prompts]
    rendered: list[tuple[str, str, list[int]]] = []
    for name, text in prompts:
        chat = tok.apply_chat_template(
            [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
        )
        ids = tok(chat, add_special_tokens=False)["input_ids"]
        if len(ids) <= args.max_prompt_tokens:
            rendered.append((name, text, ids))
    log(f"{len(rendered)} of {len(prompts)} prompts fit in {args.max_prompt_tokens} tokens")
    done = set()
    if args.output.exists():  # resume: the replies already written stay, the rest is generated
        lines = args.output.read_text(encoding="utf-8").splitlines()
        done = {json.loads(x)["id"] for x in lines if x.strip()}
        rendered = [r for r in rendered if r[0] not in done]
        log(f"{len(done)} replies already in {args.output}; {len(rendered)} to go")
    if not rendered:
        return 0

    llm = LLM(
        model=str(target),
        dtype=args.dtype,
        enforce_eager=True,
        max_model_len=args.max_prompt_tokens + args.max_tokens,
        max_num_seqs=args.batch_size,
        seed=args.seed,
    )
    params = SamplingParams(
        temperature=args.temperature,
        max_tokens=args.max_tokens,
        seed=args.seed if args.temperature > 0 else None,
    )
    t0 = time.perf_counter()
    generated = 0
    args.output.parent.mkdir(parents=True, exist_ok=True)
    for start in range(0, len(rendered), args.chunk):
        part = rendered[start : start + args.chunk]
        outputs = llm.generate([{"prompt_token_ids": ids} for _, _, ids in part], params, use_tqdm=True)
        generated += sum(len(o.outputs[0].token_ids) for o in outputs)
        with args.output.open("a", encoding="utf-8") as fh:  # whole lines per chunk: a cut run resumes
            for (name, text, _), out in zip(part, outputs):
                messages: list[dict[str, Any]] = [
                    {"role": "user", "content": text},
                    {"role": "assistant", "content": out.outputs[0].text},
                ]
                fh.write(json.dumps({"id": name, "messages": messages}) + "\n")
        seconds = time.perf_counter() - t0
        rate = generated / seconds
        log(f"{start + len(part)}/{len(rendered)} replies, {generated} tokens ({rate:.0f} tok/s)")
    log(f"-> {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
