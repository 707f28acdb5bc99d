"""``compare --tune``: the tuner never reads the test split, the choice on hand-made scores, the chosen values in the
tables, the search spaces' keys, refused spaces (one line, exit status 2)."""

import csv
import json
import math
from dataclasses import fields, replace
from pathlib import Path

import numpy as np
import pytest

import medfed.compare
import medfed.tasks.clinical as clinical
from medfed.cli import main
from medfed.compare.grid import make_grid
from medfed.compare.plan import Run
from medfed.compare.tables import collect
from medfed.compare.tune import Candidate, TuneSpec, Trial, candidates, choose, collect_trials, parse_space, plan_tuning, tuning_rows
from medfed.components import STRATEGY_NAMES
from medfed.errors import ConfigError, DataError
from medfed.fit import fit
from medfed.options.search import default_space
from medfed.options.strategies import STRATEGY_OPTIONS
from medfed.results import INTEGRITY, write_results

TINY_CLINICAL = """
data:
  task: clinical
  csv: {data}/breast_cancer.csv
federation:
  n_sites: 3
  label_ratio: {{delta: 2.0, spread: 1.5}}
model:
  name: logreg
strategy:
  name: local
trainer: {{rounds: 2, batch_size: 16, seed: 0, num_threads: 1}}
logger: {{wandb: disabled}}
"""


def tiny_config(folder: Path) -> Path:
    config = folder / "tiny_clinical.yaml"
    config.write_text(TINY_CLINICAL.format(data=folder))
    return config


class PoisonedTestSplit:
    """Makes building a dataset from any test record raise while ``armed``: each federation build records its sites'
    test records (drawn first, the same for either holdout) through the wrapped ``split_site``."""

    def __init__(self, monkeypatch):
        self.armed, self.test_records, self.datasets = False, set(), 0
        real_split, real_dataset = clinical.split_site, clinical._dataset

        def split_site(subjects, draw, federation, seed, site_index):
            split = real_split(subjects, draw, federation, seed, site_index)
            if site_index == 0:
                self.test_records = set()
            self.test_records |= set(split.set_aside if split.holdout == "validation" else split.evaluation)
            return split

        def dataset(data, records, lo, hi):
            self.datasets += 1
            if self.armed and self.test_records & set(np.asarray(records).tolist()):
                raise AssertionError(f"test records read: {sorted(self.test_records & set(np.asarray(records).tolist()))[:5]}")
            return real_dataset(data, records, lo, hi)

        monkeypatch.setattr(clinical, "split_site", split_site)
        monkeypatch.setattr(clinical, "_dataset", dataset)


