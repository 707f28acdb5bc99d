"""medfed.compare_stats on a fixed small table: values by hand and by scipy's own tests (t.interval, ttest_rel, rankdata);
the intervals' coverage on simulated comparisons whose sites share their seed.

The table: settings A and B (and C, with a method missing), methods fedavg,
local and ditto, seeds 0-2, sites s0 and s1. In A local and ditto are close
and both clearly above fedavg; in B ditto and fedavg are close and local is
clearly below them.
"""

import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

from medfed.compare_stats import (
    INTERVALS,
    average_ranks,
    coverage,
    holm_rejected,
    paired_difference,
    plateau_status,
    seed_values,
    site_values,
    summarise,
    t_interval,
    table_statistics,
    validation_curve,
    worst_site_values,
    lower_is_better,
)

REPOSITORY = Path(__file__).resolve().parents[1]
METHODS, SEEDS, SITES = ["fedavg", "local", "ditto"], [0, 1, 2], ["s0", "s1"]
TABLE = {  # setting -> method -> per seed (s0, s1)
    "A": {
        "fedavg": [(0.60, 0.70), (0.62, 0.66), (0.58, 0.72)],
        "local": [(0.70, 0.80), (0.71, 0.79), (0.69, 0.83)],
        "ditto": [(0.70, 0.79), (0.73, 0.75), (0.66, 0.84)],
    },
    "B": {
        "fedavg": [(0.50, 0.52), (0.51, 0.49), (0.50, 0.50)],
        "local": [(0.50, 0.40), (0.45, 0.43), (0.47, 0.41)],
        "ditto": [(0.503, 0.52), (0.51, 0.47), (0.55, 0.50)],
    },
}


def long_table(table=TABLE, column="selected_iou"):
    """compare's row shape: one row per (setting, method, seed, site)."""
    return [
        {"config": setting, "strategy": method, "seed": seed, "site": site, column: value, "wall_s": 1.0}
        for setting, methods in table.items()
        for method, per_seed in methods.items()
        for seed, values in zip(SEEDS, per_seed)
        for site, value in zip(SITES, values)
    ]


def pairs(setting, method, other):
    """``(method values, other values)`` on the same (seed, site) order, for scipy."""
    a = np.array(TABLE[setting][method]).ravel()
    b = np.array(TABLE[setting][other]).ravel()
    return a, b


def seed_means(setting, method):
    """Each seed's mean over its sites."""
    return np.array(TABLE[setting][method]).mean(axis=1)


def test_t_interval_is_mean_plus_minus_the_t_quantile_times_the_standard_error():
    low, high = t_interval([0.5, 0.6, 0.7])
    half = 4.302652729749464 * 0.1 / math.sqrt(3)  # t(0.975, 2) = 4.3027, s = 0.1
    assert (low, high) == pytest.approx((0.6 - half, 0.6 + half), abs=1e-12)
    assert (low, high) == pytest.approx((0.351586, 0.848414), abs=1e-6)
    assert all(math.isnan(v) for v in t_interval([0.5])) and t_interval([0.4, 0.4]) == (0.4, 0.4)


def test_a_cell_is_mean_std_and_t_interval_over_seeds_of_the_mean_over_sites():
    per_seed = seed_values(long_table(), "selected_iou")
    assert per_seed[("A", "fedavg")] == pytest.approx({0: 0.65, 1: 0.64, 2: 0.65})
    result = table_statistics(long_table(), "selected_iou", ["A", "B"], METHODS, "fedavg")
    for setting in TABLE:
        for method in METHODS:
            run_values = seed_means(setting, method)
            summary = result.cells[(setting, method)].summary
            sem = stats.sem(run_values)
            assert summary.n == 3
            assert summary.mean == pytest.approx(run_values.mean(), abs=1e-12)
            assert summary.std == pytest.approx(np.std(run_values, ddof=1), abs=1e-12)
            assert (summary.low, summary.high) == pytest.approx(stats.t.interval(0.95, 2, loc=run_values.mean(), scale=sem), abs=1e-12)
    fedavg_a = result.cells[("A", "fedavg")].summary  # by hand: run values 0.65, 0.64, 0.65
    assert fedavg_a.mean == pytest.approx(0.646667, abs=1e-6) and fedavg_a.std == pytest.approx(0.005774, abs=1e-6)


