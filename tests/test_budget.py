"""The adaptive budget's chooser: cost curves, acceptance statistics, plans and allocations.

Pure functions on synthetic costs and acceptance curves; no engine.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from vllm_eagle2.budget.acceptance import AcceptanceModel
from vllm_eagle2.budget.costs import CostCurve
from vllm_eagle2.budget.decisions import (
    NO_DRAFTS,
    DraftPlan,
    allocate_nodes,
    chains_alone_pay,
    plan_draft,
    step_cost,
)


def expected_accepted(p: np.ndarray, depth: int, topk: int, max_nodes: int) -> np.ndarray:
    """Expected accepted drafts [max_nodes + 1] of the best n-node tree of shape (depth, topk): the
    reference, one shape at a time, of what :func:`plan_draft` computes for every shape at once.

    Grows the tree as :func:`vllm_eagle2.tree.build_dynamic_tree` would on a draft whose
    confidences were the acceptance rates ``p`` ([>= depth, >= topk], see
    :class:`AcceptanceModel`): a node's value is the product of ``p`` along its path, which
    is the probability that it is accepted; each level expands the ``topk`` best nodes of
    the level before. Entry n sums the n best values of the pool (entry 0 is 0; past the
    pool the sum stays flat).
    """
    level = p[0, :topk].copy()
    pool = [level]
    for d in range(1, depth):
        frontier = np.sort(level)[::-1][:topk]
        level = (frontier[:, None] * p[d, :topk][None, :]).ravel()
        pool.append(level)
    values = np.sort(np.concatenate(pool))[::-1][:max_nodes]
    out = np.zeros(max_nodes + 1)
    out[1 : len(values) + 1] = np.cumsum(values)
    out[len(values) + 1 :] = out[len(values)]
    return out


def linear_curve(max_tokens: int, fixed: float, per_token: float) -> CostCurve:
    curve = CostCurve(max_tokens)
    for knot in curve.knots:
        curve.set(int(knot), fixed + per_token * knot)
    return curve


def acceptance(top1: float = 0.7, decay: float = 0.4, depth: int = 6, topk: int = 10) -> np.ndarray:
    return np.broadcast_to(top1 * decay ** np.arange(topk), (depth, topk)).copy()


# --- cost curves -------------------------------------------------------------------------------


def test_cost_curve_interpolates_between_knots_and_extends_past_the_last():
    curve = CostCurve(8)
    curve.set(1, 1.0)
    curve.set(8, 8.0)  # 2 and 4 unset: filled on the line through 1 and 8
    assert curve(4) == pytest.approx(4.0)
    assert curve(6) == pytest.approx(6.0)
    assert curve(16) == pytest.approx(16.0)


def test_cost_curve_with_one_knot_is_proportional():
    curve = CostCurve(64)
    curve.set(4, 2.0)
    assert curve(2) == pytest.approx(2.0)  # flat below the only knot
    assert curve(64) == pytest.approx(32.0)


def test_cost_curve_observations_converge_to_the_measured_cost():
    curve = linear_curve(64, 1.0, 0.0)
    for _ in range(200):
        curve.observe(16, 3.0)
    assert curve(16) == pytest.approx(3.0, rel=1e-3)


def test_cost_curve_clips_one_outlier():
    curve = linear_curve(64, 1.0, 0.0)
    curve.observe(16, 1000.0)
    assert curve(16) == pytest.approx(1.5)  # half a step of the error clipped to the prediction


def test_cost_curve_averages_out_one_slow_pass():
    curve = linear_curve(64, 1.0, 0.0)
    for _ in range(30):
        curve.observe(16, 2.0)
    curve.observe(16, 4.0)  # a stall, after the knot has seen many passes
    assert curve(16) == pytest.approx(2.0, rel=0.1)


def test_cost_curve_never_prices_a_pass_below_a_smaller_one():
    curve = linear_curve(64, 1.0, 0.1)
    for _ in range(10):
        curve.observe(4, 3.0)  # a size priced high (a stall, or a slower machine) ...
        curve.observe(8, 1.5)  # ... and a larger one run since
    assert curve(4) <= curve(8) == pytest.approx(1.5, rel=0.1)


def test_cost_curve_caps_a_stalled_calibration_knot_by_the_larger_ones():
    curve = linear_curve(64, 0.02, 0.0005)
    curve.set(1, 0.5)  # a stall: 1 token priced above 64
    assert curve(1) == pytest.approx(curve(2))
    assert curve(64) - curve(1) > 0  # drafting still costs something over a plain pass


def test_cost_curve_reports_whether_it_was_observed():
    curve = linear_curve(64, 0.01, 0.0)
    assert curve.ready and not curve.observed
    curve.observe(16, 0.02)
    assert curve.observed


def test_cost_curve_rejects_a_non_knot():
    with pytest.raises(ValueError, match="knot"):
        CostCurve(64).set(3, 1.0)


# --- acceptance ---------------------------------------------------------------------------------


def test_acceptance_model_starts_at_its_prior_and_follows_the_counts():
    model = AcceptanceModel(depth=2, topk=3)
    assert model.p[0].tolist() == pytest.approx([0.5, 0.25, 0.125])
    model.update(np.full((2, 3), 1000.0), np.full((2, 3), 900.0))
    assert model.p == pytest.approx(np.full((2, 3), 0.9), abs=0.01)


def test_an_unmeasured_position_is_priced_from_the_measured_one_beside_it():
    model = AcceptanceModel(depth=2, topk=3)
    trials, accepts = np.zeros((2, 3)), np.zeros((2, 3))
    trials[0, 0], accepts[0, 0] = 1000.0, 300.0  # only the top-1 child of the root was drafted
    model.update(trials, accepts)
    assert model.p[0].tolist() == pytest.approx([0.3, 0.15, 0.075], abs=0.001)
    assert model.p[1, 0] == pytest.approx(0.3, abs=0.001)  # one level down: as the level above


def test_expected_accepted_of_a_chain_is_the_sum_of_path_products():
    p = acceptance(0.8, 0.5, depth=3, topk=2)
    e = expected_accepted(p, depth=3, topk=1, max_nodes=3)
    assert e.tolist() == pytest.approx([0.0, 0.8, 0.8 + 0.64, 0.8 + 0.64 + 0.512])


def test_expected_accepted_is_concave_and_flat_past_the_pool():
    e = expected_accepted(acceptance(), depth=3, topk=2, max_nodes=20)  # pool of 10 nodes
    gains = np.diff(e)
    assert (gains[:-1] >= gains[1:] - 1e-12).all()
    assert (gains[10:] == 0).all() and (gains[:10] > 0).all()


# --- plans --------------------------------------------------------------------------------------


def plan(batch: int, target: CostCurve, level: CostCurve, overhead: float = 0.0, **kw):
    kw = {"max_depth": 6, "max_topk": 10, "max_nodes": 60, "acceptance": acceptance(), **kw}
    return plan_draft(batch, target=target, level=level, overhead=overhead, **kw)


def test_plan_is_no_drafts_when_verification_is_expensive():
    # Each verified token costs as much as the whole step: drafts never pay.
    chosen = plan(4, linear_curve(4096, 0.0, 1.0), linear_curve(64, 0.0, 0.001))
    assert not chosen.drafts and chosen.num_nodes == 0


def test_plan_is_the_full_tree_when_verification_and_drafting_are_free():
    chosen = plan(1, linear_curve(4096, 1.0, 0.0), linear_curve(64, 0.0, 0.0))
    assert (chosen.depth, chosen.topk, chosen.per_request) == (6, 10, 60)


def test_plan_shrinks_as_the_batch_grows():
    # Weight-bound target: a pass costs 10 ms plus 0.2 ms per token; a draft level 1 ms.
    target, level = linear_curve(4096, 0.010, 0.0002), linear_curve(640, 0.001, 0.00002)
    sizes = [plan(b, target, level, overhead=0.002).per_request for b in (1, 4, 16, 64)]
    assert sizes[0] > 0
    assert sizes == sorted(sizes, reverse=True) and sizes[-1] < sizes[0]


def test_plan_never_exceeds_the_upper_bounds():
    chosen = plan(
        1, linear_curve(4096, 1.0, 0.0), linear_curve(64, 0.0, 0.0), max_depth=3, max_topk=2, max_nodes=5
    )
    assert chosen.depth <= 3 and chosen.topk <= 2 and chosen.num_nodes <= 5


def test_plan_is_no_drafts_when_verifying_steps_cost_more_than_plain_ones():
    # Plain passes are cheap per token, but a step that verifies drafts costs 3x a plain one:
    # priced like plain passes the trees would pay; priced as measured they do not.
    target, level = linear_curve(4096, 0.030, 0.0001), linear_curve(640, 0.005, 0.00002)
    assert plan(16, target, level).drafts
    verify = linear_curve(4096, 0.100, 0.0001)
    assert not plan(16, target, level, verify=verify).drafts


def test_plan_prices_the_overhead_of_drafting_steps_apart():
    target, level = linear_curve(4096, 0.030, 0.0001), linear_curve(640, 0.005, 0.00002)
    assert plan(16, target, level, overhead=0.001, draft_overhead=0.001).drafts
    assert not plan(16, target, level, overhead=0.001, draft_overhead=0.100).drafts


def test_step_cost_is_the_price_the_plan_was_chosen_on():
    target, level = linear_curve(4096, 0.010, 0.0002), linear_curve(640, 0.001, 0.00002)
    verify = linear_curve(4096, 0.012, 0.0003)
    costs = dict(target=target, level=level, overhead=0.002, verify=verify, draft_overhead=0.003)
    chosen = plan(1, **costs)
    assert chosen.drafts
    gain = expected_accepted(acceptance(), chosen.depth, chosen.topk, chosen.num_nodes)[chosen.per_request]
    assert chosen.rate * step_cost(chosen, 1, **costs) == pytest.approx(1 + gain)
    assert chosen.gain == pytest.approx(gain)


def test_step_cost_of_no_drafts_is_a_plain_pass():
    target, level = linear_curve(4096, 0.010, 0.0002), linear_curve(640, 0.001, 0.00002)
    verify = linear_curve(4096, 9.0, 0.0)  # what verifying costs does not matter
    cost = step_cost(NO_DRAFTS, 4, target=target, level=level, overhead=0.5, verify=verify)
    assert cost == pytest.approx(float(target(4)) + 0.5)


def exhaustive_plan(
    batch, *, max_depth, max_topk, max_nodes, acceptance, target, level, overhead, chain_only, sent=None
):
    """plan_draft's specification: every shape (k outer, d inner) priced on its own tree, for the
    min(n, sent) best of its n nodes."""
    best = DraftPlan(0, 0, 0, 0, batch / (float(target(batch)) + overhead))
    n = np.arange(max_nodes + 1, dtype=np.float64)
    counts = n if sent is None else np.minimum(n, sent)
    for k in [1] if chain_only else range(1, max_topk + 1):
        for d in range(1, (min(max_depth, max_nodes) if chain_only else max_depth) + 1):
            cost = (
                target(batch * (1 + counts))
                + float(level(batch))
                + (d - 1) * float(level(batch * k))
                + overhead
            )
            size = min(max_nodes, k + (d - 1) * k * k)
            gains = expected_accepted(acceptance, d, k, max_nodes)
            rate = batch * (1 + np.interp(counts, n, gains)) / cost
            rate = rate[: size + 1]
            j = size if chain_only else int(np.argmax(rate[1:])) + 1
            if rate[j] > best.rate:
                best = DraftPlan(d, k, size, j, float(rate[j]), float(np.interp(counts, n, gains)[j]))
    return best


@pytest.mark.parametrize("chain_only", [False, True])
def test_plan_is_the_best_shape_of_an_exhaustive_search(chain_only):
    rng = np.random.default_rng(0)
    chosen = []
    for _ in range(200):
        depth, topk = int(rng.integers(1, 8)), int(rng.integers(1, 12))
        batch = int(rng.choice([1, 4, 16, 64]))
        max_nodes = int(rng.integers(1, topk + (depth - 1) * topk * topk + 1))
        p = rng.uniform(0.0, 1.0, (depth, topk)) * rng.uniform(0.1, 1.0)  # ranks in any order
        costs = dict(
            target=linear_curve(4096, rng.uniform(0.005, 0.05), rng.uniform(0.0, 0.002)),
            level=linear_curve(4096, rng.uniform(0.0, 0.01), rng.uniform(0.0, 0.0005)),
            overhead=rng.uniform(0.0, 0.01),
        )
        kw = dict(max_depth=depth, max_topk=topk, max_nodes=max_nodes, acceptance=p, chain_only=chain_only)
        if rng.random() < 0.5:  # the allocation is expected to send fewer than some plans' nodes
            kw["sent"] = float(rng.uniform(0.0, max_nodes))
        expected = exhaustive_plan(batch, **kw, **costs)
        chosen_plan = plan_draft(batch, **kw, **costs)
        approx = {"rate": pytest.approx(expected.rate, rel=1e-12), "gain": pytest.approx(expected.gain)}
        assert chosen_plan == replace(expected, **approx)
        chosen.append(expected.drafts)
    assert 0.2 < np.mean(chosen) < 0.98  # the cases both draft and decline


# --- lookup chains alone or beside the head -----------------------------------------------------
#: A head plan at batch 4 worth two tokens per request for 2 draft levels of 5 ms, on a 20 ms target.
CHAIN_COSTS = dict(
    target=linear_curve(4096, 0.020, 0.0005), level=linear_curve(640, 0.005, 0.0001), overhead=0.002
)
HEAD_PLAN = DraftPlan(depth=2, topk=2, num_nodes=6, per_request=3, rate=0.0, gain=2.0)


def chains(batch: int, rate: float, length: int) -> np.ndarray:
    """[batch, 8] reach of ``batch`` chains of ``length`` tokens, each accepted at ``rate``."""
    reach = np.where(np.arange(8) < length, rate ** np.arange(1, 9), 0.0)
    return np.tile(reach, (batch, 1))


def test_confident_chains_go_alone_rather_than_pay_the_head_levels():
    assert chains_alone_pay(HEAD_PLAN, chains(4, 0.9, 8), **CHAIN_COSTS)


def test_doubtful_chains_leave_the_head_its_levels():
    assert not chains_alone_pay(HEAD_PLAN, chains(4, 0.3, 8), **CHAIN_COSTS)


def test_requests_without_a_chain_keep_the_head_for_the_batch():
    reach = chains(4, 0.8, 8)
    assert chains_alone_pay(HEAD_PLAN, reach, **CHAIN_COSTS)
    reach[1:] = 0.0  # one chain among four requests
    assert not chains_alone_pay(HEAD_PLAN, reach, **CHAIN_COSTS)


def test_chains_go_alone_more_readily_as_they_grow_surer_and_the_head_dearer():
    rng = np.random.default_rng(0)
    outcomes = []
    for _ in range(300):
        batch, length = int(rng.choice([1, 4, 16])), int(rng.integers(1, 9))
        rate, surer = sorted(rng.uniform(0.05, 0.99, 2))
        level, dearer = sorted(rng.uniform(0.0, 0.02, 2))
        costs = dict(CHAIN_COSTS, level=linear_curve(640, level, 0.0001))
        dear = dict(CHAIN_COSTS, level=linear_curve(640, dearer, 0.0001))
        alone = chains_alone_pay(HEAD_PLAN, chains(batch, rate, length), **costs)
        if alone:
            assert chains_alone_pay(HEAD_PLAN, chains(batch, surer, length), **costs)
            assert chains_alone_pay(HEAD_PLAN, chains(batch, rate, length), **dear)
        outcomes.append(alone)
    assert 0.1 < np.mean(outcomes) < 0.9  # the cases go both ways


def test_chain_plan_keeps_every_node_of_its_depth():
    chosen = plan(1, linear_curve(4096, 0.01, 0.001), linear_curve(64, 0.001, 0.0), chain_only=True)
    assert chosen.topk == 1 and chosen.num_nodes == chosen.depth == chosen.per_request > 0


# --- allocation ---------------------------------------------------------------------------------


def allocate(values, depths=None, allowed=None, correction=None, step_seconds=None, grafted=None):
    values = torch.tensor(values, dtype=torch.float32).log()
    batch, n = values.shape
    depths = torch.ones(batch, n, dtype=torch.long) if depths is None else torch.tensor(depths)
    allowed = torch.ones(batch, dtype=torch.bool) if allowed is None else torch.tensor(allowed)
    correction = torch.ones(8) if correction is None else torch.tensor(correction)
    if step_seconds is None:
        step_seconds = 1.0 + 0.3 * torch.arange(batch * n + 1)
    grafted = None if grafted is None else torch.tensor(grafted)
    return allocate_nodes(values, depths, allowed, correction, step_seconds, grafted).tolist()


def test_allocation_keeps_every_node_when_verification_is_free():
    assert allocate([[0.9, 0.1, 0.01], [0.5, 0.4, 0.3]], step_seconds=torch.ones(7)) == [3, 3]


def test_allocation_sends_nothing_when_verification_is_expensive():
    assert allocate([[0.9, 0.8], [0.9, 0.8]], step_seconds=1.0 + 10.0 * torch.arange(5)) == [0, 0]


def test_allocation_splits_one_budget_by_path_value():
    # A node costs 0.1 of a step's fixed cost: it pays while its acceptance exceeds the tokens
    # per second times that cost (0.36 here), whichever request it belongs to.
    steps = 1.0 + 0.1 * torch.arange(9)
    assert allocate([[0.95, 0.9, 0.85, 0.05], [0.6, 0.05, 0.01, 0.01]], step_seconds=steps) == [3, 1]


def test_allocation_keeps_prefixes_when_corrected_values_rise_with_depth():
    # Depth 2 is accepted 4x more often than its values say; its nodes still follow their parent.
    counts = allocate(
        [[0.3, 0.25]], depths=[[1, 2]], correction=[1.0, 1.0, 4.0], step_seconds=torch.tensor([1.0, 1.1, 1.2])
    )
    assert counts == [2]


def test_lookup_nodes_are_priced_by_their_own_values_at_any_depth():
    # The head's depth-1 node is accepted a tenth as often as its value says; the lookup chain's
    # nodes (values already acceptance estimates, depths past the head's table) are not corrected.
    steps = 1.0 + 0.1 * torch.arange(4)
    kwargs = dict(depths=[[1, 2, 9]], correction=[1.0, 0.1, 0.1], step_seconds=steps)
    assert allocate([[0.9, 0.8, 0.7]], grafted=[[True, True, True]], **kwargs) == [3]
    assert allocate([[0.9, 0.8, 0.7]], grafted=[[False, False, False]], **kwargs) == [0]


def test_allocation_gives_nothing_to_requests_that_may_not_draft():
    assert allocate([[0.9, 0.9], [0.9, 0.9]], allowed=[True, False], step_seconds=torch.ones(5)) == [2, 0]


#: Prices under which more verified tokens cost less than fewer: one draft is priced below none.
ADVERSE = torch.tensor([2.0, 1.0, 1.1, 1.2, 1.3])


def test_a_request_that_may_not_draft_gets_none_whatever_the_prices():
    # Priced as zero gain alone, the first disallowed node was kept: counts [1, 0].
    assert allocate([[0.9, 0.9], [0.9, 0.9]], allowed=[False, False], step_seconds=ADVERSE) == [0, 0]


def test_a_mixed_batch_under_adverse_prices_drafts_only_for_allowed_requests():
    counts = allocate([[0.01, 0.01], [0.9, 0.9]], allowed=[False, True], step_seconds=ADVERSE)
    assert counts[0] == 0 and counts[1] > 0


def test_a_node_without_a_token_is_never_sent_nor_any_after_it():
    # Per-node constraints (a chain's end, token -1): each row sends at most its allowed prefix.
    allowed = [[True, False, True], [True, True, True]]
    counts = allocate([[0.9, 0.9, 0.9], [0.9, 0.9, 0.9]], allowed=allowed, step_seconds=torch.ones(7))
    assert counts == [1, 3]


def test_the_budget_prices_more_verified_tokens_never_below_fewer(monkeypatch):
    # A drafting step's overhead learnt far below a plain step's: sending one draft that gains
    # nothing looked cheaper than sending none.
    from vllm_eagle2.budget.adaptive import AdaptiveBudget
    from vllm_eagle2.budget.costs import COSTS_ENV

    monkeypatch.setenv(
        COSTS_ENV, '{"target": [0.01, 0.0], "level": [0.001, 0.0], "overhead": 1.0, "draft_overhead": 0.0}'
    )
    budget = AdaptiveBudget(
        depth=2, topk=2, max_nodes=4, chain=False, max_batch=4, max_tokens=64, device=torch.device("cpu")
    )
    share = budget.plan(2)
    assert share.plan.drafts
    values = torch.full((2, 4), 0.9).log()
    depths = torch.ones(2, 4, dtype=torch.long)
    counts = share.allocate(values, depths, torch.tensor([False, False]))
    assert counts.tolist() == [0, 0]


def test_allocation_never_sends_more_drafts_than_the_step_can_schedule():
    # Free verification would keep all 6; the token budget holds 4 drafts beside the 2 requests.
    values = torch.tensor([[0.9, 0.8, 0.7], [0.9, 0.6, 0.5]]).log()
    depths = torch.ones(2, 3, dtype=torch.long)
    args = (values, depths, torch.ones(2, dtype=torch.bool), torch.ones(8), torch.ones(7))
    assert allocate_nodes(*args).tolist() == [3, 3]
    assert allocate_nodes(*args, max_drafts=4).tolist() == [3, 1]


def test_allocation_is_sync_free_and_fixed_shape():
    from aten_ops import AtenOps

    values = torch.rand(4, 6).log()
    depths, allowed = torch.ones(4, 6, dtype=torch.long), torch.ones(4, dtype=torch.bool)
    args = (depths, allowed, torch.ones(8), torch.ones(25))
    with AtenOps() as ops:  # raises on a host sync
        allocate_nodes(values, *args)
    assert ops.total <= 32  # a few dozen launches, independent of B and N


def test_allocation_values_are_probabilities_at_most_one():
    # A correction above 1 must not make a node worth more than one token.
    counts = allocate([[0.9]], correction=[1.0, 10.0], step_seconds=torch.tensor([1.0, 1.9]))
    assert counts == [1]
    counts = allocate([[0.9]], correction=[1.0, 10.0], step_seconds=torch.tensor([1.0, 2.1]))
    assert counts == [0]


# --- the engine's acceptance table --------------------------------------------------------------


def test_verification_outcomes_land_in_the_acceptance_table():
    from vllm_eagle2.budget.adaptive import AdaptiveBudget

    budget = AdaptiveBudget(
        depth=3, topk=2, max_nodes=6, chain=False, max_batch=1, max_tokens=64, device=torch.device("cpu")
    )
    # Root -> node 0 (rank 0) -> node 2 (rank 0); root -> node 1 (rank 1) -> node 3 (rank 0).
    parents = torch.tensor([[-1, -1, 0, 1]])
    depths = torch.tensor([[1, 1, 2, 2]])
    ranks = torch.tensor([[0, 1, 0, 0]])
    values = torch.tensor([[0.8, 0.1, 0.4, 0.05]]).log()
    known = torch.ones(1, 4, dtype=torch.bool)
    accepted = torch.tensor([[0, -1, -1, -1]])  # node 0 accepted, node 2 rejected
    budget.acceptance.record(parents, depths, ranks, values, known, accepted)
    budget.acceptance.copy_to_host()  # with the drafts' transfer (StepBudget.allocate)
    budget.acceptance.read_host_copy()  # as the next step starts (AdaptiveBudget.learn)
    # Trials: both depth-1 nodes (the root is always accepted), and node 2 (its parent was);
    # node 3's parent was rejected, so it was never tried.
    assert budget.acceptance.model.trials.tolist() == [[1, 1], [1, 0], [0, 0]]
    assert budget.acceptance.model.accepts.tolist() == [[1, 0], [0, 0], [0, 0]]
    # Per depth: 1 accepted against 0.9 of drafted probability at depth 1, 0 against 0.45 at depth 2.
    assert budget.acceptance.correction().tolist() == pytest.approx([1.0, 2 / 1.9, 1 / 1.45, 1.0])


def test_observations_rescale_the_sizes_never_observed():
    # Calibration priced every pass at a third of its real cost; the engine only ever runs
    # 16-token passes, and the curve at 64 follows them.
    curve = linear_curve(64, 0.01, 0.001)
    for _ in range(100):
        curve.observe(16, 3 * (0.01 + 0.001 * 16))
    assert curve(16) == pytest.approx(3 * 0.026, rel=1e-3)
    assert curve(64) == pytest.approx(3 * 0.074, rel=1e-3)
    assert curve(2) == pytest.approx(3 * 0.012, rel=1e-3)


def sent(budget, plan, counts: list[int], head_skipped: bool = False) -> None:
    """One step that sent ``counts`` drafts per request of ``plan``, as the budget learns it when the
    next step starts. Timed by a clock that stands still: it teaches its outcome, not a price."""
    from types import SimpleNamespace
    from unittest import mock

    from vllm_eagle2.budget import timing

    with mock.patch.object(timing, "time", SimpleNamespace(perf_counter=lambda: 0.0)):
        times = budget.learn(len(counts))
        times.drafts_sent(plan, counts, head_skipped)
        budget.learn(len(counts))


def make_budget(**kw):
    from vllm_eagle2.budget.adaptive import AdaptiveBudget

    kw = {"depth": 3, "topk": 2, "max_nodes": 6, "chain": False, "max_batch": 16, "max_tokens": 256, **kw}
    budget = AdaptiveBudget(device=torch.device("cpu"), **kw)
    budget.prices.target = linear_curve(256, 0.010, 0.0001)
    budget.prices.verify = linear_curve(256, 0.010, 0.0001)
    budget.prices.level = linear_curve(32, 0.001, 0.0)
    budget.acceptance.model.update(np.full((3, 2), 100.0), np.full((3, 2), 80.0))
    return budget


def test_acceptance_measured_low_drifts_back_to_the_prior_while_nothing_is_drafted():
    # A first few drafts all rejected (here 100 at depth 1) must not rule drafting out for good:
    # the counts keep being discounted in steps without drafts, so the budget tries again.
    from vllm_eagle2.budget.decisions import NO_DRAFTS

    budget = make_budget()
    budget.acceptance.stats[0, :2] = 100.0  # trials at depth 1, ranks 0 and 1; no acceptances
    budget.acceptance.copy_to_host()
    budget.acceptance.read_host_copy()
    steps_without = 0
    while not (plan := budget.plan(1).plan).drafts and steps_without < 200:
        sent(budget, NO_DRAFTS, [0])
        steps_without += 1
    assert plan.drafts, budget.acceptance.model.p[0]
    assert steps_without > 50  # not at once: the rejections still weigh for a while


def test_budget_times_verifying_steps_on_their_own_curve():
    budget = make_budget()
    plan = budget.plan(4).plan
    assert plan.drafts
    times = budget.learn(4)
    times.target_done()
    times.drafts_sent(plan, [2, 2, 2, 2])
    verifying = budget.learn(12, verifies=True)  # the next step verifies those drafts
    assert budget.prices.target.observed and not budget.prices.verify.observed
    verifying.target_done()
    budget.learn(4)
    assert budget.prices.verify.observed


def test_a_steps_plan_prices_its_own_target_pass_once(monkeypatch):
    """On CPU the plan sees the pass just run (the freshest news of the machine's speed); the next
    start does not learn it again."""
    now = fake_clock(monkeypatch)
    budget = make_budget()
    seen = []
    observe = budget.prices.observe_target
    monkeypatch.setattr(budget.prices, "observe_target", lambda *a, **k: seen.append(a) or observe(*a, **k))
    times = budget.learn(4)
    now[0] += 0.05
    times.target_done()
    budget.plan(4, times=times)
    assert seen == [(4, pytest.approx(0.05))]
    times.drafts_sent(NO_DRAFTS, [0] * 4)
    budget.learn(4)
    assert len(seen) == 1 and times.target_s == pytest.approx(0.05)


def test_budget_learns_a_calibration_3_5x_too_cheap_within_five_steps():
    budget = make_budget()
    budget.prices.target = linear_curve(256, 0.01, 0.0)
    for _ in range(5):
        budget.prices.observe_target(64, 0.035, verifies=False)
    assert budget.prices.speed * budget.prices.target(64) == pytest.approx(0.035, rel=0.1)


def test_a_price_not_run_follows_the_machine_speed():
    budget = make_budget()
    for _ in range(20):
        budget.prices.observe_target(12, 0.03, verifies=True)
        budget.prices.observe_target(4, 0.02, verifies=False)
    verify_before = budget.prices.costs()["verify"](12)
    for _ in range(20):  # no drafts pay for a while, and the machine runs 1.5x slower meanwhile
        budget.prices.observe_target(4, 0.03, verifies=False)
    assert budget.prices.costs()["verify"](12) == pytest.approx(1.5 * verify_before, rel=0.1)


def test_verifying_steps_dearer_than_calibrated_leave_a_plain_step_priced_as_run():
    budget = make_budget()
    plain_before, verify_seconds = budget.prices.costs()["target"](16), 2 * float(budget.prices.verify(24))
    for _ in range(40):  # verification costs twice its calibration; no plain step runs meanwhile
        budget.prices.observe_target(24, verify_seconds, verifies=True)
    costs = budget.prices.costs()
    assert costs["verify"](24) == pytest.approx(verify_seconds, rel=0.05)
    assert costs["target"](16) == pytest.approx(plain_before, rel=0.02)


def test_a_tree_size_not_run_follows_the_drafting_passes_that_are():
    budget = make_budget()
    for _ in range(20):
        budget.prices.observe_target(4, 0.03, verifies=True)
        budget.prices.observe_target(2, 0.02, verifies=True)
    before = budget.prices.costs()["verify"](4)
    for _ in range(20):  # only 2-token verification runs for a while, 1.5x slower
        budget.prices.observe_target(2, 0.03, verifies=True)
    assert budget.prices.costs()["verify"](4) == pytest.approx(1.5 * before, rel=0.15)


def fake_clock(monkeypatch) -> list[float]:
    """The budget's times and its Clock's read ``now[0]`` seconds; returns ``now``."""
    from types import SimpleNamespace

    from vllm_eagle2.budget import adaptive, costs, timing

    now = [0.0]
    clock = SimpleNamespace(perf_counter=lambda: now[0], monotonic=lambda: now[0])
    for module in (adaptive, costs, timing):
        monkeypatch.setattr(module, "time", clock)
    return now


def test_a_step_with_prompt_tokens_teaches_no_target_price(monkeypatch):
    from vllm_eagle2.budget.decisions import NO_DRAFTS

    now = fake_clock(monkeypatch)
    budget = make_budget()
    before = budget.prices.costs()["target"](np.array([4.0, 256.0]))
    for _ in range(20):  # a prompt chunk of 252 tokens beside 4 decoding requests, priced 10x
        times = budget.learn(256, 252)
        now[0] += 10 * float(budget.prices.target(256))
        times.target_done()
        times.drafts_sent(NO_DRAFTS, [0] * 4)
    budget.learn(4)
    assert budget.prices.costs()["target"](np.array([4.0, 256.0])) == pytest.approx(before)


def test_an_idle_engine_prices_its_next_steps_as_before(monkeypatch):
    now = fake_clock(monkeypatch)
    budget = make_budget()

    verifies = [False]

    def step(seconds: float, gap: float) -> None:  # a 4-token pass, the drafter, vLLM's turn
        times = budget.learn(4, verifies=verifies[0])
        now[0] += seconds
        times.target_done()
        plan = budget.plan(4).plan
        times.drafts_sent(plan, [plan.per_request] * 4)
        verifies[0] = times.drafted
        now[0] += gap

    for kind, verify_per_token in (("plain steps", 0.01), ("drafting steps", 0.00001)):
        budget.prices.verify = linear_curve(256, 0.010, verify_per_token)  # drafts pay only when cheap
        for _ in range(30):
            step(0.010, 0.001)
        drafts, costs = budget.plan(4).plan.drafts, budget.prices.costs()
        assert drafts == (kind == "drafting steps")
        step(0.010, 60.0)  # no requests for a minute
        for _ in range(3):
            step(0.010, 0.001)
        assert budget.plan(4).plan.drafts == drafts, kind
        for name in ("overhead", "draft_overhead"):
            assert budget.prices.costs()[name] < 1.5 * costs[name] + 0.001, (kind, name)


def test_a_step_with_prompt_tokens_teaches_neither_an_overhead_nor_a_level_price(monkeypatch):
    """The head's catch-up pass over a prompt (in the overhead of a step without drafts, in the
    root level of a drafting one) is paid whatever the step drafts: it must not price either."""
    from vllm_eagle2.budget.decisions import NO_DRAFTS

    now = fake_clock(monkeypatch)
    budget = make_budget()

    def step(prompt_tokens: int, drafts: bool) -> None:  # catch-up: 1 ms, 50 ms more with a prompt
        times = budget.learn(4 + prompt_tokens, prompt_tokens, verifies=drafts)
        now[0] += 0.010
        times.target_done()
        catch_up = 0.001 + (0.050 if prompt_tokens else 0.0)
        if drafts:
            plan = budget.plan(4).plan
            times.level_started(4)
            now[0] += catch_up
            times.drafting_done()
            times.drafts_sent(plan, [1] * 4)
        else:
            now[0] += catch_up
            times.drafts_sent(NO_DRAFTS, [0] * 4)
        now[0] += 0.001

    for drafts in (False, True):
        for i in range(40):
            step(300 if i % 2 else 0, drafts)
    budget.learn(4)
    assert budget.prices.draft_overhead is not None  # drafting steps were learnt
    assert budget.prices.overhead < 0.002 and budget.prices.draft_overhead < 0.002
    assert budget.prices.level(4) < 0.002


def test_budget_replans_as_soon_as_the_cached_plan_is_repriced():
    budget = make_budget()
    assert budget.plan(4).plan.drafts
    for _ in range(8):  # verifying steps turn out to cost 10x a plain pass
        for tokens in (8, 16, 32):
            budget.prices.verify.observe(tokens, 0.1)
    assert not budget.plan(4).plan.drafts and budget.counters.replans == 1


def test_verifier_width_follows_the_adaptive_budget_counts():
    from types import SimpleNamespace

    from vllm_eagle2.engine.verification import _verify_width

    adaptive = SimpleNamespace(num_spec_tokens=60, drafter=SimpleNamespace(budget=object()))
    assert _verify_width(adaptive, [3, 0, 1]) == 4  # a power of two: few shapes
    assert _verify_width(adaptive, [60, 2]) == 60
    fixed = SimpleNamespace(num_spec_tokens=60, drafter=SimpleNamespace(budget=None))
    assert _verify_width(fixed, [3, 0, 1]) == 60


def test_plan_prices_a_shape_for_the_drafts_the_allocation_sends():
    # A draft level costs a tenth of a pass: deep trees pay when all their nodes are verified,
    # not when the allocation sends one node of them (the levels are paid in full).
    target, level = linear_curve(4096, 0.010, 0.0001), linear_curve(640, 0.001, 0.0)
    full = plan(1, target, level)
    assert full.depth > 1 and full.per_request > 2
    one = plan(1, target, level, sent=1.0)
    assert (one.depth, one.topk, one.per_request) == (1, 1, 1)
    assert one.rate < full.rate
    assert not plan(1, target, linear_curve(640, 0.003, 0.0), sent=0.05).drafts


def test_budget_stops_planning_drafts_the_allocation_does_not_send():
    budget = make_budget()
    plan = budget.plan(4).plan
    assert plan.drafts
    for _ in range(20):  # the allocation keeps nothing, step after step
        sent(budget, plan, [0, 0, 0, 0])
    budget._plans.clear()  # the cached plan expires
    assert not budget.plan(4).plan.drafts


def test_budget_retries_drafting_within_a_replan_after_the_allocation_sent_nothing():
    from vllm_eagle2.budget.adaptive import REPLAN_STEPS
    from vllm_eagle2.budget.decisions import NO_DRAFTS

    budget = make_budget()
    plan = budget.plan(1).plan
    for _ in range(20):
        sent(budget, plan, [0])
    budget._plans.clear()
    steps_without = 0
    while not (plan := budget.plan(1).plan).drafts and steps_without < 4 * REPLAN_STEPS:
        sent(budget, NO_DRAFTS, [0])
        steps_without += 1
    assert plan.drafts and steps_without <= REPLAN_STEPS + 1, steps_without


def test_a_one_node_plan_sent_in_part_of_the_steps_keeps_that_part_of_its_gain():
    # One node accepted at 0.79 costs 0.0112 s a step against 0.0101 s without drafts. Sent in
    # 40% of steps it still pays (1 + 0.4 * 0.79 tokens: 118 tok/s against 99); in 10%, not.
    budget = make_budget(depth=1, topk=1, max_nodes=1)
    assert budget.plan(1).plan.drafts
    for rate, drafts in ((0.4, True), (0.1, False)):
        budget._sent[1] = rate
        budget._plans.clear()
        assert budget.plan(1).plan.drafts == drafts, rate


def test_budget_plans_for_the_drafts_the_allocation_sends_and_tries_more_once_it_sends_all():
    budget = make_budget()
    plan = budget.plan(1).plan
    assert plan.per_request > 2
    for _ in range(20):  # the allocation sends one node of each tree
        sent(budget, plan, [1])
    budget._plans.clear()
    small = budget.plan(1).plan
    assert small.depth == 1 and small.per_request <= 2  # sent: 1.06 (6 x 0.8^20 + 1 x (1 - 0.8^20))
    for _ in range(20):  # and now every node planned: one more might pay
        sent(budget, small, [small.per_request])
    assert budget.summary()["sent_per_request"]["1"] > 1.5


# --- tensor-parallel ranks ----------------------------------------------------------------------


def rank_budgets(joined: bool) -> list:
    """Two ranks' budgets; ``joined``: linked by an in-process broadcast of rank 0's values (what
    :func:`vllm_eagle2.engine.ranks.rank_agreement` does over the group), rank 0 called first."""
    from vllm_eagle2.budget.adaptive import AdaptiveBudget

    budgets = [
        AdaptiveBudget(
            depth=4,
            topk=3,
            max_nodes=12,
            chain=False,
            max_batch=8,
            max_tokens=256,
            device=torch.device("cpu"),
        )
        for _ in range(2)
    ]
    if joined:
        sent: list[np.ndarray] = []
        budgets[0].agree = lambda values: sent.append(np.array(values)) or values
        budgets[1].agree = lambda values: sent.pop(0)
    return budgets


def decisions_of_ranks(budgets: list) -> list[list]:
    """Each rank's calibration passes and per-step decisions (plan, chains alone, counts), with
    rank 1's clock three times slower and noisier than rank 0's."""
    rng = np.random.default_rng(0)
    passes: list[list[int]] = [[], []]
    for rank, budget in enumerate(budgets):
        slow = 1.0 + 2.0 * rank

        def time_pass(tokens: int, scale: float, rank: int = rank, slow: float = slow) -> float:
            passes[rank].append(tokens)
            return slow * scale * (1.0 + tokens / 16)

        budget.calibrate(
            lambda t, context: (time_pass(t, 0.02), 1.0), lambda t: time_pass(t, 0.002), long_context=512
        )
    decisions: list[list] = [[p] for p in passes]
    for step in range(40):
        batch = 1 + step % 5
        values = torch.tensor(rng.uniform(0.05, 1.0, (batch, 12))).sort(dim=1, descending=True).values.log()
        depths = torch.arange(1, 13).repeat(batch, 1).clamp(max=4)
        reach = np.cumprod(rng.uniform(0.3, 0.95, (batch, 8)), axis=1)
        for rank, budget in enumerate(budgets):
            times = budget.learn(batch * 4, verifies=step % 2 == 1)
            # and the step before's passes, on this rank's own clock
            slow = (1.0 + 2.0 * rank) * rng.uniform(0.8, 1.6)
            seconds = slow * 0.02 * (1 + batch * 4 / 16)
            budget.prices.observe_target(batch * 4, seconds, verifies=step % 2 == 1)
            budget.prices.observe_level(batch * 3, slow * 0.002)
            share = budget.plan(batch)
            alone = share.chains_alone_pay(reach) if share.plan.drafts else None
            counts = share.allocate(values, depths, torch.ones(batch, dtype=torch.bool)).tolist()
            times.drafts_sent(share.plan, counts)
            decisions[rank].append((share.plan, alone, counts))
    return decisions


def test_ranks_with_different_timings_take_the_same_decisions(monkeypatch):
    monkeypatch.delenv("VLLM_EAGLE2_STEP_COSTS", raising=False)
    apart = decisions_of_ranks(rank_budgets(joined=False))
    assert apart[0] != apart[1]  # alone, the slow rank plans other trees (and stops calibrating sooner)
    together = decisions_of_ranks(rank_budgets(joined=True))
    assert together[0] == together[1]
    assert any(plan.drafts for plan, _, _ in together[0][1:])  # the decisions agreed on drafting


# --- the budget's clock on CUDA -----------------------------------------------------------------


class FakeEvent:
    """A CUDA event stand-in on a fake clock: recorded at the clock's time, done at once."""

    now = [0.0]

    def __init__(self, enable_timing: bool = True) -> None:
        self.at = None

    def record(self) -> None:
        self.at = FakeEvent.now[0]

    def query(self) -> bool:
        return True

    def elapsed_time(self, end: FakeEvent) -> float:
        return (end.at - self.at) * 1e3  # ms, as CUDA's


