"""Committed distilled replies (vllm_eagle2_tools.training.replies): format, resumable slices, the checks
that keep data/replies/ honest, series of sampled replies beside the greedy one, and batched greedy
generation equal to one prompt at a time."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from vllm_eagle2_tools.testing import build_target
from vllm_eagle2_tools.training import replies

REPO = Path(__file__).resolve().parents[1]
PROMPTS = [[1, 7, 8, 9], [1, 10], [1, 11, 12, 13, 14, 15, 16], [1, 17, 18]]


@pytest.fixture()
def folder(tmp_path: Path) -> Path:
    """A replies folder with one prompt set of four prompts."""
    replies.add_prompt_set(tmp_path, "chat", ["p0", "p1", "p2", "p3"], PROMPTS, {"order": "test"})
    return tmp_path


def test_pack_then_unpack_gives_the_sequences_back() -> None:
    seqs = [[5, 65535, 0], [], [42]]
    assert replies.unpack(replies.pack(seqs)) == seqs


def test_pack_refuses_ids_beyond_uint16() -> None:
    with pytest.raises(ValueError, match="uint16"):
        replies.pack([[1 << 16]])


def test_next_slice_starts_where_the_last_slice_ended(folder: Path) -> None:
    assert replies.next_slice(folder, "chat", 3) == (0, 0, 3)
    replies.add_slice(folder, "chat", 0, 0, [[2], [3, 2], [4]], {})
    assert replies.next_slice(folder, "chat", 3) == (1, 3, 4)
    replies.add_slice(folder, "chat", 1, 3, [[5]], {})
    assert replies.next_slice(folder, "chat", 3) is None


def test_verify_accepts_a_folder_that_matches_its_manifest(folder: Path) -> None:
    replies.add_slice(folder, "chat", 0, 0, [[2], [3, 2]], {})
    assert replies.verify(folder) == []


def test_verify_names_a_slice_whose_bytes_changed(folder: Path) -> None:
    path = replies.add_slice(folder, "chat", 0, 0, [[2], [3, 2]], {})
    np.savez_compressed(path, **replies.pack([[9], [9, 9]]))
    assert any(path.name in p and "sha256" in p for p in replies.verify(folder))


def test_conversations_mark_the_reply_and_leave_held_out_prompts_out(folder: Path) -> None:
    replies.add_slice(folder, "chat", 0, 0, [[20, 21, 2], [22, 2], [23]], {})
    names, ids, masks = replies.conversations(folder, "chat", max_tokens=100, exclude={"p1"})
    # p1 is held out; p2's one-token reply is too short to train on
    assert names == ["p0"]
    assert ids == [PROMPTS[0] + [20, 21, 2]]
    assert masks == [[False] * 4 + [True] * 3]


def test_conversations_can_stop_at_a_prompt_index(folder: Path) -> None:
    replies.add_slice(folder, "chat", 0, 0, [[20, 21, 2], [22, 23, 2], [24, 25, 2]], {})
    names, _, _ = replies.conversations(folder, "chat", max_tokens=100, limit=2)
    assert names == ["p0", "p1"]


def test_batched_greedy_replies_equal_one_prompt_at_a_time(tmp_path: Path) -> None:
    """Left padding and sorting by length change no token of any reply (float32 tiny target)."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(str(build_target(tmp_path / "t", seed=0)), dtype=torch.float32)
    model.eval()
    eos = 2
    batched = replies.generate_batched(model, PROMPTS, 6, batch_size=4, eos_id=eos, pad_id=3)
    alone = [replies.generate_batched(model, [p], 6, batch_size=1, eos_id=eos, pad_id=3)[0] for p in PROMPTS]
    assert batched == alone
    assert all(0 < len(r) <= 6 and (eos not in r or r.index(eos) == len(r) - 1) for r in batched)


def test_a_sampled_series_fills_its_own_slices_beside_the_greedy_one(folder: Path) -> None:
    """A second series over the same prompts resumes on its own, is verified on its own, and its
    replies join the greedy ones as training sequences of the same prompts."""
    replies.add_slice(folder, "chat", 0, 0, [[20, 2], [21, 2], [22, 2], [23, 2]], {})
    assert replies.next_slice(folder, "chat", 3, "chat-t1") == (0, 0, 3)
    path = replies.add_slice(folder, "chat", 0, 0, [[30, 2], [31, 2], [32, 2]], {}, series="chat-t1")
    assert path.name == "chat-t1-00000.npz"
    assert replies.next_slice(folder, "chat", 3, "chat-t1") == (1, 3, 4)
    assert replies.next_slice(folder, "chat", 3) is None  # the greedy series is complete
    assert replies.verify(folder) == []
    names, ids, _ = replies.conversations(folder, "chat", max_tokens=100)
    assert names == ["p0", "p1", "p2", "p3", "p0", "p1", "p2"]
    assert ids[4] == PROMPTS[0] + [30, 2]


def test_verify_names_a_gap_within_a_series(folder: Path) -> None:
    replies.add_slice(folder, "chat", 0, 0, [[30, 2]], {}, series="chat-t1")
    replies.add_slice(folder, "chat", 1, 2, [[31, 2]], {}, series="chat-t1")
    gap = "chat-t1-00001.npz: starts at 2, previous slice ended at 1"
    assert any(gap in p for p in replies.verify(folder))


def test_sampled_replies_are_seeded_and_not_the_greedy_ones(tmp_path: Path) -> None:
    """At temperature > 0 the whole distribution is sampled: the same seed gives the same replies,
    and they differ from the greedy replies (float32 tiny target, random weights: a flat distribution)."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(str(build_target(tmp_path / "t", seed=0)), dtype=torch.float32)
    model.eval()

    def sample(seed: int) -> list[list[int]]:
        torch.manual_seed(seed)
        return replies.generate_batched(model, PROMPTS, 6, batch_size=4, eos_id=2, pad_id=3, temperature=1.0)

    greedy = replies.generate_batched(model, PROMPTS, 6, batch_size=4, eos_id=2, pad_id=3)
    assert sample(0) == sample(0)
    assert sample(0) != greedy and sample(0) != sample(1)


def test_committed_replies_match_their_manifest() -> None:
    """data/replies/: every prompt set and slice is present, unchanged, and where the manifest says."""
    folder = REPO / "data" / "replies"
    manifest = replies.load_manifest(folder)
    assert manifest["slices"], "no committed slices"
    assert replies.verify(folder) == []


def test_generate_replies_loads_no_target_when_every_slice_is_filled(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A GPU session's recipe calls the generator for data that is all there: it must cost nothing."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "generate_replies", REPO / "scripts" / "generate_replies.py"
    )
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)

    def no_model(*args: object) -> None:
        raise AssertionError("the target was loaded")

    monkeypatch.setattr(script, "hf_generator", no_model)
    data = tmp_path / "data"
    data.mkdir()
    replies.add_prompt_set(data, "mtbench", ["p0", "p1", "p2", "p3"], PROMPTS, {"order": "test"})
    replies.add_slice(data, "mtbench", 0, 0, [[2], [3, 2], [4], [5]], {})
    target = build_target(tmp_path / "t", seed=0)
    argv = ["--data", str(data), "--target", str(target), "--set", "mtbench", "--slice-size", "4"]
    assert script.main(argv) == 0
    with pytest.raises(AssertionError, match="target was loaded"):  # a sampled series is still empty
        script.main([*argv, "--temperature", "1"])