def test_the_worst_site_is_each_seeds_lowest_site_summarised_over_seeds():
    assert worst_site_values(long_table(), "selected_iou")[("A", "ditto")] == pytest.approx({0: 0.70, 1: 0.73, 2: 0.66})
    worst = table_statistics(long_table(), "selected_iou", ["A", "B"], METHODS, "fedavg").cells[("B", "local")].worst
    assert worst.n == 3 and worst.mean == pytest.approx(np.mean([0.40, 0.43, 0.41]), abs=1e-12)  # by hand: s1 each seed


def test_paired_differences_are_over_seeds_agree_with_ttest_rel_of_the_seed_means_and_count_wins_ties_losses():
    result = table_statistics(long_table(), "selected_iou", ["A", "B"], METHODS, "fedavg")
    for setting in TABLE:
        for method in METHODS:
            a, b = seed_means(setting, method), seed_means(setting, "fedavg")
            paired = result.cells[(setting, method)].versus_reference
            assert paired.n == 3 and paired.pairs == 6 and paired.mean == pytest.approx((a - b).mean(), abs=1e-12)
            if method != "fedavg":
                reference = stats.ttest_rel(a, b)
                assert (paired.low, paired.high) == pytest.approx(tuple(reference.confidence_interval(0.95)), abs=1e-12)
                assert paired.p_value == pytest.approx(reference.pvalue, abs=1e-12)
    # by hand: A local - fedavg per seed: (0.75 - 0.65, 0.75 - 0.64, 0.76 - 0.65) = (0.10, 0.11, 0.11)
    local_a = result.cells[("A", "local")].versus_reference
    half = stats.t.ppf(0.975, 2) * np.std([0.10, 0.11, 0.11], ddof=1) / math.sqrt(3)
    assert (local_a.low, local_a.high) == pytest.approx((0.106667 - half, 0.106667 + half), abs=1e-6)
    # W/T/L over the (seed, site) pairs, tie = |d| <= 0.005: ditto - fedavg in B are 0.003, 0, 0, -0.02, 0.05, 0
    counts = lambda setting, method: (lambda p: (p.wins, p.ties, p.losses))(result.cells[(setting, method)].versus_reference)  # noqa: E731
    assert counts("B", "ditto") == (1, 4, 1)
    assert counts("A", "local") == (6, 0, 0) and counts("B", "local") == (0, 1, 5)
    assert counts("A", "fedavg") == (0, 6, 0)  # the reference against itself: every pair a tie, interval [0, 0], p 1
    itself = result.cells[("A", "fedavg")].versus_reference
    assert (itself.low, itself.high, itself.p_value) == (0.0, 0.0, 1.0)


def test_the_seed_level_interval_is_wider_than_the_pair_level_one_when_a_seeds_sites_move_together():
    # both sites of a seed move together (one federation): 6 pairs, but only 3 independent draws
    table = {"A": {"fedavg": [(0.6, 0.6), (0.6, 0.6), (0.6, 0.6)], "ditto": [(0.62, 0.621), (0.60, 0.601), (0.64, 0.641)]}}
    paired = table_statistics(long_table(table), "selected_iou", ["A"], ["fedavg", "ditto"], "fedavg").cells[("A", "ditto")].versus_reference
    naive = stats.ttest_rel(np.array(table["A"]["ditto"]).ravel(), np.array(table["A"]["fedavg"]).ravel()).confidence_interval(0.95)
    assert naive.low > 0 >= paired.low  # the pairs' t calls it a difference; the seeds' does not
    assert paired.high - paired.low > 2 * (naive.high - naive.low)


def test_the_tie_tolerance_is_inclusive_and_zero_counts_only_exact_ties():
    d = [0.01, -0.01, 0.0, 0.02, -0.03]
    assert (lambda p: (p.wins, p.ties, p.losses))(paired_difference([0.0], d, tolerance=0.01)) == (1, 3, 1)
    assert (lambda p: (p.wins, p.ties, p.losses))(paired_difference([0.0], d, tolerance=0.0)) == (2, 1, 2)


