"""The verifier's glue: which rows of a tree need the tree-attention recompute."""

from __future__ import annotations

import torch
from vllm_eagle2.kernels import PAD_PARENT, build_tree_masks

from vllm_eagle2.runner import _rows_to_recompute


def _recompute(region_parents: list[list[int]]) -> list[list[bool]]:
    depths = build_tree_masks(torch.tensor(region_parents)).depths
    return _rows_to_recompute(depths).tolist()


def test_root_and_a_leading_chain_keep_the_causal_result():
    # Region rows: root, its child, that child's child: causal attention is the tree's.
    assert _recompute([[-1, 0, 1]]) == [[False, False, False]]


def test_a_branch_and_what_hangs_below_it_are_recomputed():
    # root, a (child of root), b (child of a), c (child of root), d (child of c)
    assert _recompute([[-1, 0, 1, 0, 3]]) == [[False, False, False, True, True]]


def test_a_node_after_a_branch_is_recomputed_even_deep_in_a_chain():
    # root, a, b (second child of root), c (child of a): c's predecessors include b
    assert _recompute([[-1, 0, 0, 1]]) == [[False, False, True, True]]


def test_padding_rows_are_never_recomputed():
    assert _recompute([[-1, 0, PAD_PARENT, PAD_PARENT], [-1, 0, 0, 2]]) == [
        [False, False, False, False],
        [False, False, True, True],
    ]
