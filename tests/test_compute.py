"""Compute accounting: the samples each site passes per plan, auxiliary pass and evaluation, against hand counts.

The sites have 37, 45 and 53 training samples and the batch size is 8, which
divides none of them: a pass over a site is B = ceil(n / 8) batches whose
last one holds n mod 8 = 5 samples, and a plan cut at k < B steps passes 8k
samples, not k/B of an epoch.
"""

import math

import pytest

from medfed.federated.compute import compute_summary, training_epochs
from medfed.federated.loop import _flatten_for_logging
from toy_federation import one_torch_thread  # noqa: F401 (autouse fixture)
from toy_federation import LinearClassifier, build_loop, seeded, two_group_federation

BATCH = 8
N_TEST = 48


def _loop(name, options=None, participation=1.0, local_epochs=1):
    federation = two_group_federation(n_sites=3, n_train=37, n_test=N_TEST)
    return build_loop(name, federation, seeded(LinearClassifier, 4, 2), options, participation=participation,
                      local_epochs=local_epochs, batch_size=BATCH)


def _sizes(loop):
    return {site.name: site.n_train for site in loop.sites}


def _fresh_pass(n, steps):
    """Samples in the first ``steps`` batches of a pass over n samples (batches of BATCH, the last one short)."""
    return sum(min(BATCH, n - BATCH * k) for k in range(steps))


def _batches(n):
    return math.ceil(n / BATCH)


def test_a_one_plan_strategy_counts_its_epochs_and_its_evaluation():
    loop = _loop("fedavg", local_epochs=2)
    loop.fit(2)
    for record in loop.history:
        assert set(record["compute"]) == set(loop.site_names)
        for name, n in _sizes(loop).items():  # two whole passes: every sample twice
            assert record["compute"][name] == {"train/fit/model": 2.0, "evaluation": N_TEST / n}
    assert [site.n_train for site in loop.sites] == [37, 45, 53]


def test_sites_that_skip_a_round_count_only_their_evaluation():
    loop = _loop("fedavg", participation=2 / 3)
    loop.fit(2)
    for record in loop.history:
        for name, n in _sizes(loop).items():
            expected = {"evaluation": N_TEST / n}
            if name in record["participants"]:
                expected["train/fit/model"] = 1.0
            assert record["compute"][name] == expected


def test_pfednets_two_half_epoch_phases_count_the_batches_they_pass():
    loop = _loop("pfednet", {"schedule": "alternating"})
    loop.fit(2)
    for name, n in _sizes(loop).items():
        b = _batches(n)
        first = math.floor(b * 0.5 + 0.5)  # the shared phase's steps: the first of a fresh pass
        shared, personal = _fresh_pass(n, first), _fresh_pass(n, b - first)  # the personal phase: a fresh pass too
        assert shared + personal == BATCH * b > n  # two cut passes cost more than one epoch
        for record in loop.history:
            assert record["compute"][name] == {
                "train/shared/model": shared / n, "train/personal/model": personal / n, "evaluation": N_TEST / n,
            }


def _half(n, k=1):
    """Steps of the k-th half epoch of a site's budget axis: [k B / 2] - [(k - 1) B / 2], [x] = floor(x + 1/2)."""
    return math.floor(_batches(n) * 0.5 * k + 0.5) - math.floor(_batches(n) * 0.5 * (k - 1) + 0.5)


def test_dittos_global_and_personal_plans_are_counted_apart():
    loop = _loop("ditto", {"personal_steps": 3})
    loop.fit(4)
    assert any(_batches(n) % 2 for n in _sizes(loop).values())  # an odd B: its half epochs alternate [B / 2] + 1 and [B / 2] steps
    for name, n in _sizes(loop).items():
        for k, record in enumerate(loop.history, start=1):
            global_ = _fresh_pass(n, _half(n, k)) / n  # the global plan: the k-th half epoch, the first steps of a fresh pass
            assert record["compute"][name] == {
                "train/fit/global": global_, "train/fit/personal": 3 * BATCH / n, "evaluation": N_TEST / n,
            }
            assert training_epochs(record["compute"][name]) == global_ + 3 * BATCH / n


@pytest.mark.parametrize("inner_steps", [1, 2, 5])
def test_pfedmes_inner_steps_count_against_the_budget(inner_steps):
    """ceil(B / K) local rounds on the first mini-batches of a pass; each takes min(K, [left / m]) >= 1 inner passes of
    its m samples, left = the samples of the epoch not yet passed, [x] = floor(x + 1/2)."""
    loop = _loop("pfedme", {"lam": 1.0, "inner_steps": inner_steps})
    loop.fit(2)
    for name, n in _sizes(loop).items():
        left = n
        for step in range(math.ceil(_batches(n) / inner_steps)):
            m = _fresh_pass(n, step + 1) - _fresh_pass(n, step)
            left -= m * max(1, min(inner_steps, math.floor(left / m + 0.5)))
        assert abs(left) <= BATCH / 2  # the epoch, to within half a mini-batch
        for record in loop.history:
            assert record["compute"][name] == {"train/fit/local": (n - left) / n, "evaluation": N_TEST / n}


def test_pfedmes_published_preset_passes_k_times_every_mini_batch_of_the_epochs():
    loop = _loop("pfedme", {"lam": 1.0, "inner_steps": 5, "preset": "published"})
    loop.fit(1)
    for name, n in _sizes(loop).items():
        assert loop.history[0]["compute"][name] == {"train/fit/local": 5.0, "evaluation": N_TEST / n}


