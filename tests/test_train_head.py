"""The head trainer's core (vllm_eagle2.training) on a tiny seeded target, no engine start.

Synthetic token sequences run through a tiny "partial" target; features go to shards; a few steps of
training must lower the loss; the exported head must be in vLLM's eagle format (config accepted by
vLLM's config loader and ``EAGLEConfig``, exact key set and shapes, no ``embed_tokens``) and compute
the same function as the plain-torch twin of vLLM's head (``EagleHeadReference``).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from vllm_eagle2 import datasets
from vllm_eagle2 import head_scaling as scaling
from vllm_eagle2.testing import EagleHeadReference, build_target
from vllm_eagle2.training.cli import main, parse_args
from vllm_eagle2.training.conversations import Sequences, load_distilled, render_conversation
from vllm_eagle2.training.features import TARGET_TOPK, frequent_vocab, write_feature_shards
from vllm_eagle2.training.head import (
    build_head,
    export_head,
    load_head_weights,
    packed_attention,
    per_sequence_attention,
)
from vllm_eagle2.training.loop import ShardReader, TrainConfig, evaluate, train
from vllm_eagle2.training.loss import batch_loss, subset_vocab_loss, vocab_loss


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

    from vllm_eagle2.testing import build_tokenizer

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

    from vllm_eagle2.testing import build_tokenizer

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