def test_the_cuda_clock_resolves_every_step_and_a_plain_steps_overhead_excludes_its_pass(monkeypatch):
    """Steps without drafts (no drafter sync): each step's events resolve at the next one's start,
    so pending events stay bounded and the overhead learns what is not the target pass."""
    from vllm_eagle2.budget import adaptive
    from vllm_eagle2.budget.adaptive import AdaptiveBudget

    monkeypatch.delenv("VLLM_EAGLE2_STEP_COSTS", raising=False)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(adaptive.time, "perf_counter", lambda: FakeEvent.now[0])
    budget = AdaptiveBudget(
        depth=2, topk=2, max_nodes=4, chain=False, max_batch=4, max_tokens=64, device=torch.device("cpu")
    )
    budget.clock.cuda = True
    budget.calibrate(lambda tokens, context: (0.05, 1.0), lambda rows: 0.005)
    for _ in range(60):
        times = budget.learn(4)
        FakeEvent.now[0] += 0.05  # the target pass, waited for on the host (vLLM's sync)
        times.target_done()
        FakeEvent.now[0] += 0.01  # the rest of the step, on the host
        times.drafts_sent(NO_DRAFTS, [0, 0, 0, 0])
        FakeEvent.now[0] += 0.002  # between steps
    assert len(budget.clock.pending) <= 1
    assert budget.prices.overhead == pytest.approx(0.01, rel=0.05)  # not the pass's 0.05 on top