def test_the_tuner_never_reads_the_test_split_and_the_tables_name_the_chosen_values(tmp_path, monkeypatch, capsys):
    records = PoisonedTestSplit(monkeypatch)
    config = tiny_config(tmp_path)
    executed: list[Run] = []

    def in_process(runs, jobs, progress=True, fuse="auto"):  # compare's runner, in this process: the tuning runs under the armed records
        for run in runs:
            if run.action != "done":
                executed.append(run)
                records.armed = bool(run.variant)  # a tuning run
                assert fit(str(run.config_path), list(run.overrides), resume=run.action == "resume", quiet=True) == 0
                records.armed = False
        return {}

    monkeypatch.setattr(medfed.compare, "execute", in_process)
    # the poison works: a run on the test split (armed) raises
    records.armed = True
    with pytest.raises(AssertionError, match="test records read"):
        fit(str(config), ["federation.validation_fraction=0.2", f"output_dir={tmp_path / 'control'}"], quiet=True)
    records.armed = False

    out = tmp_path / "out"
    command = [
        "compare", "--config", str(config), "--strategies", "fedavg,fedprox", "--seeds", "0", "1", "--metrics", "auroc",
        "--output", str(out), "--tune", "--tune-space", "strategy.fedprox.mu=0.01,1", "--tune-space", "model.lr=x1",
        "--tune-rounds", "2", "--quiet", "trainer.rounds=3",
    ]
    assert main(command) == 0, capsys.readouterr().err
    tuning = [run for run in executed if run.variant]
    assert sorted(run.name for run in tuning) == [
        "tiny_clinical/fedavg/lr=0.01/seed0", "tiny_clinical/fedprox/mu=0.01_lr=0.01/seed0", "tiny_clinical/fedprox/mu=1_lr=0.01/seed0",
    ]
    assert len(executed) == 3 + 2 * 2 and records.datasets > 0
    for run in tuning:
        results = json.loads((run.output_dir / "results.json").read_text())
        assert results["config"]["federation"]["holdout"] == "validation" and results["config"]["trainer"]["rounds"] == 2
        assert all("n_test" not in site and site["n_validation"] > 0 for site in results["federation"]["sites"])

    with (out / "tuning.csv").open(newline="") as handle:
        trials = {row["configuration"]: row for row in csv.DictReader(handle) if row["strategy"] == "fedprox"}
    scores = {label: float(row["validation_score"]) for label, row in trials.items()}
    best = max(scores, key=scores.get)  # (ties: the first, mu=0.01)
    assert [label for label, row in trials.items() if row["chosen"] == "True"] == [best]
    chosen_mu = best.split("_")[0].split("=")[1]
    for seed in (0, 1):  # the grid's runs: every seed, on the test split, with the chosen values
        results = json.loads((out / "tiny_clinical" / "fedprox" / f"seed{seed}" / "results.json").read_text())
        assert results["config"]["federation"]["holdout"] == "test"
        assert results["config"]["strategy"]["fedprox"]["mu"] == float(chosen_mu)
    md = (out / "comparison.md").read_text()
    assert f"| fedprox | {best.replace('_', ' ')} (validation {scores[best]:.4f}; 2 configurations, 2/2 runs, " in md
    assert "hyperparameters: chosen on the validation split (compare --tune, section below)" in md
    with (out / "comparison.csv").open(newline="") as handle:
        assert {row["tuned"] for row in csv.DictReader(handle) if row["strategy"] == "fedprox"} == {best.replace("_", " ")}

    executed.clear()
    assert main(command) == 0  # resumable: every tuning and grid run is found finished
    assert executed == []


def _trial(setting, strategy, label, scores, planned=2):
    return Trial(Candidate(setting, strategy, (("lr", label),), (f"model.lr={label}",)), scores, planned, 2.0 * len(scores), 1.0)


def test_choose_takes_the_highest_mean_over_tuning_seeds_the_first_of_equal_ones_and_only_complete_configurations():
    trials = [
        _trial("a", "ditto", "1", {0: 0.7, 1: 0.9}),   # 0.80
        _trial("a", "ditto", "2", {0: 0.85, 1: 0.75}),  # 0.80: equal, comes later
        _trial("a", "ditto", "3", {0: 0.99}),           # the best score, but seed 1 did not finish
        _trial("a", "ditto", "4", {0: 0.79, 1: 0.8}),   # 0.795
        _trial("b", "ditto", "1", {0: 0.5, 1: math.nan}),
        _trial("b", "ditto", "2", {0: 0.4, 1: 0.41}),
        _trial("b", "ditto", "3", {0: 0.6, 1: 0.2}),   # 0.40: below "2"
        _trial("c", "ditto", "1", {}),
    ]
    chosen = choose(trials)
    assert chosen[("a", "ditto")] is trials[0] and chosen[("b", "ditto")] is trials[5] and chosen[("c", "ditto")] is None
    assert trials[0].score == pytest.approx(0.8) and trials[2].score is None and trials[4].score is None
    assert [row["chosen"] for row in tuning_rows(trials, chosen)] == [True, False, False, False, False, True, False, False]


