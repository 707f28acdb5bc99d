"""medfed.compare_stats on a fixed small table: values by hand and by scipy's own tests (t.interval, ttest_rel, rankdata).

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
    average_ranks,
    paired_difference,
    plateau_status,
    seed_values,
    site_values,
    summarise,
    t_interval,
    table_statistics,
    validation_curve,
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
            run_values = np.array(TABLE[setting][method]).mean(axis=1)
            summary = result.cells[(setting, method)].summary
            sem = stats.sem(run_values)
            assert summary.n == 3
            assert summary.mean == pytest.approx(run_values.mean(), abs=1e-12)
            assert summary.std == pytest.approx(np.std(run_values, ddof=1), abs=1e-12)
            assert (summary.low, summary.high) == pytest.approx(stats.t.interval(0.95, 2, loc=run_values.mean(), scale=sem), abs=1e-12)
    fedavg_a = result.cells[("A", "fedavg")].summary  # by hand: run values 0.65, 0.64, 0.65
    assert fedavg_a.mean == pytest.approx(0.646667, abs=1e-6) and fedavg_a.std == pytest.approx(0.005774, abs=1e-6)


def test_paired_differences_against_the_reference_agree_with_ttest_rel_and_count_wins_ties_losses():
    result = table_statistics(long_table(), "selected_iou", ["A", "B"], METHODS, "fedavg")
    for setting in TABLE:
        for method in METHODS:
            a, b = pairs(setting, method, "fedavg")
            paired = result.cells[(setting, method)].versus_reference
            assert paired.n == 6 and paired.mean == pytest.approx((a - b).mean(), abs=1e-12)
            if method != "fedavg":
                reference = stats.ttest_rel(a, b).confidence_interval(0.95)
                assert (paired.low, paired.high) == pytest.approx((reference.low, reference.high), abs=1e-12)
    # by hand, tie = |d| <= 0.005: differences of ditto - fedavg in B are 0.003, 0, 0, -0.02, 0.05, 0
    counts = lambda setting, method: (lambda p: (p.wins, p.ties, p.losses))(result.cells[(setting, method)].versus_reference)  # noqa: E731
    assert counts("B", "ditto") == (1, 4, 1)
    assert counts("A", "local") == (6, 0, 0) and counts("B", "local") == (0, 1, 5)
    assert counts("A", "fedavg") == (0, 6, 0)  # the reference against itself: every pair a tie, interval [0, 0]
    assert (result.cells[("A", "fedavg")].versus_reference.low, result.cells[("A", "fedavg")].versus_reference.high) == (0.0, 0.0)


def test_the_tie_tolerance_is_inclusive_and_zero_counts_only_exact_ties():
    d = [0.01, -0.01, 0.0, 0.02, -0.03]
    assert (lambda p: (p.wins, p.ties, p.losses))(paired_difference(d, tolerance=0.01)) == (1, 3, 1)
    assert (lambda p: (p.wins, p.ties, p.losses))(paired_difference(d, tolerance=0.0)) == (2, 1, 2)


def test_average_ranks_over_settings_with_ties_averaged_as_rankdata():
    result = table_statistics(long_table(), "selected_iou", ["A", "B"], METHODS, "fedavg")
    # by hand: A (means 0.6467, 0.7533, 0.745): local 1, ditto 2, fedavg 3; B (0.5033, 0.4433, 0.5088): ditto 1, fedavg 2, local 3
    assert result.ranks == pytest.approx({"fedavg": 2.5, "local": 2.0, "ditto": 1.5}) and result.ranked == ["A", "B"]
    means = {("A", "x"): 0.7, ("A", "y"): 0.7, ("A", "z"): 0.6, ("B", "x"): 0.1, ("B", "y"): 0.3, ("B", "z"): 0.2}
    ranks, _ = average_ranks(means, ["A", "B"], ["x", "y", "z"])
    expected = np.mean([stats.rankdata([-0.7, -0.7, -0.6]), stats.rankdata([-0.1, -0.3, -0.2])], axis=0)
    assert [ranks[m] for m in "xyz"] == pytest.approx(list(expected)) == [2.25, 1.25, 2.5]


def test_the_best_group_holds_the_methods_whose_paired_interval_against_the_best_contains_zero():
    result = table_statistics(long_table(), "selected_iou", ["A", "B"], METHODS, "fedavg")
    assert result.best == {"A": "local", "B": "ditto"}
    for setting in TABLE:
        best = result.best[setting]
        for method in METHODS:
            a, b = pairs(setting, method, best)
            # independent check: the 95% interval contains 0 exactly when the paired t test's p >= 0.05
            expected = method == best or stats.ttest_rel(a, b).pvalue >= 0.05
            assert result.cells[(setting, method)].with_best == expected
    assert {m for m in METHODS if result.cells[("A", m)].with_best} == {"local", "ditto"}
    assert {m for m in METHODS if result.cells[("B", m)].with_best} == {"ditto", "fedavg"}


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
    assert result.cells[("A", "local")].versus_reference.n == 5  # the pair without a reference value is dropped
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
