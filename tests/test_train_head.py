"""The head trainer's core (vllm_eagle2_tools.training) on a tiny seeded target, no engine start.

Synthetic token sequences run through a tiny "partial" target; features go to shards; a few steps of
training must lower the loss; the exported head must be in vLLM's eagle format (config accepted by
vLLM's config loader and ``EAGLEConfig``, exact key set and shapes, no ``embed_tokens``) and compute
the same function as the plain-torch twin of vLLM's head (``EagleHeadReference``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from vllm_eagle2.head_files import default_aux_layers
from vllm_eagle2_tools import datasets
from vllm_eagle2_tools import head_scaling as scaling
from vllm_eagle2_tools.testing import EagleHeadReference, build_target
from vllm_eagle2_tools.training.cli import main, parse_args
from vllm_eagle2_tools.training.conversations import Sequences, load_distilled, render_conversation
from vllm_eagle2_tools.training.eagle3_head import (
    build_eagle3_head,
    eagle3_aux_layers,
    load_eagle3_weights,
    select_draft_vocab,
)
from vllm_eagle2_tools.training.features import TARGET_TOPK, frequent_vocab, write_feature_shards
from vllm_eagle2_tools.training.head import (
    build_head,
    export_head,
    load_head_weights,
    packed_attention,
    per_sequence_attention,
)
from vllm_eagle2_tools.training.loop import ShardReader, TrainConfig, epoch_plan, evaluate, train
from vllm_eagle2_tools.training.loss import batch_loss, subset_vocab_loss, vocab_loss
from vllm_eagle2_tools.training.precision import choose_precision


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Tiny target, synthetic sequences, feature shards."""
    from transformers import LlamaForCausalLM

    root = tmp_path_factory.mktemp("train_head")
    target = build_target(root / "target", kind="partial", seed=0)
    gen = torch.Generator().manual_seed(0)
    seqs = Sequences()
    for i in range(8):
        n = 40 + 4 * i
        seqs.ids.append(torch.randint(6, 512, (n,), generator=gen).tolist())
        seqs.masks.append([j >= 5 for j in range(n)])  # a "prompt" of 5 tokens, then the "reply"
        seqs.names.append(f"synthetic-{i}")
    model = LlamaForCausalLM.from_pretrained(str(target), dtype=torch.float32).eval()
    fdir = root / "features"
    shards = write_feature_shards(model, seqs, fdir, "train", shard_tokens=150)
    return {"root": root, "target": target, "fdir": fdir, "shards": shards, "seqs": seqs, "model": model}