def test_tuning_runs_are_scored_on_their_last_rounds_validation_metric_and_a_test_evaluated_one_is_refused(tmp_path):
    config = tiny_config(tmp_path)
    grid = make_grid([str(config)], ["fedprox"], [0, 1], [], ["auroc"], tmp_path / "out")
    spec = TuneSpec({"strategy.fedprox.mu": ("0.1", "1"), "model.lr": ("x1",)}, rounds=2, seeds=(0, 1))
    found, runs = plan_tuning(grid, [], spec, jobs=1)
    assert [c.label for c in found] == ["mu=0.1_lr=0.01", "mu=1_lr=0.01"] and len(runs) == 4
    assert all(run.overrides[-2] == "federation.holdout=validation" for run in runs)  # after every other override
    site_scores = {("mu=0.1_lr=0.01", 0): [0.6, 0.8, 0.7], ("mu=0.1_lr=0.01", 1): [0.9, 0.9, 0.6],
                   ("mu=1_lr=0.01", 0): [0.9, 0.9, 0.9], ("mu=1_lr=0.01", 1): [0.5, 0.5, 0.5]}
    for run in runs:
        run.output_dir.mkdir(parents=True)
        last = {f"site{i}": {"auroc": value} for i, value in enumerate(site_scores[(run.variant, run.seed)])}
        results = {
            "config": {"federation": {"holdout": "validation"}, "trainer": {"rounds": 2}},
            "history": [{"round": 1, "metrics": {site: {"auroc": 0.0} for site in last}}, {"round": 2, "metrics": last}],
            "federation": {"description": "fake", "generated": False}, "timing": {"wall_s": 2.0},
            "compute": {"training_epochs": {site: 4.0 for site in last}},
        }
        write_results(run.output_dir / "results.json", results)
    trials = collect_trials(found, runs, collect(runs), "auroc")
    assert trials[0].scores == pytest.approx({0: 0.7, 1: 0.8}) and trials[1].scores == pytest.approx({0: 0.9, 1: 0.5})
    assert choose(trials)[("tiny_clinical", "fedprox")] is trials[0]  # 0.75 against 0.70
    assert trials[0].training_epochs == 8.0 and trials[0].wall_s == 4.0

    damaged = json.loads((runs[0].output_dir / "results.json").read_text())
    damaged["config"]["federation"]["holdout"] = "test"
    del damaged[INTEGRITY]
    write_results(runs[0].output_dir / "results.json", damaged)  # as a test-evaluated run would have sealed it
    with pytest.raises(DataError, match="a tuning run evaluated on 'test'"):
        collect_trials(found, runs, collect(runs), "auroc")


def test_relative_values_multiply_the_configs_own_and_every_combination_is_one_candidate():
    config = {"model": {"lr": 0.004}, "strategy": {"pfednet": {"lam": 0.1, "knn_k": 2}}}
    space = {"strategy.pfednet.lam": ("0.1", "x1"), "strategy.pfednet.knn_k": (1, 2), "model.lr": ("x0.5", "x2")}
    found = candidates("lack0", "pfednet", space, config)
    assert [c.label for c in found] == [
        "lam=0.1_knn_k=1_lr=0.002", "lam=0.1_knn_k=1_lr=0.008", "lam=0.1_knn_k=2_lr=0.002", "lam=0.1_knn_k=2_lr=0.008",
    ]
    assert found[1].overrides == ("strategy.pfednet.lam=0.1", "strategy.pfednet.knn_k=1", "model.lr=0.008")
    assert found[1].values == "lam=0.1 knn_k=1 lr=0.008"


@pytest.mark.parametrize("strategy", STRATEGY_NAMES)
def test_every_default_space_names_options_of_its_strategy_with_values_they_accept(strategy):
    space = default_space(strategy)
    assert "model.lr" in space
    assert parse_space([f"{key}={','.join(map(str, values))}" for key, values in space.items()]).keys() == space.keys()
    options = STRATEGY_OPTIONS[strategy]
    for key, values in space.items():
        if key.startswith("strategy."):
            assert key.split(".")[1] == strategy and key.split(".")[2] in {f.name for f in fields(options)}
            for value in values:
                options(**{key.split(".")[2]: value})  # refused values raise ConfigError