def test_a_steps_own_timings_move_the_prices_only_once_the_next_step_starts(monkeypatch):
    """A draft level timed far slower mid-step changes nothing of this step's allocation (under
    tensor parallelism each rank times its own levels): the next step prices it."""
    from vllm_eagle2.budget import adaptive

    monkeypatch.delenv("VLLM_EAGLE2_STEP_COSTS", raising=False)
    now = fake_clock(monkeypatch)
    seen = []
    monkeypatch.setattr(
        adaptive, "allocate_nodes", lambda *args, **kwargs: seen.append(args[4]) or args[2].long()
    )
    budget = rank_budgets(joined=False)[0]
    budget.calibrate(lambda tokens, context: (0.02 * (1 + tokens / 16), 1.0), lambda rows: 0.002)
    values, depths = torch.full((2, 12), 0.5).log(), torch.ones(2, 12, dtype=torch.long)
    args = (values, depths, torch.ones(2, dtype=torch.bool))
    times = budget.learn(2)
    share = budget.plan(2)
    share.allocate(*args)
    times.level_started(6)
    now[0] += 5.0
    times.drafting_done()
    share.allocate(*args)
    assert torch.equal(seen[0], seen[1])
    times.drafts_sent(share.plan, [2, 2])
    budget.learn(2)
    budget.plan(2).allocate(*args)
    assert not torch.equal(seen[0], seen[2])
