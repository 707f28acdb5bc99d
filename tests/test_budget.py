"""Equal compute: every registered strategy spends ``trainer.local_epochs`` of training passes per site and round.

The round records' ``compute`` (:mod:`medfed.federated.compute`) counts the
samples each plan passed; the ``train/*`` epochs are the budget
(:mod:`medfed.federated.strategies.base`). The toy sites have 40, 48, 56 and
64 training samples, batches of 2: 20 to 32 mini-batches an epoch, multiples
of 4, so that a quarter of an epoch (half of a budget of 0.5: Ditto's and
pFedNet's halves, APFL's steps of two passes) is a whole number of
mini-batches and the cut at whole mini-batches adds nothing the 5% could
hide; pFedMe's K = 5 divides none of them.
"""

import pytest

from medfed.data.pooling import POOL_SITE
from medfed.federated.compute import TRAIN, compute_summary, training_epochs
from medfed.federated.strategies import registered
from medfed.options.strategies import strategy_spec
from toy_federation import one_torch_thread  # noqa: F401 (autouse fixture)
from toy_federation import LinearClassifier, build_loop, seeded, two_group_federation, with_a_body

STRATEGIES = registered()

#: strategies whose plans split the budget (several plans, phases or passes a step), also checked at 2 epochs
SPLITTING = ("apfl", "ditto", "fedrep", "pfedme", "pfednet")
TOLERANCE = 0.05
BATCH = 2


def _run(name, local_epochs, options=None, rounds=2):
    model = with_a_body(name, LinearClassifier)
    federation = two_group_federation(n_sites=4, n_train=40)
    loop = build_loop(name, federation, seeded(model, 4, 2), {**strategy_spec(name).smoke, **(options or {})},
                      local_epochs=local_epochs, batch_size=BATCH)
    loop.fit(rounds)
    return loop


def _training_sites(loop):
    """The sites that train: all of them, except that a pooled run trains only the pool."""
    return [site.name for site in loop.sites if not loop.strategy.pools_data or site.index == POOL_SITE]


@pytest.mark.parametrize(
    ("name", "local_epochs"),
    [(name, budget) for name in sorted(STRATEGIES) for budget in (1.0, 0.5)] + [(name, 2.0) for name in SPLITTING],
)
def test_every_strategy_spends_the_budget_at_every_site_and_round(name, local_epochs):
    loop = _run(name, local_epochs)
    trainers = _training_sites(loop)
    assert [site.n_train for site in loop.sites][1:] == [48, 56, 64]
    for record in loop.history:
        for site in trainers:
            spent = training_epochs(record["compute"][site])
            assert spent == pytest.approx(local_epochs, rel=TOLERANCE), (site, record["round"], record["compute"][site])
        for site in set(loop.site_names) - set(trainers):
            assert training_epochs(record["compute"].get(site, {})) == 0.0
    summary = compute_summary(loop.history, loop.site_names)
    assert summary["mean_training_epochs_per_round"] == pytest.approx(local_epochs, rel=TOLERANCE)


@pytest.mark.parametrize(
    ("name", "options", "published"),
    [
        ("fedrep", {}, 3.0),  # head 2 E + body E
        ("ditto", {}, 2.0),  # global E + personal E
        ("apfl", {}, 2.0),  # a step per mini-batch, two passes each
        ("pfedme", {"inner_steps": 3}, 3.0),  # K passes per mini-batch of E epochs
        ("pfednet", {}, 2.0),  # each phase E
    ],
)
def test_the_published_preset_trains_the_papers_protocol(name, options, published):
    loop = _run(name, 1.0, {**options, "preset": "published"}, rounds=1)
    for site in loop.site_names:
        assert training_epochs(loop.history[0]["compute"][site]) == pytest.approx(published)


def test_a_splitting_strategys_plans_take_their_shares():
    fedrep = _run("fedrep", 1.5, rounds=1).history[0]["compute"]
    ditto = _run("ditto", 1.5, rounds=1).history[0]["compute"]
    for site, n in zip(("site0", "site3"), (40, 64)):
        b = n // BATCH
        head = round(b * 1.5 * 2 / 3) * BATCH / n  # 2/3 of the budget, whole mini-batches
        assert fedrep[site][f"{TRAIN}/fit/head"] == pytest.approx(head)
        assert fedrep[site][f"{TRAIN}/fit/body"] == pytest.approx(1.5 - head)
        assert ditto[site][f"{TRAIN}/fit/global"] == pytest.approx(ditto[site][f"{TRAIN}/fit/personal"], abs=BATCH / n)
        assert ditto[site][f"{TRAIN}/fit/global"] + ditto[site][f"{TRAIN}/fit/personal"] == pytest.approx(1.5)


def test_pfedmes_last_mini_batch_takes_the_passes_left():
    # 20 mini-batches an epoch at site0, K = 3: 20 passes are 7 local rounds of 3 x 6 + 2 inner steps
    loop = _run("pfedme", 1.0, {"inner_steps": 3}, rounds=1)
    calls = []
    half = loop.sites[0].strategy
    solve = half.solve_inner_problem
    half.solve_inner_problem = lambda site, batch, centre, inner_steps=None: calls.append(inner_steps) or solve(site, batch, centre, inner_steps)
    loop.fit(2)
    assert calls == [3] * 6 + [2]
    assert training_epochs(loop.history[-1]["compute"]["site0"]) == pytest.approx(1.0)


@pytest.mark.parametrize("name", ["pfednet", "fedrep"])
def test_an_empty_part_leaves_its_share_to_the_other(name):
    """All personal (the clinical logistic regression's split): the personal plan trains the whole budget."""
    model = seeded(LinearClassifier, 4, 2)
    model.configure_split(personal_patterns=[".*"])
    loop = build_loop(name, two_group_federation(n_sites=4, n_train=40), model, local_epochs=1.0, batch_size=BATCH)
    loop.fit(1)
    for site in loop.site_names:
        counts = loop.history[0]["compute"][site]
        assert training_epochs(counts) == pytest.approx(1.0)
        assert not any(key.startswith((f"{TRAIN}/shared", f"{TRAIN}/fit/body")) for key in counts)


def test_a_budget_below_one_epoch_is_a_config_value_and_a_budget_of_nothing_is_refused_by_name():
    from medfed.config import ConfigError, TrainerConfig, load_config

    assert load_config("clinical_delta1", ["trainer.local_epochs=0.5"]).trainer.local_epochs == 0.5  # a bundled config
    for bad in (0, -1, float("inf")):
        with pytest.raises(ConfigError, match=r"^config key 'trainer\.local_epochs' = .*: expected a number of epochs > 0"):
            TrainerConfig(local_epochs=bad)


@pytest.mark.parametrize("override, expected", [
    ("trainer.local_epochs=1e9", "config key 'trainer.local_epochs' = 1000000000.0: expected a number of epochs > 0 and at most 1000 (e.g. 0.5)"),
    ("trainer.rounds=1000000000", "config key 'trainer.rounds' = 1000000000: expected an integer from 1 to 100000"),
])
def test_a_billion_epochs_or_rounds_are_refused_by_fit_in_one_line_before_any_data_is_read(tiny_run_config, reading_forbidden, capsys, override, expected):
    # (issue 32: trainer.local_epochs=1e9 passed the check and each site allocated 40-48 GB for its round's plan)
    from medfed.cli import main

    assert main(["fit", "--config", str(tiny_run_config), "--quiet", override]) == 2
    error = capsys.readouterr().err
    assert error == f"medfed: error: {expected}\n", error