@pytest.mark.parametrize(
    "arguments, message",
    [
        (["--tune-space", "strategy.fedprox.muu=0.1,1"], "--tune-space 'strategy.fedprox.muu=0.1,1': unknown key 'strategy.fedprox.muu' (strategy.fedprox options: mu)"),
        (["--tune-space", "federation.holdout=test"], "unknown key 'federation.holdout' (expected model.<option> or strategy.<name>.<option>)"),
        (["--tune-space", "model.lrr=0.1"], "unknown key 'model.lrr' (model options: "),
        (["--tune-space", "strategy.ditto.lam=0.1"], "--tune-space 'strategy.ditto.lam': ditto is not among the grid's strategies (fedavg, fedprox)"),
        (["--tune-space", "model.lr=x-1"], "'x-1' is no relative value"),
        (["--tune-space", "model.lr=0.1,0.1"], "none empty or repeated"),
        (["strategy.fedprox.mu=0.1"], "override 'strategy.fedprox.mu=0.1' with --tune: --tune chooses strategy.fedprox.mu"),
        (["--budgets", "1", "2"], "--tune with --budgets"),
        (["--tune-budget", "0"], "--tune-budget 0: expected an integer >= 1 (configurations per method)"),
        (["--tune-extend", "-1"], "--tune-extend -1: expected an integer >= 0"),
    ],
)
def test_a_bad_tuning_is_refused_in_one_line_with_exit_status_2_before_any_run(tmp_path, capsys, monkeypatch, arguments, message):
    monkeypatch.setattr(medfed.compare, "execute", lambda *args, **kwargs: pytest.fail("a run started"))
    config = tiny_config(tmp_path)
    command = ["compare", "--config", str(config), "--strategies", "fedavg", "fedprox", "--output", str(tmp_path / "out"), "--tune", *arguments]
    assert main(command) == 2
    error = capsys.readouterr().err
    assert error.startswith("medfed: error: ") and message in error and error.count("\n") == 1, error
    assert not (tmp_path / "out").exists()


# --- bounded plans (issue 32, item 3) ----------------------------------------------------------------------


def test_a_tuning_space_of_a_million_configurations_is_refused_in_one_line_before_any_config_is_resolved(tmp_path, capsys, monkeypatch):
    # (6 keys x 10 values planned silently until killed at 180 s and 1.4 GB)
    import medfed.compare.plan
    import medfed.compare.tune

    def no_resolving(*args, **kwargs):
        raise AssertionError("a config was resolved")

    monkeypatch.setattr(medfed.compare.plan, "resolve", no_resolving)
    monkeypatch.setattr(medfed.compare.tune, "resolve", no_resolving)
    config = tiny_config(tmp_path)
    values = ",".join(str(k) for k in range(1, 11))
    space = [f"model.{key}=x{values.replace(',', ',x')}" for key in ("lr", "momentum", "weight_decay")]
    space += [f"strategy.fedprox.mu={values}", "model.dropout=" + ",".join(f"0.{k}" for k in range(10)), f"model.num_res_units={values}"]
    command = ["compare", "--config", str(config), "--strategies", "fedavg", "fedprox", "--output", str(tmp_path / "out"), "--tune"]
    for entry in space:
        command += ["--tune-space", entry]
    assert main(command) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1, error
    assert error.startswith("medfed: error: compare --tune: 1100000 configurations to tune (1 settings; fedprox alone has 1000000: "
                            "10 x 10 x 10 x 10 x 10 x 10 values of "), error
    assert error.rstrip().endswith("more than 600; give fewer values with --tune-space")
    assert not (tmp_path / "out").exists()