def test_auxiliary_and_forward_passes_are_counted_apart_from_the_plans():
    pgfed, apfl, ifca = _loop("pgfed"), _loop("apfl"), _loop("ifca", {"clusters": 3})
    for loop in (pgfed, apfl, ifca):
        loop.fit(1)
    for name in pgfed.site_names:
        n = _sizes(pgfed)[name]
        # PGFed: every round also estimates f and grad f over the whole training split
        assert pgfed.history[0]["compute"][name] == {"train/fit/model": 1.0, "aux/gradient_estimate": 1.0, "evaluation": N_TEST / n}
        # APFL: each step also steps the local model on the mixture, a second pass of the batch (half the budget's steps)
        assert apfl.history[0]["compute"][name] == {"train/fit/global": 2 * _fresh_pass(n, _half(n)) / n, "evaluation": N_TEST / n}
        # IFCA: the cluster estimate is k forward passes over the training split (evaluation batches)
        assert ifca.history[0]["compute"][name] == {"train/fit/model": 1.0, "forward/cluster_choice": 3.0, "evaluation": N_TEST / n}
    # the budget counts the training plans; PGFed's estimate is reported beside it
    summary = compute_summary(pgfed.history, pgfed.site_names)
    assert summary["mean_training_epochs_per_round"] == 1.0 and summary["mean_auxiliary_epochs_per_round"] == 1.0
    assert summary["mean_forward_epochs_per_round"] == 0.0
    # IFCA's forward-only cluster choice is summarised too, and a comparison's cost column shows both beside the budget
    summary = compute_summary(ifca.history, ifca.site_names)
    assert summary["mean_forward_epochs_per_round"] == 3.0 and summary["mean_auxiliary_epochs_per_round"] == 0.0
    from pathlib import Path

    from medfed.compare.plan import Run
    from medfed.compare.tables import Finished, compute_cells

    def finished(strategy, loop):
        run = Run("s", Path("s.yaml"), strategy, 0, Path("o"), (), 1, Path("l"), "done")
        return Finished(run, {"compute": compute_summary(loop.history, loop.site_names), "timing": {"wall_s": 12.0}})

    cells = compute_cells([finished("ifca", ifca), finished("pgfed", pgfed)])
    assert cells == {("s", "ifca"): "1.00 +3.00 fwd · 12 s", ("s", "pgfed"): "1.00 +1.00 aux · 12 s"}


def test_the_results_summary_adds_up_the_rounds_and_the_loggers_see_each_count():
    loop = _loop("ditto", {"personal_steps": 3}, participation=2 / 3)
    loop.fit(3)
    summary = compute_summary(loop.history, loop.site_names)
    sizes = _sizes(loop)
    rounds_in = {name: sum(name in r["participants"] for r in loop.history) for name in loop.site_names}
    for name, n in sizes.items():
        assert [entry["round"] for entry in summary["per_round"][name]] == [1, 2, 3]  # evaluated every round
        totals = summary["totals"][name]
        global_ = sum(_fresh_pass(n, _half(n, k)) for k in range(1, rounds_in[name] + 1)) / n  # the axis moves when it trains
        assert totals["train/fit/global"] == pytest.approx(global_)
        assert totals["train/fit/personal"] == pytest.approx(rounds_in[name] * 3 * BATCH / n)
        assert totals["evaluation"] == pytest.approx(3 * N_TEST / n)
        assert summary["training_epochs"][name] == pytest.approx(global_ + rounds_in[name] * 3 * BATCH / n)
        assert summary["training_rounds"][name] == rounds_in[name]
        assert summary["auxiliary_epochs"][name] == 0.0
    assert summary["per_plan"]["train/fit/global"] == pytest.approx(
        sum(_fresh_pass(n, _half(n, k)) / n for m, n in sizes.items() for k in range(1, rounds_in[m] + 1)) / 3
    )
    # per (site, round) a site trained in: the skipped rounds do not dilute it
    assert summary["mean_training_epochs_per_round"] == pytest.approx(sum(summary["training_epochs"].values()) / sum(rounds_in.values()))
    flat = _flatten_for_logging(loop.history[-1])
    for name, counts in loop.history[-1]["compute"].items():
        assert flat[f"{name}/compute/training_epochs"] == training_epochs(counts)
        for key, epochs in counts.items():
            assert flat[f"{name}/compute/{key}"] == epochs


def test_a_half_epoch_plan_at_an_odd_number_of_batches_takes_half_an_epoch_on_average_over_the_rounds():
    # APFL: each step passes its batch twice, so it takes half the budget's steps; with B = 5 full batches a round
    # cannot take 2.5 steps: the site's budget axis runs over the rounds, 3, 2, 3, 2 steps, FedAvg's epochs on average
    federation = two_group_federation(n_sites=3, n_train=40, n_test=N_TEST)
    apfl = build_loop("apfl", federation, seeded(LinearClassifier, 4, 2), batch_size=BATCH)
    apfl.fit(4)
    assert [_batches(n) for n in _sizes(apfl).values()] == [5, 6, 7]  # full batches (40, 48 and 56 samples)
    for name, n in _sizes(apfl).items():
        per_round = [record["compute"][name]["train/fit/global"] for record in apfl.history]
        assert per_round == pytest.approx([2 * _half(n, k) * BATCH / n for k in range(1, 5)])  # B = 5: 1.2, 0.8, 1.2, 0.8
        assert compute_summary(apfl.history, apfl.site_names)["training_epochs"][name] == pytest.approx(4.0)
        assert apfl.sites[apfl.site_names.index(name)].budget_epochs == pytest.approx(4 * 0.5)