def test_feature_shards(setup: dict) -> None:
    """Shards hold every token, the post-final-norm hidden state, the mask and the offsets."""
    from safetensors.torch import load_file

    seqs, shards = setup["seqs"], setup["shards"]
    assert len(shards) > 1
    assert sum(len(s["lengths"]) for s in shards) == len(seqs.ids)
    data = load_file(str(setup["fdir"] / shards[0]["file"]))
    n0 = shards[0]["lengths"][0]
    assert data["hidden"].dtype == torch.bfloat16 and data["hidden"].shape[1] == 128
    assert data["tokens"][:n0].tolist() == seqs.ids[0]
    assert data["mask"][:n0].tolist() == seqs.masks[0]
    with torch.no_grad():
        ref = setup["model"].model(input_ids=torch.tensor(seqs.ids[0])[None]).last_hidden_state[0]
    torch.testing.assert_close(data["hidden"][:n0].float(), ref, atol=0.05, rtol=0.02)
    # The target's top-K next-token log-probs, most likely first, from the stored bf16 hidden state.
    lm_head = setup["model"].lm_head.weight.detach().to(torch.bfloat16)
    logp = torch.log_softmax((data["hidden"][:n0] @ lm_head.T).float(), -1)
    k = TARGET_TOPK
    assert data["topk_ids"].shape == (data["tokens"].numel(), k)
    # (ids compared through their log-probs: a bf16 matmul of another shape may order near-ties apart)
    stored = logp.gather(-1, data["topk_ids"][:n0].long())
    torch.testing.assert_close(stored, logp.topk(k, -1).values, atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(data["topk_logp"][:n0], stored, atol=2e-2, rtol=1e-2)


def test_a_grown_data_set_links_the_shards_it_shares_instead_of_extracting_them(
    setup: dict, tmp_path: Path
) -> None:
    """Appending sequences keeps the earlier full shards: they come from the content store, not the target."""
    seqs, model = setup["seqs"], setup["model"]
    first = Sequences(ids=seqs.ids[:5], masks=seqs.masks[:5], names=seqs.names[:5])
    store = tmp_path / "by-content"

    def extract(data: object, out: str, identity: bytes) -> list[dict]:
        return write_feature_shards(model, data, tmp_path / out, "train", 150, store=store, identity=identity)

    extract(first, "a", b"t")
    calls: list[int] = []
    hook = model.model.register_forward_hook(lambda *_: calls.append(1))
    try:
        grown = extract(seqs, "b", b"t")
        assert len(calls) == 3  # sequences 5-7; shards [0-2] and [3, 4] were linked
        extract(seqs, "c", b"u")
        assert len(calls) == 3 + len(seqs.ids)  # another target's features are never reused
    finally:
        hook.remove()
    assert grown == setup["shards"]
    for k in (0, 1):
        name = f"train-{k:05d}.safetensors"
        assert (tmp_path / "a" / name).stat().st_ino == (tmp_path / "b" / name).stat().st_ino
    assert len(list(store.iterdir())) == len(grown) + len(setup["shards"])


def test_subset_loss_equals_full_loss_over_the_whole_vocabulary(setup: dict) -> None:
    """With every token in the subset and in the soft label, the reduced CE is the full CE, gradient too."""
    head = build_head(setup["target"], init="target", seed=0)
    gen = torch.Generator().manual_seed(3)
    out = torch.randn(12, 128, generator=gen)
    tgt = torch.randn(12, 128, generator=gen).to(torch.bfloat16)
    lm_head = head.lm_head_weight
    logp = torch.log_softmax((tgt @ lm_head.T).float(), -1)
    vals, ids = logp.topk(lm_head.shape[0], -1)
    full = vocab_loss(out, tgt, lm_head, want_grad=True)
    sub = subset_vocab_loss(out, ids.int(), vals, lm_head, torch.arange(512), want_grad=True)
    assert sub[0] == pytest.approx(full[0], rel=1e-4)
    torch.testing.assert_close(sub[1], full[1], atol=1e-4, rtol=1e-3)
    assert sub[2:] == full[2:]


def test_frequent_vocabulary_holds_the_targets_top_predictions(setup: dict) -> None:
    """The reduced vocabulary is sorted, of the asked size, and led by the target's own top-1 tokens."""
    from safetensors.torch import load_file

    vocab = frequent_vocab(setup["fdir"], setup["shards"], 64, 512)
    assert vocab.numel() == 64 and torch.equal(vocab, vocab.sort().values)
    top1 = torch.cat([load_file(str(setup["fdir"] / s["file"]))["topk_ids"][:, 0] for s in setup["shards"]])
    common = torch.bincount(top1.long(), minlength=512).argmax()
    assert common in vocab


def test_loss_decreases_and_export(setup: dict, tmp_path: Path) -> None:
    """Two short epochs lower the loss; the exported head is in vLLM's format and matches the reference."""
    from safetensors.torch import load_file

    target, fdir, shards = setup["target"], setup["fdir"], setup["shards"]
    head = build_head(target, init="target", seed=0)
    before = evaluate(head, fdir, shards, batch_tokens=128)
    # The reduced-vocabulary CE (a third of the tiny vocabulary) still trains the head.
    # Depth 2 trains on the head's own features too.
    cfg = TrainConfig(
        epochs=2, lr=3e-3, batch_tokens=128, seed=0, warmup_ratio=0.0, vocab_subset=160, depths=2
    )
    ckpt = tmp_path / "ckpt.pt"
    history = train(head, fdir, shards, shards, cfg, checkpoint=ckpt, progress=False)
    after = history["eval"][-1]
    assert len(history["steps"]) == history["total_steps"] >= 4
    assert after["loss"] < 0.9 * before["loss"], (before, after)
    assert after["top1_depth2"] > before["top1_depth2"], (before, after)
    assert 0 <= after["top1_depth3"] <= 1
    assert ckpt.exists()

    # Resuming a finished run changes nothing and does not fail.
    head2 = build_head(target, init="target", seed=0)
    h2 = train(head2, fdir, shards, None, cfg, checkpoint=ckpt, resume=True, progress=False)
    assert h2["completed_epochs"] == 2
    for (k, a), b in zip(head.state_dict().items(), head2.state_dict().values()):
        assert torch.equal(a, b), k

    out = export_head(head, tmp_path / "head", dtype=torch.float32)
    sd = load_file(str(out / "model.safetensors"))
    head3 = build_head(target, init="random", seed=1)
    load_head_weights(head3, out)  # --init-from
    for (k, a), b in zip(head.state_dict().items(), head3.state_dict().values()):
        assert torch.equal(a, b), k
    h, inter = 128, 256
    kv = 2 * (h // 4)
    expected = {
        "fc.weight": (h, 2 * h),
        "layers.0.self_attn.q_proj.weight": (h, h),
        "layers.0.self_attn.k_proj.weight": (kv, h),
        "layers.0.self_attn.v_proj.weight": (kv, h),
        "layers.0.self_attn.o_proj.weight": (h, h),
        "layers.0.post_attention_layernorm.weight": (h,),
        "layers.0.mlp.gate_proj.weight": (inter, h),
        "layers.0.mlp.up_proj.weight": (inter, h),
        "layers.0.mlp.down_proj.weight": (h, inter),
    }
    assert {k: tuple(v.shape) for k, v in sd.items()} == expected

    raw = json.loads((out / "config.json").read_text())
    assert raw["num_hidden_layers"] == 1 and raw["architectures"] == ["LlamaForCausalLM"]
    from vllm.transformers_utils.config import get_config
    from vllm.transformers_utils.configs.eagle import EAGLEConfig

    hf = get_config(str(out), trust_remote_code=False)
    eagle = EAGLEConfig(hf, method="eagle", model_type="eagle")
    assert eagle.architectures == ["EagleLlamaForCausalLM"]
    assert eagle.model.hidden_size == h and eagle.model.num_hidden_layers == 1
    assert eagle.model.vocab_size == 512

    # Same function as the plain-torch twin of vLLM's head (embedding shared from the target).
    ref = EagleHeadReference.load(out, target)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(6, 512, (20,), generator=gen)
    hidden = torch.randn(20, h, generator=gen)
    pos = torch.arange(20)
    with torch.no_grad():
        mine = head(tokens, hidden, pos, [20])
    torch.testing.assert_close(mine, ref.forward(tokens, hidden, pos), atol=1e-4, rtol=1e-4)


def test_regression_only_warm_up_trains_its_steps_without_the_ce_then_with_it(setup: dict) -> None:
    """--reg-only-ratio 0.5: the first half of the steps are those of CE weight 0, the rest add the CE."""

    def run(**kw: float) -> tuple[list[float], dict]:
        head = build_head(setup["target"], init="target", seed=0)
        cfg = TrainConfig(epochs=1, lr=3e-3, batch_tokens=64, seed=0, warmup_ratio=0.0, **kw)
        history = train(head, setup["fdir"], setup["shards"], None, cfg, progress=False)
        # the gradient's norm is logged before clipping, so it sees whether the CE was in the loss
        return [s["grad_norm"] for s in history["steps"]], head.state_dict()

    warm, warm_sd = run(ce_weight=0.1, reg_only_ratio=0.5)
    reg, _ = run(ce_weight=0.0)
    full, full_sd = run(ce_weight=0.1)
    k = len(warm) // 2
    assert k >= 2
    assert warm[:k] == reg[:k]  # the same weights, the same regression-only gradients
    assert warm[k] != reg[k]  # the CE joins at step k + 1
    assert warm[0] != full[0]
    assert any(not torch.equal(warm_sd[n], full_sd[n]) for n in warm_sd)
    with pytest.raises(SystemExit):  # argparse: "argument --reg-only-ratio: 1.5 not in [0, 1]"
        parse_args(["--reg-only-ratio", "1.5"])


def _resume_config(**kw: object) -> TrainConfig:
    """Two epochs of the tiny set with every source of run-to-run change in play: noise on the input
    features (torch's RNG), a warm-up and a cosine schedule, AdamW's moments, depths 1-2."""
    base = dict(epochs=2, lr=3e-3, batch_tokens=128, seed=0, warmup_ratio=0.2, min_lr_ratio=0.1)
    return TrainConfig(**{**base, "feature_noise": 0.05, "depths": 2, "vocab_subset": 160, **kw})


def _assert_same_run(history: dict, reference: dict, head: torch.nn.Module, ref: torch.nn.Module) -> None:
    """The loss of every step and every final weight equal those of the reference run."""
    assert [s["loss"] for s in history["steps"]] == [s["loss"] for s in reference["steps"]]
    for (name, a), b in zip(ref.state_dict().items(), head.state_dict().values()):
        assert torch.equal(a, b), name


def test_a_run_stopped_anywhere_and_resumed_equals_the_uninterrupted_run(setup: dict, tmp_path: Path) -> None:
    """Stopped after 3 steps (mid-epoch) and after 5 (the second epoch), each time resumed by a new head
    from the checkpoint alone: the final weights and the loss of every step are those of one run."""
    target, fdir, shards = setup["target"], setup["fdir"], setup["shards"]
    vocab = frequent_vocab(fdir, shards, 160, 512)
    whole = build_head(target, init="target", seed=0)
    reference = train(whole, fdir, shards, None, _resume_config(), progress=False, vocab=vocab)
    assert reference["total_steps"] > 5

    ckpt = tmp_path / "ckpt.pt"
    for stop in (3, 5, None):
        first = stop == 3  # a resumed run's head starts as anything: the checkpoint decides
        head = build_head(target, init="target" if first else "random", seed=0 if first else 7)
        history = train(
            head, fdir, shards, None, _resume_config(max_steps=stop), checkpoint=ckpt,
            resume=not first, progress=False, vocab=vocab,
        )  # fmt: skip
        assert len(history["steps"]) == (stop or reference["total_steps"])
    _assert_same_run(history, reference, head, whole)


def test_streamed_features_are_made_when_reached_and_a_resumed_run_remakes_only_its_chunk(
    setup: dict, tmp_path: Path
) -> None:
    """Streamed, the shards are extracted as the epoch plan reaches them and deleted behind it; training on
    them equals training on the bulk shards; after the machine is lost (every file gone), the resumed
    run extracts first the shard it stopped in, and gives the same head."""
    from vllm_eagle2_tools.training.streaming import StreamedShards

    target, fdir, shards, seqs, model = (setup[k] for k in ("target", "fdir", "shards", "seqs", "model"))
    vocab = frequent_vocab(fdir, shards, 160, 512)
    bulk = build_head(target, init="target", seed=0)
    reference = train(bulk, fdir, shards, None, _resume_config(epochs=1), progress=False, vocab=vocab)

    def streamed(sdir: Path) -> StreamedShards:
        return StreamedShards(target, seqs, sdir, "train", 150, torch.float32, model=model)

    source = streamed(tmp_path / "a")
    assert source.shards == shards  # the same split, known before any feature exists
    head = build_head(target, init="target", seed=0)
    stop = 2
    train(head, source.fdir, source.shards, None, _resume_config(epochs=1, max_steps=stop),
          checkpoint=tmp_path / "ckpt.pt", progress=False, source=source, vocab=vocab)  # fmt: skip
    plan = epoch_plan(shards, 128, seed=0, epoch=0)
    reached = list(dict.fromkeys(k for k, _ in plan[:stop]))
    assert source.extracted == reached
    assert sorted(p.name for p in source.fdir.iterdir()) == [shards[reached[-1]]["file"]]  # the rest deleted

    lost = streamed(tmp_path / "b")  # a fresh machine: no feature files
    head = build_head(target, init="random", seed=7)
    ckpt = tmp_path / "ckpt.pt"
    history = train(head, lost.fdir, lost.shards, None, _resume_config(epochs=1), checkpoint=ckpt,
                    resume=True, progress=False, source=lost, vocab=vocab)  # fmt: skip
    assert lost.extracted == list(dict.fromkeys(k for k, _ in plan[stop:]))  # from the chunk it stopped in on
    _assert_same_run(history, reference, head, bulk)


def test_the_command_line_streams_features_in_bf16_into_a_checkpoint_it_names(
    setup: dict, tmp_path: Path
) -> None:
    """train_eagle_head.py --stream-features --precision bfloat16 --checkpoint FILE on committed-style
    replies: the held-out set is extracted up front, the training chunks as they are reached (one left
    on disk), the run says what it chose, and --resume from the named checkpoint finds the run done."""
    from vllm_eagle2_tools.training import replies

    gen = torch.Generator().manual_seed(3)

    def ids(n: int) -> list[list[int]]:
        return [torch.randint(6, 512, (int(k),), generator=gen).tolist() for k in torch.randint(8, 30, (n,))]

    data = tmp_path / "replies"
    data.mkdir()
    for name, n in (("sharegpt", 16), ("mtbench", 4)):
        replies.add_prompt_set(data, name, [f"{name}{i}" for i in range(n)], ids(n), {"order": "test"})
        replies.add_slice(data, name, 0, 0, [r + [2] for r in ids(n)], {})
    ckpt, out, features = tmp_path / "state" / "ckpt.pt", tmp_path / "head", tmp_path / "features"
    argv = ["--target", str(setup["target"]), "--replies", str(data), "--eval-replies", "mtbench"]
    argv += ["--num-conversations", "0", "--eval-conversations", "0", "--epochs", "1", "--batch-tokens", "64"]
    argv += ["--shard-tokens", "150", "--vocab-subset", "100", "--feature-dir", str(features)]
    argv += ["--output", str(out)]
    argv += ["--stream-features", "--precision", "bfloat16", "--checkpoint", str(ckpt)]
    assert main(argv) == 0

    record = json.loads((out / "training.json").read_text())
    assert record["precision"]["training"] == record["precision"]["features"] == "bfloat16"
    assert record["complete"] and record["steps_done"] == record["total_steps"] > 2
    assert ckpt.exists() and (out / "model.safetensors").exists()
    (fdir,) = [d for d in features.iterdir() if d.name != "by-content"]
    train_files = sorted(p.name for p in fdir.glob("train-*.safetensors"))
    eval_files = sorted(p.name for p in fdir.glob("eval-*.safetensors"))
    manifest = json.loads((fdir / "manifest.json").read_text())
    assert len(manifest["splits"]["train"]["shards"]) > 1 and len(train_files) == 1  # the others deleted
    assert eval_files  # the held-out set, extracted up front
    assert main([*argv, "--resume"]) == 0
    assert json.loads((out / "training.json").read_text())["steps_done"] == record["steps_done"]
    # on a new machine (no --output left) the record kept beside the checkpoint gives the initial eval
    assert record["initial_eval"]["rows"] > 0
    (ckpt.parent / "training.json").write_text(json.dumps(record))
    new_machine = [str(tmp_path / "new") if a == str(out) else a for a in argv]
    assert main([*new_machine, "--resume"]) == 0
    resumed = json.loads((tmp_path / "new" / "training.json").read_text())
    assert resumed["initial_eval"] == record["initial_eval"]


def test_bf16_is_chosen_only_where_the_cpu_has_bf16_dot_products_and_trains_in_bf16() -> None:
    """auto: bf16 with AMX bf16 tiles or AVX-512 bf16, float32 with AVX2 alone; an explicit choice is kept."""
    assert choose_precision("auto", "cpu", ["avx2", "avx512f", "avx512_bf16", "amx_bf16"]).name == "bfloat16"
    assert choose_precision("auto", "cpu", ["avx2", "avx512f", "avx512_bf16"]).name == "bfloat16"
    assert choose_precision("auto", "cpu", ["avx2", "avx512f"]).name == "float32"
    assert choose_precision("auto", "cpu", ["avx2"]).name == "float32"
    assert choose_precision("bfloat16", "cpu", ["avx2"]).name == "bfloat16"
    assert choose_precision("float32", "cpu", ["amx_bf16"]).name == "float32"
    with pytest.raises(ValueError, match="auto, float32, bfloat16"):
        choose_precision("fp16", "cpu", [])


def matmul_dtypes(run: Callable[[], Any]) -> set[torch.dtype]:
    """The dtypes of every matrix product ``run`` computes."""
    from torch.utils._python_dispatch import TorchDispatchMode

    aten = torch.ops.aten  # (under inference mode the composite ops arrive undecomposed)
    products = {
        aten.mm.default,
        aten.bmm.default,
        aten.addmm.default,
        aten.matmul.default,
        aten.linear.default,
    }
    seen: set[torch.dtype] = set()

    class Recorder(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in products:
                seen.update(a.dtype for a in args if isinstance(a, torch.Tensor))
            return func(*args, **(kwargs or {}))

    with Recorder():
        run()
    return seen


def test_a_float32_step_computes_every_product_in_float32_vocabulary_included(setup: dict) -> None:
    """float32 means float32 everywhere: the loss's vocabulary matmuls too (they were bf16 whatever the
    precision; emulated on an AVX2 CPU, a step of the v9 run took 2 min instead of about 6 s)."""
    target, fdir, shards = setup["target"], setup["fdir"], setup["shards"]
    seen = {}
    for precision in ("float32", "bfloat16"):
        head = build_head(target, init="target", seed=0)
        cfg = TrainConfig(epochs=1, lr=1e-3, batch_tokens=128, seed=0, precision=precision, max_steps=1)
        seen[precision] = matmul_dtypes(lambda h=head, c=cfg: train(h, fdir, shards, None, c, progress=False))
    assert seen["float32"] == {torch.float32}
    assert torch.bfloat16 in seen["bfloat16"]


def test_float32_features_compute_every_product_in_float32(setup: dict, tmp_path: Path) -> None:
    """The feature pass of a float32 target computes its top-K logits in float32 too (they were bf16
    whatever the target's dtype: emulated on an AVX2 CPU, 150 tok/s)."""
    seqs = setup["seqs"]
    seen = matmul_dtypes(lambda: write_feature_shards(setup["model"], seqs, tmp_path, "train", 150))
    assert seen == {torch.float32}


def test_a_bf16_step_computes_in_bf16_and_keeps_float32_weights(setup: dict) -> None:
    """Under the bf16 precision the head's matmuls run in bf16 (its loss differs from float32's in the
    third digit, not more) while its weights and their gradients stay float32."""
    target, fdir, shards = setup["target"], setup["fdir"], setup["shards"]
    runs = {}
    for precision in ("float32", "bfloat16"):
        head = build_head(target, init="target", seed=0)
        cfg = TrainConfig(epochs=1, lr=1e-3, batch_tokens=128, seed=0, precision=precision, max_steps=2)
        runs[precision] = train(head, fdir, shards, None, cfg, progress=False)["steps"][0]["loss"]
        assert all(p.dtype == torch.float32 for p in head.parameters())
    assert runs["float32"] != runs["bfloat16"]
    assert runs["bfloat16"] == pytest.approx(runs["float32"], rel=2e-2)


def test_data_scaling_fit_is_log_linear_and_extrapolates_to_the_goal() -> None:
    """top-1 = a + b log2(tokens): points on such a line give back a and b, and the goal's tokens."""
    tokens = [1e5, 2e5, 4e5, 8e5]
    a, b = scaling.fit_log_linear(tokens, [0.20 + 0.05 * math.log2(t / 1e5) for t in tokens])
    assert b == pytest.approx(0.05) and a + b * math.log2(1e5) == pytest.approx(0.20)
    assert scaling.tokens_for(0.40, a, b) == pytest.approx(1.6e6)
    assert scaling.tokens_for(0.40, 0.5, -0.01) is None  # a falling curve never reaches the goal
    with pytest.raises(ValueError):
        scaling.fit_log_linear([1e5, 1e5], [0.2, 0.3])
    with pytest.raises(SystemExit):  # argparse: "give at least two shard counts"
        scaling.parse_args(["--features", "x", "--shards", "2"])


def test_data_scaling_gives_no_fit_over_less_than_one_doubling(tmp_path: Path) -> None:
    """A slope over 898k-998k tokens is noise: no fit, the table says why, the plot has the points."""

    def row(tokens: int, top1: float) -> dict:
        return {"tokens": tokens, "train_seconds": 60.0, "eval": {"ShareGPT": {"top1": top1, "top5": 0.5}}}

    short = [row(898_000, 0.417), row(998_000, 0.426)]
    fit = scaling.fits(short, 0.6)
    assert fit == {"ShareGPT": None}
    assert "no fit: the heads' data spans x1.11, less than one doubling" in scaling.markdown(
        short, fit, 0.6, "cmd"
    )
    scaling.plot(short, fit, 0.6, tmp_path / "short.png")
    assert (tmp_path / "short.png").stat().st_size > 10_000
    assert scaling.fits([row(100_000, 0.2), row(200_000, 0.25)], 0.6)["ShareGPT"] is not None  # one doubling


def test_data_scaling_trains_each_head_on_its_prefix_and_writes_table_and_plot(
    setup: dict, tmp_path: Path
) -> None:
    """One head per shard prefix, each exactly as train() on that prefix alone; JSON, table and PNG."""
    fdir, shards = tmp_path / "features", setup["shards"]
    fdir.mkdir()
    for s in shards:
        (fdir / s["file"]).symlink_to(setup["fdir"] / s["file"])
    splits = {"train": {"shards": shards}, "eval": {"shards": shards[-1:]}}
    (fdir / "manifest.json").write_text(json.dumps({"splits": splits}))
    out = tmp_path / "scaling.json"
    argv = ["--features", str(fdir), "--target", str(setup["target"]), "--shards", "1,2"]
    argv += ["--epochs", "1", "--lr", "3e-3", "--batch-tokens", "64", "--vocab-subset", "0"]
    assert scaling.main([*argv, "--output", str(out)]) == 0

    record = json.loads(out.read_text())
    rows = record["rows"]
    assert [r["tokens"] for r in rows] == [
        sum(shards[0]["lengths"]),
        sum(shards[0]["lengths"] + shards[1]["lengths"]),
    ]
    head = build_head(setup["target"], init="target", seed=0)
    cfg = TrainConfig(epochs=1, lr=3e-3, min_lr_ratio=0.05, batch_tokens=64, vocab_subset=0, seed=0)
    train(head, fdir, shards[:2], None, cfg, progress=False)
    alone = evaluate(head, fdir, shards[-1:], 64)
    assert rows[1]["eval"]["ShareGPT"] == pytest.approx(alone)
    assert rows[0]["eval"]["ShareGPT"]["loss"] != pytest.approx(alone["loss"])
    assert set(record["fits"]) == {"ShareGPT"}
    assert out.with_suffix(".md").read_text().count("\n| ") == 3  # header + 2 heads
    assert out.with_suffix(".png").stat().st_size > 10_000


def test_released_heads_are_drawn_beside_a_recorded_line_with_their_gain_per_doubling(tmp_path: Path) -> None:
    """--from-record redraws the line without training; --head reads a trainer record: the main held-out
    split is ShareGPT when conversations were held out, else the MT-bench answers."""

    def metrics(top1: float) -> dict:
        return {"top1": top1, "top1_depth2": top1 - 0.1, "top1_depth3": top1 - 0.15, "top5": 0.7}

    def trainer_record(tokens: int, conversations: int, final: dict) -> dict:
        args = {"eval_conversations": conversations, "eval_replies": "mtbench"}
        return {"args": args, "data": {"train_tokens": tokens}, "final_heldout": final}

    line = tmp_path / "line.json"
    rows = [
        {
            "tokens": t,
            "train_seconds": 60.0,
            "eval": {"ShareGPT": metrics(y), "distilled answers": metrics(y + 0.1)},
        }
        for t, y in ((100_000, 0.2), (200_000, 0.25))
    ]
    line.write_text(json.dumps({"command": "train cmd", "rows": rows}))
    v8 = tmp_path / "v8.json"
    v8.write_text(json.dumps(trainer_record(4_000_000, 0, metrics(0.50))))
    v9 = tmp_path / "v9.json"
    v9.write_text(
        json.dumps(trainer_record(8_000_000, 24, {**metrics(0.40), "mtbench_replies": metrics(0.53)}))
    )
    out = tmp_path / "out.json"
    argv = ["--from-record", str(line), "--head", f"v8={v8}", "--head", f"v9={v9}", "--output", str(out)]
    assert scaling.main(argv) == 0

    record = json.loads(out.read_text())
    assert record["rows"] == rows and record["command"] == "train cmd"
    v8_point, v9_point = record["heads"]
    assert (
        set(v8_point["eval"]) == {"distilled answers"}
        and v8_point["eval"]["distilled answers"]["top1"] == 0.5
    )
    assert (
        v9_point["eval"]["ShareGPT"]["top1"] == 0.4 and v9_point["eval"]["distilled answers"]["top1"] == 0.53
    )
    assert record["fits"]["ShareGPT"]["per_doubling"] == pytest.approx(0.05)
    md = out.with_suffix(".md").read_text()
    assert "| v9 | 8,000,000 | 40.0% / 30.0% / 25.0% | 53.0% / 43.0% / 38.0% |" in md
    assert "v8 to v9 (x2.00 tokens), distilled answers: +3.0 points of top-1 per doubling" in md
    assert "ShareGPT: +" not in md.split("v8 to v9")[1]  # v8 has no ShareGPT number: no gain claimed
    assert out.with_suffix(".png").stat().st_size > 10_000
    with pytest.raises(SystemExit):  # a head needs NAME=FILE
        scaling.parse_args(["--from-record", str(line), "--head", str(v8)])


def test_two_layer_head_exports_in_vllms_format_and_matches_the_reference(
    setup: dict, tmp_path: Path
) -> None:
    """Layer 1 has an input norm (vLLM builds one for every layer but the first) and reads layer 0."""
    from safetensors.torch import load_file
    from vllm.transformers_utils.config import get_config
    from vllm.transformers_utils.configs.eagle import EAGLEConfig

    head = build_head(setup["target"], init="random", seed=3, num_layers=2)
    out = export_head(head, tmp_path / "head", dtype=torch.float32)
    keys = set(load_file(str(out / "model.safetensors")))
    assert "layers.1.input_layernorm.weight" in keys and "layers.0.input_layernorm.weight" not in keys
    eagle = EAGLEConfig(get_config(str(out), trust_remote_code=False), method="eagle", model_type="eagle")
    assert eagle.model.num_hidden_layers == 2
    ref = EagleHeadReference.load(out, setup["target"])
    gen = torch.Generator().manual_seed(5)
    tokens, hidden = torch.randint(6, 512, (20,), generator=gen), torch.randn(20, 128, generator=gen)
    with torch.no_grad():
        mine = head(tokens, hidden, torch.arange(20), [20])
    torch.testing.assert_close(mine, ref.forward(tokens, hidden), atol=1e-4, rtol=1e-4)


def test_a_head_grown_by_a_layer_starts_with_the_smaller_heads_outputs(setup: dict, tmp_path: Path) -> None:
    """--num-layers 2 --init-from a 1-layer head: the new layer starts as the identity, at every depth."""
    small = build_head(setup["target"], init="random", seed=4)
    out = export_head(small, tmp_path / "small", dtype=torch.float32)
    grown = build_head(setup["target"], init="target", seed=0, num_layers=2)
    load_head_weights(grown, out)
    gen = torch.Generator().manual_seed(6)
    tokens, hidden = torch.randint(6, 512, (16,), generator=gen), torch.randn(16, 128, generator=gen)
    args = (tokens, hidden, torch.arange(16), [16], 3)
    with torch.no_grad():
        for a, b in zip(small.forward_unrolled(*args), grown.forward_unrolled(*args)):
            torch.testing.assert_close(a, b)
    # Fewer layers than the saved head is a mismatch, not a silent truncation.
    two = export_head(grown, tmp_path / "two", dtype=torch.float32)
    with pytest.raises(SystemExit, match="extra"):
        load_head_weights(build_head(setup["target"], init="random", seed=0), two)


def test_aux_layer_features_are_stored_and_a_head_reading_them_starts_as_the_plain_one(
    setup: dict, tmp_path: Path
) -> None:
    """--aux-layers: shards hold the residual stream entering the listed target layers; a head grown
    with those inputs from a plain one starts with its outputs, and training reaches the new weights."""
    from safetensors.torch import load_file

    seqs = Sequences(ids=setup["seqs"].ids[:2], masks=setup["seqs"].masks[:2])
    shards = write_feature_shards(
        setup["model"], seqs, tmp_path / "features", "train", 10_000, aux_layers=(1, 0)
    )
    data = load_file(str(tmp_path / "features" / shards[0]["file"]))
    n0 = len(seqs.ids[0])
    with torch.no_grad():
        states = setup["model"].model(input_ids=torch.tensor(seqs.ids[0])[None], output_hidden_states=True)
    ref = torch.cat([states.hidden_states[1][0], states.hidden_states[0][0]], -1)
    assert data["aux"].dtype == torch.bfloat16 and data["aux"].shape == (data["tokens"].numel(), 2 * 128)
    torch.testing.assert_close(data["aux"][:n0].float(), ref, atol=0.05, rtol=0.02)

    plain = export_head(
        build_head(setup["target"], init="random", seed=7), tmp_path / "plain", dtype=torch.float32
    )
    small = build_head(setup["target"], init="random", seed=0)
    load_head_weights(small, plain)
    grown = build_head(setup["target"], init="target", seed=0, aux_layers=(1, 0))
    load_head_weights(grown, plain)
    batch = ShardReader(tmp_path / "features", shards).batch(0, [0, 1])
    assert batch.aux_in is not None and batch.aux_in.shape == (batch.tokens.numel(), 2 * 128)
    args = (batch.tokens, batch.hidden_in, batch.positions, batch.seq_lens, 2)
    with torch.no_grad():
        for a, b in zip(small.forward_unrolled(*args), grown.forward_unrolled(*args, batch.aux_in)):
            torch.testing.assert_close(a, b)
    batch_loss(grown, batch, train=True, depths=2)
    assert grown.aux_fc.weight.grad is not None and grown.aux_fc.weight.grad.abs().sum() > 0
    with pytest.raises(SystemExit, match="aux-layers"):
        build_head(setup["target"], init="random", aux_layers=(2,))
    out, features = tmp_path / "o", tmp_path / "f"
    with pytest.raises(SystemExit, match="aux-layers"):
        main(
            ["--target", str(setup["target"]), "--aux-layers", "2", "--output", str(out)]
            + ["--feature-dir", str(features)]
        )
    assert not out.exists() and not features.exists(), "--aux-layers is checked before any data is read"


def test_unrolled_depths_read_their_own_features_over_the_teacher_context(setup: dict) -> None:
    """Depth s at row r is the head run causally on rows whose features are the target's up to row
    r - s + 1, then the head's own outputs of depths 1..s-1, one row each (how the drafter runs)."""
    head = build_head(setup["target"], init="random", seed=2)
    gen = torch.Generator().manual_seed(4)
    lens = [9, 7]  # two packed sequences
    tokens = torch.randint(6, 512, (sum(lens),), generator=gen)
    hidden = torch.randn(sum(lens), 128, generator=gen)
    positions = torch.cat([torch.arange(n) for n in lens])
    with torch.no_grad():
        outs = head.forward_unrolled(tokens, hidden, positions, lens, 3)
        torch.testing.assert_close(outs[0], head(tokens, hidden, positions, lens))
        start = 0
        for n in lens:
            tok, hid = tokens[start : start + n], hidden[start : start + n]
            for depth in (2, 3):
                for r in range(depth - 1, n):
                    first = r - depth + 1  # last row whose feature is the target's
                    own = [outs[j][start + first + j] for j in range(depth - 1)]
                    feats = torch.cat([hid[: first + 1], torch.stack(own)])
                    ref = head(tok[: r + 1], feats, torch.arange(r + 1), [r + 1])[-1]
                    torch.testing.assert_close(outs[depth - 1][start + r], ref, atol=1e-5, rtol=1e-4)
            start += n


@pytest.mark.parametrize("steps", [1, 3])
def test_packed_attention_over_the_batch_equals_attention_per_sequence(steps: int) -> None:
    """The GPU's one-call attention (a same-sequence mask over the packed batch) gives the CPU's
    per-sequence outputs and gradients, for plain causal attention and for unrolled depths."""
    gen = torch.Generator().manual_seed(5)
    lens = [5, 1, 8, 3]
    t = sum(lens)
    q = torch.randn(t, 4, 8, generator=gen, requires_grad=True)
    keys = [torch.randn(t, 2, 8, generator=gen, requires_grad=True) for _ in range(steps)]
    values = [torch.randn(t, 2, 8, generator=gen, requires_grad=True) for _ in range(steps)]
    leaves = [q, *keys, *values]
    want = per_sequence_attention(q, keys, values, lens)
    want_grads = torch.autograd.grad(want.square().sum(), leaves)
    got = packed_attention(q, keys, values, lens)
    got_grads = torch.autograd.grad(got.square().sum(), leaves)
    torch.testing.assert_close(got, want)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w)


def test_distilled_replies_are_masked_and_held_out_ids_dropped(tmp_path: Path) -> None:
    """distill_target.py's JSONL trains on the reply only, and never on a held-out prompt."""
    from transformers import AutoTokenizer

    from vllm_eagle2_tools.testing import build_tokenizer

    tok = AutoTokenizer.from_pretrained(str(build_tokenizer(tmp_path / "tok")))
    path = tmp_path / "distilled.jsonl"
    rows = [
        {"id": i, "messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}
        for i, q, a in (("a", "say hi", "hi there friend"), ("held", "secret prompt", "secret reply"))
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    seqs = load_distilled(tok, [path], 1000, exclude={"held"})
    assert seqs.names == ["a"]
    reply = tok.decode([t for t, m in zip(seqs.ids[0], seqs.masks[0]) if m])
    assert "hi there friend" in reply and "say hi" not in reply


def test_render_mask_and_sharegpt_reader(tmp_path: Path) -> None:
    """Assistant spans are masked through the chat template; the reader stops at a truncated tail."""
    from transformers import AutoTokenizer

    from vllm_eagle2_tools.testing import build_tokenizer

    tok = AutoTokenizer.from_pretrained(str(build_tokenizer(tmp_path / "tok")))
    msgs = datasets.to_messages(
        {
            "conversations": [
                {"from": "gpt", "value": "dropped leading reply"},
                {"from": "human", "value": "def f(x):"},
                {"from": "gpt", "value": "return x + 1"},
            ]
        }
    )
    assert [m["role"] for m in msgs] == ["user", "assistant"]
    ids, mask = render_conversation(tok, msgs, 1000)
    reply = tok.decode([t for t, m in zip(ids, mask) if m])
    assert "return x + 1" in reply and "def f" not in reply

    path = tmp_path / "trunc.json"
    path.write_text('[{"id": "a", "conversations": []}, {"id": "b"}, {"id": "c", "conv')
    assert [x["id"] for x in datasets.iter_json_array(path, chunk_chars=7)] == ["a", "b"]


EAGLE3_AUX = (0, 1)  # the tiny target has 2 layers (vLLM's default 2, N//2, N-3 needs N >= 5)
EAGLE3_VOCAB = 200  # of the tiny target's 512 tokens


@pytest.fixture(scope="module")
def eagle3_setup(setup: dict) -> dict:
    """Feature shards with the aux layers' hidden states, and a draft vocabulary from the replies."""
    from collections import Counter

    fdir = setup["root"] / "features_eagle3"
    seqs = setup["seqs"]
    shards = write_feature_shards(setup["model"], seqs, fdir, "train", 150, aux_layers=EAGLE3_AUX)
    counts = Counter(t for ids, mask in zip(seqs.ids, seqs.masks) for t, m in zip(ids, mask) if m)
    ranked = [t for t, _ in counts.most_common()]
    draft_ids = select_draft_vocab(ranked, EAGLE3_VOCAB, 512)
    return {"fdir": fdir, "shards": shards, "draft_ids": draft_ids, "ranked": ranked}


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate-half RoPE of x [T, heads, d] at integer positions [T]."""
    d = x.shape[-1]
    freqs = pos.double()[:, None] / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)[None]
    cos, sin = (
        torch.cat([freqs.cos()] * 2, -1)[:, None].float(),
        torch.cat([freqs.sin()] * 2, -1)[:, None].float(),
    )
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * cos + torch.cat([-x2, x1], -1) * sin


class _VllmEagle3Reference:
    """vLLM 0.32's ``Eagle3LlamaForCausalLM`` over an exported folder, in plain torch: weights read by
    their checkpoint names from model.safetensors, config from config.json, the target's embedding."""

    def __init__(self, head_dir: Path, target_dir: Path) -> None:
        from safetensors.torch import load_file

        self.w = {k: v.float() for k, v in load_file(str(head_dir / "model.safetensors")).items()}
        self.d2t = load_file(str(head_dir / "model.safetensors")).get("d2t")
        self.cfg = json.loads((head_dir / "config.json").read_text())
        tgt = load_file(str(target_dir / "model.safetensors"))
        self.embed = tgt["model.embed_tokens.weight"].float()
        rope = self.cfg.get("rope_parameters") or {}
        self.theta = float(rope.get("rope_theta", self.cfg.get("rope_theta", 10000.0)))
        self.cache: list[tuple[torch.Tensor, torch.Tensor]] = []  # (k, v) of every position run so far

    def step(self, token: int, g: torch.Tensor, pos: int) -> torch.Tensor:
        """One position: g [H] is fc(aux) (the caller applies fc) or the previous pre-norm output;
        attends to every cached position and itself. Returns the pre-norm output [H]."""
        w, c = self.w, self.cfg
        eps, nh, nkv = c["rms_norm_eps"], c["num_attention_heads"], c["num_key_value_heads"]
        d = c["hidden_size"] // nh
        p = "midlayer."
        x = torch.cat(
            [
                _rms(self.embed[token], w[p + "input_layernorm.weight"], eps),
                _rms(g, w[p + "hidden_norm.weight"], eps),
            ]
        )
        at = torch.tensor([pos])
        q = _rope((w[p + "self_attn.q_proj.weight"] @ x).view(1, nh, d), at, self.theta)[0]
        k = _rope((w[p + "self_attn.k_proj.weight"] @ x).view(1, nkv, d), at, self.theta)[0]
        v = (w[p + "self_attn.v_proj.weight"] @ x).view(nkv, d)
        keys = torch.stack([kv[0] for kv in self.cache] + [k])  # [n, kv, d]
        values = torch.stack([kv[1] for kv in self.cache] + [v])
        rep = nh // nkv
        scores = torch.einsum("hd,nhd->hn", q, keys.repeat_interleave(rep, 1)) / math.sqrt(d)
        o = torch.einsum("hn,nhd->hd", scores.softmax(-1), values.repeat_interleave(rep, 1)).reshape(-1)
        r = g + w[p + "self_attn.o_proj.weight"] @ o
        m = _rms(r, w[p + "post_attention_layernorm.weight"], eps)
        mlp = w[p + "mlp.gate_proj.weight"] @ m
        mlp = w[p + "mlp.down_proj.weight"] @ (
            torch.nn.functional.silu(mlp) * (w[p + "mlp.up_proj.weight"] @ m)
        )
        self._last_kv = (k, v)
        return r + mlp

    def commit(self) -> None:
        """Keep the last step's (k, v) in the cache (a position of the context)."""
        self.cache.append(self._last_kv)

    def logits(self, y: torch.Tensor) -> torch.Tensor:
        """Target-vocabulary logits [V] of a pre-norm output: -inf outside the draft vocabulary."""
        out = _rms(y, self.w["norm.weight"], self.cfg["rms_norm_eps"])
        draft = self.w["lm_head.weight"] @ out
        full = torch.full((self.cfg["vocab_size"],), float("-inf"))
        ids = torch.arange(draft.numel()) + (self.d2t if self.d2t is not None else 0)
        full[ids] = draft
        return full


def test_vllms_default_eagle3_aux_layers_are_low_middle_and_high() -> None:
    """(2, N//2, N-3): 2, 15, 27 for SmolLM2-135M's 30 layers; given layers are sorted, bad ones exit."""
    from types import SimpleNamespace

    assert default_aux_layers(30) == [2, 15, 27]
    assert eagle3_aux_layers(SimpleNamespace(num_hidden_layers=30), []) == [2, 15, 27]
    assert eagle3_aux_layers(SimpleNamespace(num_hidden_layers=30), [27, 2, 15]) == [2, 15, 27]
    with pytest.raises(SystemExit, match="aux-layers"):
        eagle3_aux_layers(SimpleNamespace(num_hidden_layers=2), [])
    args = parse_args(["--format", "eagle3"])
    assert args.draft_vocab == 32000 and args.aux_layers == []


def test_draft_vocabulary_takes_the_most_frequent_reply_tokens_sorted_by_id() -> None:
    """The first Vd ranked ids, then the fill, then the lowest free ids; sorted; capped at the target's."""
    assert select_draft_vocab([9, 3, 7], 2, 10).tolist() == [3, 9]
    assert select_draft_vocab([9, 3], 4, 10, fill=[5, 3]).tolist() == [0, 3, 5, 9]
    assert select_draft_vocab([9], 50, 10).tolist() == list(range(10))


def test_eagle3_head_training_lowers_its_loss_and_exports_vllms_eagle3_format(
    setup: dict, eagle3_setup: dict, tmp_path: Path
) -> None:
    """Two short epochs (depths 1-2) lower the draft-vocabulary CE; the folder has exactly the keys,
    shapes and config fields vLLM's Eagle3LlamaForCausalLM loads; --init-from reads it back."""
    from safetensors.torch import load_file

    target, fdir, shards, draft_ids = (
        setup["target"],
        *(eagle3_setup[k] for k in ("fdir", "shards", "draft_ids")),
    )
    head = build_eagle3_head(target, EAGLE3_AUX, draft_ids, init="target", seed=0)
    before = evaluate(head, fdir, shards, batch_tokens=128)
    cfg = TrainConfig(epochs=2, lr=3e-3, batch_tokens=128, seed=0, warmup_ratio=0.0, depths=2)
    history = train(head, fdir, shards, shards, cfg, progress=False)
    after = history["eval"][-1]
    assert after["reg_loss"] == 0 and after["loss"] == pytest.approx(after["ce_loss"])
    assert after["loss"] < 0.9 * before["loss"], (before, after)
    assert after["top1"] > before["top1"] and after["top1_depth2"] > before["top1_depth2"], (before, after)

    out = export_head(head, tmp_path / "head", dtype=torch.float32)
    sd = load_file(str(out / "model.safetensors"))
    h, inter, kv, vd = 128, 256, 2 * (128 // 4), EAGLE3_VOCAB
    expected = {
        "midlayer.self_attn.q_proj.weight": (h, 2 * h),
        "midlayer.self_attn.k_proj.weight": (kv, 2 * h),
        "midlayer.self_attn.v_proj.weight": (kv, 2 * h),
        "midlayer.self_attn.o_proj.weight": (h, h),
        "midlayer.mlp.gate_proj.weight": (inter, h),
        "midlayer.mlp.up_proj.weight": (inter, h),
        "midlayer.mlp.down_proj.weight": (h, inter),
        "midlayer.input_layernorm.weight": (h,),
        "midlayer.hidden_norm.weight": (h,),
        "midlayer.post_attention_layernorm.weight": (h,),
        "norm.weight": (h,),
        "fc.weight": (h, len(EAGLE3_AUX) * h),
        "lm_head.weight": (vd, h),
        "d2t": (vd,),
        "t2d": (512,),
    }
    assert {k: tuple(v.shape) for k, v in sd.items()} == expected
    assert sd["d2t"].dtype == torch.int64 and sd["t2d"].dtype == torch.bool
    assert torch.equal(torch.arange(vd) + sd["d2t"], draft_ids)  # draft index j is token j + d2t[j]
    assert sd["t2d"].nonzero().squeeze(-1).tolist() == draft_ids.tolist()
    raw = json.loads((out / "config.json").read_text())
    assert raw["architectures"] == ["LlamaForCausalLMEagle3"] and raw["num_hidden_layers"] == 1
    assert (raw["vocab_size"], raw["draft_vocab_size"], raw["target_hidden_size"]) == (512, vd, h)
    assert raw["eagle_aux_hidden_state_layer_ids"] == list(EAGLE3_AUX)
    assert raw["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == list(EAGLE3_AUX)  # (sizes vLLM's fc)
    from vllm.transformers_utils.config import get_config
    from vllm.transformers_utils.configs.eagle import EAGLEConfig

    eagle = EAGLEConfig(get_config(str(out), trust_remote_code=False), method="eagle3", model_type="eagle")
    assert eagle.architectures == ["LlamaForCausalLMEagle3"]
    assert eagle.model.draft_vocab_size == vd and eagle.model.eagle_aux_hidden_state_layer_ids == [0, 1]

    again = build_eagle3_head(target, EAGLE3_AUX, draft_ids, init="random", seed=1)
    load_eagle3_weights(again, out)  # --init-from
    for (k, a), b in zip(head.state_dict().items(), again.state_dict().values()):
        assert torch.equal(a, b), k
    other = build_eagle3_head(target, EAGLE3_AUX, draft_ids[:-1], seed=0)
    with pytest.raises(SystemExit):
        load_eagle3_weights(other, out)


def test_exported_eagle3_head_computes_vllms_eagle3_forward(
    setup: dict, eagle3_setup: dict, tmp_path: Path
) -> None:
    """A plain-torch twin of vLLM's Eagle3LlamaForCausalLM, reading the saved safetensors by name, gives
    the trainer's logits at depth 1 (fc over the aux states) and at depth 2 (the pre-norm output fed back
    without fc, attending to the context's cache): a key-name or transposition mistake fails."""
    head = build_eagle3_head(setup["target"], EAGLE3_AUX, eagle3_setup["draft_ids"], init="random", seed=5)
    with torch.no_grad():  # random norms too, so a swapped norm fails
        for p in head.parameters():
            if p.dim() == 1:
                p.copy_(1 + 0.2 * torch.randn_like(p))
    out = export_head(head, tmp_path / "head", dtype=torch.float32)
    ref = _VllmEagle3Reference(out, setup["target"])
    gen = torch.Generator().manual_seed(7)
    n = 12
    tokens = torch.randint(6, 512, (n,), generator=gen)
    aux = torch.randn(n, len(EAGLE3_AUX) * 128, generator=gen)
    pos = torch.arange(n)
    with torch.no_grad():
        y1, y2 = head.forward_unrolled(tokens, None, pos, [n], 2, aux)
        mine1, mine2 = head.logits(y1), head.logits(y2)
    draft_ids = eagle3_setup["draft_ids"]
    fc = ref.w["fc.weight"]
    for i in range(n):
        y = ref.step(int(tokens[i]), fc @ aux[i], i)
        want = ref.logits(y)
        torch.testing.assert_close(mine1[i], want[draft_ids], atol=1e-4, rtol=1e-4)
        assert torch.isinf(want).sum() == 512 - EAGLE3_VOCAB
        if i >= 1:  # depth 2 at row i: token i+1 of row i, the depth-1 output of row i-1, cache of rows < i
            y_deep = ref.step(int(tokens[i]), y1[i - 1], i)
            torch.testing.assert_close(mine2[i], ref.logits(y_deep)[draft_ids], atol=1e-4, rtol=1e-4)
            ref.step(int(tokens[i]), fc @ aux[i], i)  # (restore row i's context (k, v))
        ref.commit()


def test_eagle3_options_are_checked_before_any_data_is_read(setup: dict, tmp_path: Path) -> None:
    """--format eagle3 exits on EAGLE-1/2-only options and on aux layers the target lacks (the tiny
    target's 2 layers have no default 2, N//2, N-3), before the data and the features."""
    out, features = tmp_path / "o", tmp_path / "f"
    base = ["--format", "eagle3", "--target", str(setup["target"]), "--output", str(out)]
    base += ["--feature-dir", str(features)]
    with pytest.raises(SystemExit, match="aux-layers"):
        main(base)
    with pytest.raises(SystemExit, match="--num-layers, --fc-bias"):
        main([*base, "--aux-layers", "0,1", "--num-layers", "2", "--fc-bias"])
    with pytest.raises(SystemExit, match="--stream-features not available"):
        main([*base, "--aux-layers", "0,1", "--stream-features"])
    assert not out.exists() and not features.exists()