def test_the_count_of_a_plan_is_said_before_planning_and_a_plan_over_the_bound_is_refused(tmp_path, capsys, monkeypatch):
    from medfed.compare.bounds import MAX_RUNS, bound_plan

    grid = make_grid([str(tiny_config(tmp_path))], ["fedavg", "fedprox"], list(range(10)), [], [], tmp_path / "out")
    bound_plan(grid, None, TuneSpec({"model.lr": ("0.1", "0.01")}, seeds=(0, 1)))
    assert capsys.readouterr().err == (  # fedavg: 2 learning rates; fedprox: 3 mu x 2 learning rates
        "medfed: compare: planning 1 settings x 2 methods x 10 seeds = 20 runs, and 8 tuning configurations x 2 seeds = 16 "
        "tuning runs; resolving each run's config\n"
    )
    many = make_grid([str(tiny_config(tmp_path))], ["fedavg", "fedprox"], list(range(MAX_RUNS // 2 + 1)), [], [], tmp_path / "out")
    with pytest.raises(ConfigError, match=rf"^compare: the plan holds 1 settings x 2 methods x {MAX_RUNS // 2 + 1} seeds = {MAX_RUNS + 2} runs: "):
        bound_plan(many, None, None)
    with pytest.raises(ConfigError, match=r" x 3 budgets = "):
        bound_plan(replace(many, seeds=list(range(MAX_RUNS // 6 + 1))), [1.0, 2.0, 4.0], None)


def test_the_learning_rate_is_widened_by_factors_of_three_alternately_until_the_space_fills_the_budget():
    from medfed.compare.tune import widen_learning_rate

    space = {"model.lr": ("x0.3", "x1", "x3")}
    assert widen_learning_rate(space, 6)["model.lr"] == ("x0.1", "x0.3", "x1", "x3", "x9", "x27")  # +9, /3 -> 0.1, +27
    assert widen_learning_rate(space, 3) == space
    two_keys = {"strategy.fedprox.mu": (0.01, 0.1, 1.0), "model.lr": ("x0.3", "x1", "x3")}
    assert widen_learning_rate(two_keys, 6) == two_keys  # 9 >= 6 already
    assert widen_learning_rate({"model.lr": (0.001, 0.01)}, 3)["model.lr"] == (0.001, 0.01, 0.03)
    assert widen_learning_rate({"model.lr": ("x1",)}, 6) == {"model.lr": ("x1",)}  # pinned: left alone


def test_a_budget_gives_every_method_the_same_number_of_configurations_each_value_used_evenly(tmp_path):
    from medfed.compare.tune import balanced_sample, space_of, widen_learning_rate

    for strategy in STRATEGY_NAMES:  # every registered method's default space, sampled or widened to 6
        found = candidates("s", strategy, widen_learning_rate(space_of(strategy, TuneSpec()), 6), {"model": {"lr": 0.01}})
        chosen = balanced_sample(found, 6, seed=1)
        assert len(chosen) == 6 and len({c.overrides for c in chosen}) == 6, strategy  # no configuration twice
        for key in {o.partition("=")[0] for c in chosen for o in c.overrides}:
            tried = {o for c in found for o in c.overrides if o.startswith(key + "=")}
            counts = [sum(o in c.overrides for c in chosen) for o in tried]
            assert max(counts) - min(counts) <= 1, (strategy, key, counts)  # e.g. pFedNet: 3 lam x 2 k x 3 lr -> each lam twice
    config = tiny_config(tmp_path)
    grid = make_grid([str(config)], ["fedavg", "pfednet", "ifca"], [0], [], ["auroc"], tmp_path / "out")
    found, runs = plan_tuning(grid, [], TuneSpec(budget=6), jobs=1)
    assert [c.strategy for c in found] == ["fedavg"] * 6 + ["pfednet"] * 6 + ["ifca"] * 6 and len(runs) == 18
    assert [c.values for c in found[:6]] == [f"lr={v:g}" for v in (0.001, 0.003, 0.01, 0.03, 0.09, 0.27)]  # x0.1 .. x27 of 0.01
    again, _ = plan_tuning(grid, [], TuneSpec(budget=6), jobs=1)
    assert again == found  # the sample is seeded by the setting's and method's names


def _lr_trial(lr, score, strategy="fedprox", mu="0.1"):
    candidate = Candidate("s", strategy, (("mu", mu), ("lr", lr)), (f"strategy.{strategy}.mu={mu}", f"model.lr={lr}"))
    return Trial(candidate, {0: score}, 1, 1.0, 1.0)


def test_an_edge_choice_gets_one_step_beyond_on_its_float_keys_only_up_to_the_limit():
    from medfed.compare.tune import at_an_edge, edge_extensions

    trials = [_lr_trial("0.001", 0.5), _lr_trial("0.003", 0.6), _lr_trial("0.01", 0.7), _lr_trial("0.01", 0.4, mu="1")]
    chosen = choose(trials)
    assert at_an_edge(chosen[("s", "fedprox")], trials) == ["mu=0.1 (bottom)", "lr=0.01 (top)"]
    steps = {}
    more = edge_extensions(trials, chosen, steps, limit=2)
    assert [(c.overrides, key) for c, key in more] == [
        (("strategy.fedprox.mu=0.01", "model.lr=0.01"), "strategy.fedprox.mu"),  # mu: 0.1 / (1 / 0.1)
        (("strategy.fedprox.mu=0.1", "model.lr=0.0333333"), "model.lr"),  # lr: 0.01 x (0.01 / 0.003)
    ]
    assert steps == {("s", "fedprox", "strategy.fedprox.mu"): 1, ("s", "fedprox", "model.lr"): 1}
    assert edge_extensions(trials, chosen, {key: 2 for key in steps}, limit=2) == []  # the limit reached
    inside = [_lr_trial("0.001", 0.5), _lr_trial("0.003", 0.8), _lr_trial("0.01", 0.7)]
    assert edge_extensions(inside, choose(inside), {}, limit=2) == []  # no float key at an edge (mu has one value)
    knn = [Trial(Candidate("s", "pfednet", (("knn_k", k),), (f"strategy.pfednet.knn_k={k}",)), {0: float(k)}, 1, 1.0, 1.0) for k in (1, 2)]
    assert edge_extensions(knn, choose(knn), {}, limit=2) == []  # a count is not extended


@pytest.mark.parametrize("limit, chosen_lr, steps, still", [(3, "0.081", 3, False), (1, "0.027", 1, True)])
def test_compare_extends_the_learning_rate_beyond_the_top_until_the_choice_is_inside_and_says_so(
    tmp_path, monkeypatch, capsys, limit, chosen_lr, steps, still
):
    import medfed.compare.tune as tune
    from medfed.components import resolve
    from medfed.results import write_results
    from medfed.config import load_config

    config = tiny_config(tmp_path)

    def fake_runs(runs, jobs, progress=True, fuse="auto"):  # each run's results.json, without training: its config and one round
        for run in runs:
            if run.action != "done":
                run.output_dir.mkdir(parents=True)
                scores = {"site0": {"auroc": 0.7}}
                results = {
                    "config": resolve(load_config(run.config_path, list(run.overrides))).config,
                    "history": [{"round": 1, "metrics": scores, "validation": scores}],
                    "federation": {"description": "fake", "generated": False}, "timing": {"wall_s": 1.0},
                }
                write_results(run.output_dir / "results.json", results)
        return {}

    def score(finished, metric):  # a validation score peaking at lr 0.09: the space's top (0.009) is far below it
        lr = finished.results["config"]["model"]["lr"]
        return 1.0 - (math.log(lr) - math.log(0.09)) ** 2 / 100

    monkeypatch.setattr(medfed.compare, "execute", fake_runs)
    monkeypatch.setattr(tune, "run_values", score)
    out = tmp_path / "out"
    command = [
        "compare", "--config", str(config), "--strategies", "fedavg", "--seeds", "0", "--metrics", "auroc", "--output", str(out),
        "--tune", "--tune-space", "model.lr=0.001,0.003,0.009", "--tune-rounds", "1", "--tune-extend", str(limit), "--quiet",
        "trainer.rounds=1", "--allow-unequal-compute",
    ]
    assert main(command) == 0, capsys.readouterr().err
    with (out / "tuning.csv").open(newline="") as handle:
        rows = list(csv.DictReader(handle))
    tried = [row["configuration"] for row in rows]
    assert tried == ["lr=0.001", "lr=0.003", "lr=0.009", "lr=0.027", "lr=0.081", "lr=0.243"][: 3 + steps]
    assert [row["configuration"] for row in rows if row["chosen"] == "True"] == [f"lr={chosen_lr}"]
    md = (out / "comparison.md").read_text()
    line = next(line for line in md.splitlines() if line.startswith("| fedavg | lr="))
    assert f"beyond an edge: lr {steps} step" in line and ("still at an edge: lr=0.027 (top)" in line) == still
    assert f"up to {limit} steps per key" in md