def test_average_ranks_over_settings_with_ties_averaged_as_rankdata():
    result = table_statistics(long_table(), "selected_iou", ["A", "B"], METHODS, "fedavg")
    # by hand: A (means 0.6467, 0.7533, 0.745): local 1, ditto 2, fedavg 3; B (0.5033, 0.4433, 0.5088): ditto 1, fedavg 2, local 3
    assert result.ranks == pytest.approx({"fedavg": 2.5, "local": 2.0, "ditto": 1.5}) and result.ranked == ["A", "B"]
    means = {("A", "x"): 0.7, ("A", "y"): 0.7, ("A", "z"): 0.6, ("B", "x"): 0.1, ("B", "y"): 0.3, ("B", "z"): 0.2}
    ranks, _ = average_ranks(means, ["A", "B"], ["x", "y", "z"])
    expected = np.mean([stats.rankdata([-0.7, -0.7, -0.6]), stats.rankdata([-0.1, -0.3, -0.2])], axis=0)
    assert [ranks[m] for m in "xyz"] == pytest.approx(list(expected)) == [2.25, 1.25, 2.5]


def test_holm_rejects_step_down_against_alpha_over_the_hypotheses_left():
    # by hand, alpha 0.05, M = 4: sorted 0.001 <= 0.0125, 0.013 <= 0.0167, 0.03 > 0.025: stop (0.04 kept too)
    assert holm_rejected({"a": 0.03, "b": 0.001, "c": 0.04, "d": 0.013}) == {"b", "d"}
    assert holm_rejected({"a": 0.03, "b": 0.03}) == set()  # 0.03 > 0.05 / 2
    assert holm_rejected({"a": 0.02, "b": 0.02}) == {"a", "b"}  # 0.02 <= 0.05 / 2, then 0.02 <= 0.05 / 1
    assert holm_rejected({"a": 0.02}) == {"a"} and holm_rejected({"a": math.nan, "b": 0.04}) == set()  # nan counts in M: 0.04 > 0.05 / 2


def test_the_best_group_keeps_the_methods_holm_does_not_call_worse_than_the_best():
    result = table_statistics(long_table(), "selected_iou", ["A", "B"], METHODS, "fedavg")
    assert result.best == {"A": "local", "B": "ditto"}
    for setting in TABLE:
        best = result.best[setting]
        p = {m: stats.ttest_rel(seed_means(setting, m), seed_means(setting, best)).pvalue for m in METHODS if m != best}
        ordered = sorted(p, key=p.get)
        rejected, still = set(), True
        for k, m in enumerate(ordered):  # Holm by hand
            still = still and p[m] <= 0.05 / (len(p) - k)
            if still:
                rejected.add(m)
        for method in METHODS:
            assert result.cells[(setting, method)].with_best == (method not in rejected)
    # ditto is 0.005-0.01 below local on every seed (0.745, 0.74, 0.75 against 0.75, 0.75, 0.76): rejected
    assert {m for m in METHODS if result.cells[("A", m)].with_best} == {"local"}
    assert {m for m in METHODS if result.cells[("B", m)].with_best} == {"ditto", "fedavg"}


def test_multiplicity_widens_the_best_group_beyond_the_uncorrected_tests():
    # six methods below the best by 0.02, 0.015, 0.025 on the three seeds: each paired t gives p = 0.020, under 0.05
    # but over Holm's 0.05 / 6 for the smallest: none is called worse than the best
    best = [(0.80, 0.80), (0.81, 0.81), (0.79, 0.79)]
    below = [(0.78, 0.78), (0.795, 0.795), (0.765, 0.765)]
    table = {"A": {"best": best, **{f"m{k}": below for k in range(6)}}}
    methods = list(table["A"])
    p = stats.ttest_rel([0.78, 0.795, 0.765], [0.80, 0.81, 0.79]).pvalue
    assert 0.05 / 6 < p < 0.05
    result = table_statistics(long_table(table), "selected_iou", ["A"], methods, "best")
    assert all(result.cells[("A", m)].versus_reference.p_value == pytest.approx(p) for m in methods[1:])
    assert all(result.cells[("A", m)].with_best for m in methods)
    alone = table_statistics(long_table({"A": {"best": best, "m0": below}}), "selected_iou", ["A"], ["best", "m0"], "best")
    assert not alone.cells[("A", "m0")].with_best  # one test: p 0.02 < 0.05, rejected


