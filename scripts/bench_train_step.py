"""Training-step throughput of the EAGLE head at SmolLM2-135M's shapes, with random weights and data.

Speed does not depend on the values, so this runs anywhere (no target, no features): it times
``batch_loss`` forward + backward + AdamW over packed batches of ``--batch-tokens`` tokens, for the
per-sequence and the packed attention, in each ``--precision`` (float32, bf16 autocast), and prints
tokens/s as JSON. Used to size a GPU session's training (epochs that fit its minutes) before the
target is even on the machine, and to see where bf16 pays (``training.precision``). With ``--target``
it also times the feature pass: the target's forward over one ``--mean-len`` sequence, in each
precision.

    python scripts/bench_train_step.py --device cuda --steps 10
    python scripts/bench_train_step.py --precision float32,bfloat16 --target models/smollm2-135m-instruct
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import LlamaConfig

from vllm_eagle2_tools.machine import cpu_description, cpu_note
from vllm_eagle2_tools.training import head as head_module
from vllm_eagle2_tools.training.head import EagleHead, head_config
from vllm_eagle2_tools.training.loss import Batch, batch_loss
from vllm_eagle2_tools.training.precision import autocast

SMOLLM2_135M = dict(
    hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
    num_hidden_layers=30, vocab_size=49152, rms_norm_eps=1e-5, rope_theta=100000.0,
    max_position_embeddings=8192,
)  # fmt: skip


def random_batch(
    tokens: int, mean_len: int, cfg: LlamaConfig, device: torch.device, frequent: int = 8192
) -> Batch:
    """Packed sequences of lengths around ``mean_len`` summing to ``tokens``, with a top-16 label.

    As in real features, 95% of the top-16 ids lie among the ``frequent`` tokens the reduced-vocabulary
    CE keeps (ids ``< frequent`` here): spread over the whole vocabulary, they would make that CE run
    over almost all of it, at several times its real cost."""
    gen = torch.Generator().manual_seed(0)
    lens: list[int] = []
    while sum(lens) < tokens:
        lens.append(
            min(tokens - sum(lens), int(torch.randint(mean_len // 2, mean_len * 3 // 2, (1,), generator=gen)))
        )
    h, v = cfg.hidden_size, cfg.vocab_size
    return Batch(
        tokens=torch.randint(0, v, (tokens,), generator=gen),
        hidden_in=torch.randn(tokens, h, generator=gen).bfloat16(),
        positions=torch.cat([torch.arange(n) for n in lens]),
        hidden_tgt=torch.randn(tokens, h, generator=gen).bfloat16(),
        weight=torch.rand(tokens, generator=gen) < 0.8,
        seq_lens=lens,
        topk_ids=torch.where(
            torch.rand(tokens, 16, generator=gen) < 0.95,
            torch.randint(0, frequent, (tokens, 16), generator=gen),
            torch.randint(0, v, (tokens, 16), generator=gen),
        ).int(),
        topk_logp=torch.randn(tokens, 16, generator=gen).log_softmax(-1),
    ).to(device)


def step(
    head: EagleHead,
    batch: Batch,
    opt: torch.optim.Optimizer,
    params: list[torch.nn.Parameter],
    vocab: torch.Tensor | None,
    depths: int,
) -> None:
    """One optimizer step, as the training loop takes it."""
    opt.zero_grad(set_to_none=True)
    batch_loss(head, batch, train=True, vocab=vocab, depths=depths)
    torch.nn.utils.clip_grad_norm_(params, 0.5)
    opt.step()


def profile_steps(run: Callable[[], None], device: torch.device, steps: int = 2) -> str:
    """torch.profiler's table of the ops that took the most time over ``steps`` calls of ``run``."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            run()
        if device.type == "cuda":
            torch.cuda.synchronize()
    key = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
    return prof.key_averages().table(sort_by=key, row_limit=20)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batch-tokens", type=int, default=4096)
    p.add_argument("--mean-len", type=int, default=450, help="mean packed sequence length")
    p.add_argument("--depths", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--vocab-subset", type=int, default=8192, help="0: CE over the whole vocabulary")
    p.add_argument("--profile", action="store_true", help="also print torch.profiler's top ops per variant")
    p.add_argument("--precision", default="float32", help="comma list of float32, bfloat16")
    p.add_argument("--attention", default="per_sequence_attention,packed_attention", help="comma list")
    p.add_argument("--target", type=Path, default=None, help="also time this target's feature pass")
    args = p.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    target = LlamaConfig(**SMOLLM2_135M)
    cfg = head_config(target)
    gen = torch.Generator().manual_seed(1)
    embed = torch.randn(target.vocab_size, target.hidden_size, generator=gen) * 0.02
    head = EagleHead(cfg, embed.bfloat16(), embed).to(device)
    params = [q for q in head.parameters() if q.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4)
    batch = random_batch(args.batch_tokens, args.mean_len, cfg, device, args.vocab_subset or cfg.vocab_size)
    vocab = torch.arange(args.vocab_subset, device=device) if args.vocab_subset else None
    report = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    cpu = cpu_note(cpu_description()).strip(" ()")
    report["machine"] = torch.cuda.get_device_name() if device.type == "cuda" else cpu
    for precision, name in itertools.product(args.precision.split(","), args.attention.split(",")):
        attend = getattr(head_module, name)
        original = head_module.packed_attention, head_module.per_sequence_attention
        # both names point at the variant under test, whatever the device picks
        head_module.packed_attention = head_module.per_sequence_attention = attend
        try:
            for i in range(args.steps + 2):
                if i == 2:  # two warm-up steps
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                    t0 = time.perf_counter()
                with autocast(precision, device.type):
                    step(head, batch, opt, params, vocab, args.depths)
            if device.type == "cuda":
                torch.cuda.synchronize()
            report[f"{name}_{precision}_tok_s"] = round(
                args.steps * args.batch_tokens / (time.perf_counter() - t0)
            )
            if args.profile:
                print(f"== {name}, {precision}: 2 steps ==", file=sys.stderr)
                print(
                    profile_steps(lambda: step(head, batch, opt, params, vocab, args.depths), device),
                    file=sys.stderr,
                )
        finally:
            head_module.packed_attention, head_module.per_sequence_attention = original
    if args.target is not None:
        for precision in args.precision.split(","):
            report[f"features_{precision}_tok_s"] = feature_pass_speed(
                args.target, precision, args.mean_len, device
            )
    print(json.dumps(report))


def feature_pass_speed(
    target: Path, precision: str, tokens: int, device: torch.device, repeats: int = 3
) -> int:
    """Tokens/s of feature extraction's work on one sequence of ``tokens`` tokens: the target's forward
    (transformers, weights in ``precision``) and its top-K log-probs, as ``features.shard_tensors``."""
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM

    from vllm_eagle2_tools.training.conversations import Sequences
    from vllm_eagle2_tools.training.features import TARGET_TOPK, shard_tensors

    model = AutoModelForCausalLM.from_pretrained(str(target), dtype=getattr(torch, precision))
    model = model.to(device).eval()
    lm_head = model.get_output_embeddings().weight.detach().to(torch.bfloat16)
    ids = torch.randint(0, model.config.vocab_size, (tokens,), generator=torch.Generator().manual_seed(0))
    seqs = Sequences([ids.tolist()], [[True] * tokens], ["bench"])
    bar = tqdm(disable=True)
    for i in range(repeats + 1):
        if i == 1:  # one warm-up
            t0 = time.perf_counter()
        shard_tensors(model.model, lm_head, seqs, [0], 1, (), TARGET_TOPK, bar)
    return round(repeats * tokens / (time.perf_counter() - t0))


if __name__ == "__main__":
    main()