@pytest.mark.parametrize("correlation", [0.0, 0.1, 0.3, 0.7])
def test_coverage_of_the_intervals_at_intra_seed_correlations(correlation):
    """The coverage test that chose the seed-level t: 5 seeds x 5 sites, true difference 0 (the same algorithm twice).

    The seed-level t keeps 95% at every correlation; the pair-level t (the old tables') falls with it; the seed
    bootstrap undercovers with 5 seeds at any correlation."""
    assert INTERVALS == ("pairs_t", "seeds_t", "seed_bootstrap")
    pairs_t, seeds_t = (coverage(method, 5, 5, correlation, replicates=4000) for method in INTERVALS[:2])  # standard error 0.0034
    bootstrap = coverage("seed_bootstrap", 5, 5, correlation, replicates=600)  # its resamples are the cost
    assert abs(seeds_t - 0.95) < 0.015
    assert bootstrap < 0.9
    if correlation == 0.0:
        assert abs(pairs_t - 0.95) < 0.015  # independent sites: both t intervals are right
    else:
        assert pairs_t < {0.1: 0.93, 0.3: 0.85, 0.7: 0.70}[correlation]


def test_of_equal_best_means_the_first_method_of_the_grid_is_the_best():
    table = {"A": {"fedavg": [(0.5, 0.7)] * 3, "local": [(0.7, 0.5)] * 3}}
    result = table_statistics(long_table(table), "selected_iou", ["A"], ["local", "fedavg"], "fedavg")
    assert result.best == {"A": "local"} and result.ranks == {"local": 1.5, "fedavg": 1.5}


def test_missing_values_are_left_out_and_a_setting_missing_a_method_is_left_out_of_the_ranks():
    rows = long_table()
    rows[0]["selected_iou"] = None  # A/fedavg/seed0/s0
    rows += [row | {"config": "C"} for row in long_table({"C": {m: TABLE["A"][m] for m in ("fedavg", "local")}})]
    rows += [row | {"config": "D"} for row in long_table({"D": {m: TABLE["A"][m] for m in ("local", "ditto")}})]
    assert (0, "s0") not in site_values(rows, "selected_iou")[("A", "fedavg")]
    result = table_statistics(rows, "selected_iou", ["A", "B", "C", "D"], METHODS, "fedavg")
    assert result.cells[("A", "fedavg")].summary.mean == pytest.approx(np.mean([0.70, 0.64, 0.65]))  # seed 0: s1 alone
    local = result.cells[("A", "local")].versus_reference
    assert local.pairs == 5 and local.n == 3  # the pair without a reference value is dropped; seed 0 pairs on s1 alone
    assert local.mean == pytest.approx(np.mean([0.80 - 0.70, 0.75 - 0.64, 0.76 - 0.65]))
    empty = result.cells[("C", "ditto")].summary
    assert empty.n == 0 and all(math.isnan(v) for v in (empty.mean, empty.std, empty.low, empty.high))
    assert result.cells[("C", "ditto")].versus_reference is None and not result.cells[("C", "ditto")].with_best
    assert result.cells[("D", "local")].versus_reference is None  # no reference in D
    assert result.ranked == ["A", "B"] and result.best["C"] == "local"


def test_one_seed_has_a_mean_but_no_std_or_interval():
    summary = summarise([0.7])
    assert summary.n == 1 and summary.mean == 0.7 and all(math.isnan(v) for v in (summary.std, summary.low, summary.high))
    assert summarise([]).n == 0


@pytest.mark.parametrize(
    "curve, status",
    [
        ([0.5, 0.6, 0.7], "early"),  # 3 rounds < k + 1 = 4
        ([0.5, 0.6, 0.7, 0.7], "improving"),  # last 3 reach 0.7 > 0.5 + 0.01
        ([0.5, 0.8, 0.79, 0.805, 0.80], "plateaued"),  # 0.805 <= 0.8 + 0.01
        ([0.5, 0.8, 0.79, 0.811, 0.80], "improving"),  # 0.811 > 0.81
        ([0.5, 0.9, 0.8, 0.7, 0.6], "plateaued"),  # getting worse: not improving
    ],
)
def test_plateau_compares_the_best_of_the_last_k_rounds_with_the_best_before_them(curve, status):
    assert plateau_status(curve, rounds=3, tolerance=0.01) == status


def test_plateau_with_zero_tolerance_counts_an_equal_best_as_stopped_and_defaults_to_five_rounds():
    assert plateau_status([0.5, 0.8, 0.8, 0.8, 0.8], rounds=3, tolerance=0.0) == "plateaued"
    assert plateau_status([0.5, 0.8, 0.8, 0.8, 0.8001], rounds=3, tolerance=0.0) == "improving"
    assert plateau_status([0.1, 0.2, 0.3, 0.4, 0.5]) == "early"  # 5 rounds, k = 5 needs 6
    assert plateau_status([0.8, 0.2, 0.3, 0.4, 0.5, 0.6]) == "plateaued"
    with pytest.raises(ValueError, match="rounds = 0"):
        plateau_status([0.1, 0.2], rounds=0)


def test_validation_curve_is_the_mean_over_sites_skipping_missing_scores_and_rounds_without_any():
    history = [
        {"round": 1, "validation": {"s0": {"auroc": 0.6}, "s1": {"auroc": 0.8}}},
        {"round": 2, "validation": {"s0": {"auroc": float("nan")}, "s1": {"auroc": 0.9}}},
        {"round": 3, "validation": {"s0": {"auroc": None}, "s1": {}}},
        {"round": 4},
        {"round": 5, "validation": {"s0": {"auroc": 0.7}, "s1": {"auroc": 0.7, "iou": 0.1}}},
    ]
    assert validation_curve(history, "auroc") == pytest.approx([0.7, 0.9, 0.7])


def test_the_module_imports_without_torch():
    code = "import sys, medfed.compare_stats; sys.exit('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], cwd=REPOSITORY, env={"PYTHONPATH": str(REPOSITORY)}, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_a_distance_is_better_lower_its_best_ranks_worst_site_and_wins_turned_round():
    # HD95 in mm: the same numbers as an IoU table read the other way (medfed ranked HD95 columns as if higher were better)
    distance = long_table(column="last_hd95_wt")
    score = long_table(column="last_iou")
    assert lower_is_better("last_hd95_wt") and lower_is_better("selected_lesion_hd95_et") and not lower_is_better("last_iou")
    low = table_statistics(distance, "last_hd95_wt", ["A", "B"], METHODS, "fedavg")
    high = table_statistics(score, "last_iou", ["A", "B"], METHODS, "fedavg")
    for setting in ("A", "B"):
        means = {m: high.cells[(setting, m)].summary.mean for m in METHODS}
        assert low.best[setting] == min(means, key=means.get) and high.best[setting] == max(means, key=means.get)
    # ranks reversed: with 3 methods a rank r becomes 4 - r in each setting, so the averages too
    assert {m: 4 - r for m, r in low.ranks.items()} == pytest.approx(high.ranks)
    # the worst site of a distance is each seed's highest value
    by_hand = {seed: max(values) for seed, values in zip(SEEDS, TABLE["B"]["local"])}
    assert low.cells[("B", "local")].worst.mean == pytest.approx(np.mean(list(by_hand.values())))
    # a win is a lower value: the counts swap, the difference keeps its sign
    for m in METHODS:
        a, b = low.cells[("A", m)].versus_reference, high.cells[("A", m)].versus_reference
        assert (a.wins, a.ties, a.losses, a.mean) == (b.losses, b.ties, b.wins, pytest.approx(b.mean))
