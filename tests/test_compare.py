"""``python -m medfed compare``: a tiny clinical grid end to end, re-runs and resumes, bad grids, the tables by hand.

The grid (2 strategies x 2 seeds x 1 config, 2 rounds of logistic regression on
3 sites) runs once per module as a real ``python -m medfed compare``
subprocess; the later tests read its outputs or work on a copy.
"""

import csv
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import TensorDataset

from medfed.cli import main
from medfed.compare.grid import Grid, make_grid, read_grid
from medfed.compare.plan import VALIDATION_SPLIT, Run, plan_runs
from medfed.compare.tables import Finished, format_cell, markdown, selected_round
from medfed.config import load_config
from medfed.evaluation.rounds import ValidationEvaluation

from toy_federation import LinearClassifier, build_loop, seeded, two_group_federation

REPOSITORY = Path(__file__).resolve().parents[1]

TINY_CLINICAL = """
data:
  task: clinical
  csv: {data}/breast_cancer.csv
federation:
  n_sites: 3
  validation_fraction: 0.2
  label_ratio: {{delta: 2.0, spread: 1.5}}
model:
  name: logreg
strategy:
  name: local
trainer: {{rounds: 2, batch_size: 16, seed: 0, num_threads: 1}}
logger: {{wandb: disabled}}
"""

GRID = """
configs: [{config}]
strategies: [local, fedavg]
seeds: [0, 1]
metrics: [auroc, balanced_accuracy]
output: {output}
"""

STRATEGIES, SEEDS, SITES, METRICS = ["local", "fedavg"], [0, 1], ["site0", "site1", "site2"], ["auroc", "balanced_accuracy"]
COLUMNS = [
    "config", "strategy", "seed", "site", "last_auroc", "last_balanced_accuracy", "selected_round", "validation_auroc",
    "selected_auroc", "selected_balanced_accuracy", "wall_s",
]


def write_grid(folder: Path, output: Path, **changes: str) -> Path:
    """A tiny clinical config and a grid over it in ``folder``; ``changes`` replace lines of the grid (by key)."""
    folder.mkdir(parents=True, exist_ok=True)
    config = folder / "tiny_clinical.yaml"
    config.write_text(TINY_CLINICAL.format(data=folder))
    lines = GRID.format(config=config, output=output).strip().splitlines()
    lines = [f"{line.split(':')[0]}: {changes.pop(line.split(':')[0])}" if line.split(":")[0] in changes else line for line in lines]
    grid = folder / "grid.yaml"
    grid.write_text("\n".join([*lines, *(f"{key}: {value}" for key, value in changes.items())]) + "\n")
    return grid


@pytest.fixture(scope="module")
def compared(tmp_path_factory):
    """``(grid file, comparison folder, the command's stderr)`` after one ``python -m medfed compare`` subprocess."""
    folder = tmp_path_factory.mktemp("compare")
    grid = write_grid(folder, folder / "out")
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPOSITORY)}
    command = [sys.executable, "-m", "medfed", "compare", "--grid", str(grid), "--jobs", "2", "--quiet"]
    done = subprocess.run(command, capture_output=True, text=True, env=environment, cwd=folder)
    assert done.returncode == 0, done.stderr
    return grid, folder / "out", done.stderr


def read_rows(folder: Path) -> list[dict[str, str]]:
    with (folder / "comparison.csv").open(newline="") as handle:
        return list(csv.DictReader(handle))


def results_of(folder: Path, strategy: str, seed: int) -> dict:
    return json.loads((folder / "tiny_clinical" / strategy / f"seed{seed}" / "results.json").read_text())


def test_every_run_of_the_grid_gets_its_folder_and_one_csv_row_per_site(compared):
    _, out, stderr = compared
    assert "4 runs, 0 already finished, 0 to resume; 2 at a time" in stderr
    rows = read_rows(out)
    assert list(rows[0]) == COLUMNS and len(rows) == len(STRATEGIES) * len(SEEDS) * len(SITES)
    for strategy in STRATEGIES:
        for seed in SEEDS:
            results = results_of(out, strategy, seed)
            assert results["strategy"] == strategy and results["seed"] == seed and results["config"]["trainer"]["num_threads"] == 1
            mine = [row for row in rows if (row["strategy"], row["seed"]) == (strategy, str(seed))]
            assert [row["site"] for row in mine] == SITES and {row["config"] for row in mine} == {"tiny_clinical"}
            for row in mine:
                assert float(row["last_auroc"]) == results["history"][-1]["metrics"][row["site"]]["auroc"]
                assert float(row["wall_s"]) == results["timing"]["wall_s"]
    assert (out / "comparison.png").stat().st_size > 10_000


def test_the_validation_chosen_round_is_the_first_argmax_of_the_recorded_validation_scores(compared):
    _, out, _ = compared
    for row in read_rows(out):
        history = results_of(out, row["strategy"], int(row["seed"]))["history"]
        scores = [record["validation"][row["site"]]["auroc"] for record in history]
        chosen = int(np.argmax(scores))  # the first of equal maxima
        assert int(row["selected_round"]) == history[chosen]["round"] == chosen + 1
        assert float(row["validation_auroc"]) == scores[chosen]
        for metric in METRICS:  # the TEST metrics of that round
            assert float(row[f"selected_{metric}"]) == history[chosen]["metrics"][row["site"]][metric]


def test_selected_round_breaks_ties_by_the_earliest_round_and_skips_missing_scores():
    history = [
        {"round": 1, "validation": {"a": {"auroc": 0.7}}},
        {"round": 2, "validation": {"a": {"auroc": 0.9}}},
        {"round": 3, "validation": {"a": {"auroc": None}}},
        {"round": 4, "validation": {"a": {"auroc": 0.9}}},
    ]
    assert selected_round(history, "a", "auroc")["round"] == 2


def test_each_md_cell_is_mean_and_std_over_seeds_of_the_mean_over_sites_from_the_csv(compared):
    _, out, _ = compared
    rows, md = read_rows(out), (out / "comparison.md").read_text()
    assert md.startswith("# Method comparison\n") and "GENERATED" not in md  # the breast-cancer table is real data
    sections = {section.split("\n", 1)[0]: section for section in md.split("\n## ")[1:]}
    for metric in METRICS:
        for when, column in (("last round", f"last_{metric}"), ("validation-selected round", f"selected_{metric}")):
            table = sections[f"{metric}, {when}"]
            assert "| method | tiny_clinical |" in table
            for strategy in STRATEGIES:
                per_seed = [
                    np.mean([float(r[column]) for r in rows if r["strategy"] == strategy and r["seed"] == str(seed)]) for seed in SEEDS
                ]
                mean, std = np.mean(per_seed), np.std(per_seed, ddof=1)
                assert f"| {strategy} | {mean:.4f} ± {std:.4f} |" in table
    assert "| local |" in sections["Wall time per run, seconds (timing.wall_s; a resumed run's counts its last part only)"]


def test_a_rerun_runs_nothing_and_a_run_without_results_is_resumed(compared, tmp_path, capsys):
    grid, out, _ = compared
    copy = shutil.copytree(out, tmp_path / "out")
    results = {(s, k): copy / "tiny_clinical" / s / f"seed{k}" / "results.json" for s in STRATEGIES for k in SEEDS}
    before = {key: path.stat().st_mtime_ns for key, path in results.items()}
    interrupted = json.loads(results[("fedavg", 1)].read_text())
    results[("fedavg", 1)].unlink()  # as if stopped after its last checkpoint: a plain fit would refuse the folder

    arguments = ["compare", "--grid", str(grid), "--output", str(copy), "--jobs", "2", "--quiet"]
    assert main(arguments) == 0
    assert "4 runs, 3 already finished, 1 to resume" in capsys.readouterr().err
    assert {key: path.stat().st_mtime_ns for key, path in results.items() if key != ("fedavg", 1)} == {
        key: mtime for key, mtime in before.items() if key != ("fedavg", 1)
    }
    resumed = json.loads(results[("fedavg", 1)].read_text())
    assert [r["metrics"] for r in resumed["history"]] == [r["metrics"] for r in interrupted["history"]]
    same_but_resumed_wall_time = lambda row: {**row, "wall_s": None} if (row["strategy"], row["seed"]) == ("fedavg", "1") else row  # noqa: E731
    assert list(map(same_but_resumed_wall_time, read_rows(copy))) == list(map(same_but_resumed_wall_time, read_rows(out)))

    mtimes = {key: path.stat().st_mtime_ns for key, path in results.items()}
    assert main(arguments) == 0  # all finished: nothing runs
    assert "4 runs, 4 already finished, 0 to resume" in capsys.readouterr().err
    assert {key: path.stat().st_mtime_ns for key, path in results.items()} == mtimes


@pytest.mark.parametrize(
    "changes, overrides, message",
    [
        ({"strategies": "[local, fedavgg]"}, [], "grid key 'strategies': unknown strategy 'fedavgg'"),
        ({"colours": "[red]"}, [], "unknown grid key 'colours'"),
        ({}, ["trainer.roundz=2"], "tiny_clinical/local/seed0: .*unknown config key 'trainer.roundz'"),
        ({}, ["federation.holdout=validation"], "config key 'federation.holdout' = 'validation': compare reports test metrics"),
        ({}, ["output_dir=elsewhere"], "override 'output_dir=elsewhere': compare sets output_dir itself .*--output"),
        ({"overrides": "[strategy.name=ditto]"}, [], "grid key 'overrides': override 'strategy.name=ditto': compare sets strategy.name"),
        ({}, ["trainer.seed=3"], "override 'trainer.seed=3': compare sets trainer.seed itself .*--seeds"),
        ({}, ["--jobs", "0"], r"--jobs 0: expected an integer >= 1"),
        ({}, ["--strategies", "local,fedavgg"], "unknown strategy 'fedavgg'"),
        ({"overrides": "[model.lr=-1]"}, [], "tiny_clinical/local/seed0: config key 'model.lr'"),
    ],
)
def test_a_bad_grid_is_one_line_and_exit_status_2_before_any_run_starts(tmp_path, capsys, changes, overrides, message):
    grid = write_grid(tmp_path, tmp_path / "out", **changes)
    assert main(["compare", "--grid", str(grid), "--quiet", *overrides]) == 2
    error = capsys.readouterr().err
    assert error.startswith("medfed: error: ") and error.count("\n") == 1
    assert re.search(message, error), error
    assert not (tmp_path / "out").exists()


def test_a_folder_holding_a_run_of_another_config_is_refused_before_any_run(compared, tmp_path, capsys):
    grid, out, _ = compared
    copy = shutil.copytree(out, tmp_path / "out")
    assert main(["compare", "--grid", str(grid), "--output", str(copy), "--quiet", "model.lr=0.5"]) == 2
    error = capsys.readouterr().err
    assert "holds a run of another config (it differs at model.lr)" in error and error.count("\n") == 1


def test_bundled_grids_are_found_by_name_and_list_every_strategy():
    from medfed.federated.strategies import STRATEGIES as REGISTERED

    for name, settings, metrics in [
        ("table2_luna16", ["luna16_delta1", "luna16_delta2", "luna16_delta4", "luna16_delta7"], ["auroc", "balanced_accuracy"]),
        ("table3_brats", ["brats_lack0", "brats_lack1", "brats_lack2", "brats_lack3"], ["label_iou", "iou"]),
        ("table5_clinical", ["clinical_delta1", "clinical_delta2", "clinical_delta3", "clinical_delta4"], ["auroc", "balanced_accuracy"]),
    ]:
        grid = read_grid(name)
        assert grid == read_grid(REPOSITORY / "configs" / "paper" / f"{name}.yaml")
        assert grid.configs == settings and grid.metrics == metrics and grid.seeds == [0, 1, 2]
        assert grid.strategies == list(REGISTERED)


def test_md_cells_count_the_seeds_and_generated_data_are_named_in_every_heading():
    assert format_cell([0.5, 0.7], 2) == "0.6000 ± 0.1414"
    assert format_cell([0.5], 3) == "0.5000 (1/3)"
    assert format_cell([], 3) == "—"
    run = Run("lack0", Path("lack0.yaml"), "fedavg", 0, Path("o"), (), 1, Path("l"), "done")
    results = {"federation": {"description": "GENERATED BraTS-like data", "generated": True}, "config": {"trainer": {"rounds": 3}}}
    rows = [{"config": "lack0", "strategy": "fedavg", "seed": 0, "site": "site0", "last_iou": 0.5, "selected_iou": 0.6, "wall_s": 2.0}]
    grid = Grid(["lack0"], ["fedavg"], [0], metrics=["iou"])
    md = markdown(grid, "test", ["lack0"], rows, [Finished(run, results)], {"lack1/fedavg/seed0": "boom"}, ["iou"])
    headings = [line for line in md.splitlines() if line.startswith("#")]
    assert headings[0] == "# Method comparison (GENERATED data)"
    assert all("(GENERATED data)" in h for h in headings if h.startswith("## iou"))
    assert "| fedavg | 0.5000 |" in md and "| fedavg | 0.6000 |" in md and "- lack1/fedavg/seed0: boom" in md


def test_validation_evaluation_scores_each_sites_model_on_its_validation_split():
    federation = two_group_federation(n_sites=2)
    for site in federation.sites:  # half of each test split as a validation split
        x, y = site.test.tensors
        site.validation = TensorDataset(x[:24], y[:24])
    loop = build_loop("local", federation, seeded(LinearClassifier, 4, 2))
    loop.fit(1)
    record = {"round": 1}
    ValidationEvaluation().on_round_end(loop, record)
    for site in loop.sites:
        x, y = site.data.validation.tensors
        with torch.no_grad():
            accuracy = (site.module(x).argmax(dim=1) == y).float().mean().item()
        assert record["validation"][site.name]["accuracy"] == pytest.approx(accuracy)
        assert not site.module.training  # evaluated in eval mode


def test_a_run_that_fails_is_reported_with_its_exit_status_and_log_and_the_others_finish(tmp_path, capsys):
    grid = write_grid(tmp_path, tmp_path / "out", strategies="[local]", seeds="[0]")
    broken_folder = tmp_path / "broken"
    broken_folder.mkdir()
    (broken_folder / "breast_cancer.csv").write_text("diagnosis,radius\nmalignant,1.0\nbenign,not-a-number\n")
    broken = tmp_path / "broken_clinical.yaml"
    broken.write_text(TINY_CLINICAL.format(data=broken_folder))  # planned like the others; its data are read only when it runs
    grid.write_text(grid.read_text().replace("configs: [", f"configs: [{broken}, "))
    assert main(["compare", "--grid", str(grid), "--quiet"]) == 1
    error = capsys.readouterr().err
    assert re.search(r"run broken_clinical/local/seed0 failed \(exit status 2\): .*medfed: error: .*breast_cancer\.csv", error), error
    assert (tmp_path / "out" / "tiny_clinical" / "local" / "seed0" / "results.json").is_file()
    assert not (tmp_path / "out" / "broken_clinical" / "local" / "seed0" / "results.json").exists()
    assert {row["config"] for row in read_rows(tmp_path / "out")} == {"tiny_clinical"}


def test_the_run_server_starts_with_the_runs_thread_count_and_leaves_this_process_environment_alone(tmp_path):
    # In a fresh interpreter: pytest's own process may already hold a run server from the tests above.
    script = tmp_path / "server_environment.py"
    script.write_text(
        "import multiprocessing, os\n"
        "from medfed.compare.runner import _start_run_server\n"
        "def report(writer):\n"
        "    writer.send(os.environ.get('OMP_NUM_THREADS'))\n"
        "if __name__ == '__main__':\n"
        "    context = multiprocessing.get_context('forkserver')\n"
        "    context.set_forkserver_preload(['os'])\n"
        "    _start_run_server(3)\n"
        "    reader, writer = context.Pipe(duplex=False)\n"
        "    process = context.Process(target=report, args=(writer,))\n"
        "    process.start()\n"
        "    writer.close()\n"
        "    print(reader.recv(), os.environ.get('OMP_NUM_THREADS'))\n"
        "    process.join()\n"
    )
    environment = {key: value for key, value in os.environ.items() if key != "OMP_NUM_THREADS"} | {"PYTHONPATH": str(REPOSITORY)}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=environment, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["3", "None"]


def test_strategies_may_be_given_comma_separated():
    grid = make_grid(["c.yaml"], ["local,fedavg", "ditto"], [0], [], [], "out")
    assert grid.strategies == ["local", "fedavg", "ditto"]


def test_a_config_without_a_validation_split_gets_one_said_in_one_line_and_recorded_in_each_run(tmp_path, capsys):
    grid = read_grid(write_grid(tmp_path, tmp_path / "out"))
    config = tmp_path / "tiny_clinical.yaml"
    config.write_text(config.read_text().replace("  validation_fraction: 0.2\n", ""))
    runs = plan_runs(grid, jobs=1)
    assert len(runs) == 4 and all(VALIDATION_SPLIT in run.overrides for run in runs)
    assert load_config(runs[0].config_path, list(runs[0].overrides)).federation.validation_fraction == 0.2  # what fit records
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and f"no validation split in tiny_clinical: each of its runs chooses its sites' rounds on {VALIDATION_SPLIT}" in error
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("damage", [lambda text: text[: len(text) // 2], lambda text: "[]", lambda text: '{"config": {}}'])
def test_a_damaged_results_json_stops_compare_with_one_line_naming_it(compared, tmp_path, capsys, damage):
    grid, out, _ = compared
    copy = shutil.copytree(out, tmp_path / "out")
    results = copy / "tiny_clinical" / "fedavg" / "seed1" / "results.json"
    results.write_text(damage(results.read_text()))
    assert main(["compare", "--grid", str(grid), "--output", str(copy), "--quiet"]) == 2
    error = capsys.readouterr().err
    assert error.startswith(f"medfed: error: {results}: ") and error.count("\n") == 1, error


def _descendants(pid: int) -> dict[int, int]:
    """``{pid: start time}`` of every process below ``pid`` (from /proc)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        fields = _stat_fields(int(stat.parent.name))
        if fields:
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = {}, [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            fields = _stat_fields(child)
            if fields:
                found[child] = int(fields[19])
                todo.append(child)
    return found


def _stat_fields(pid: int) -> list[str] | None:
    """/proc/<pid>/stat after the command name: state, ppid, ..., start time at index 19; None when gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _command_line(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:200]
    except OSError:
        return f"{pid} (gone)"


def _running(pid: int, start: int) -> bool:
    fields = _stat_fields(pid)
    return fields is not None and int(fields[19]) == start and fields[0] not in ("Z", "X")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_every_process_compare_started_ends_within_seconds_of_a_kill_9(tmp_path):
    grid = write_grid(tmp_path, tmp_path / "out")
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPOSITORY)}
    command = [sys.executable, "-m", "medfed", "compare", "--grid", str(grid), "--jobs", "2", "--quiet", "trainer.rounds=2000"]
    with (tmp_path / "compare.log").open("w") as log:
        compare = subprocess.Popen(command, stdout=log, stderr=log, env=environment, cwd=tmp_path)
    family: dict[int, int] = {}
    try:
        deadline = time.monotonic() + 180
        while len(list((tmp_path / "out" / "logs").rglob("*.log"))) < 2 or len(family) < 3:  # the run server and two runs
            assert compare.poll() is None and time.monotonic() < deadline, (tmp_path / "compare.log").read_text()
            time.sleep(0.5)
            family = _descendants(compare.pid)
        time.sleep(2)  # the runs are training
        family = _descendants(compare.pid)
        os.kill(compare.pid, signal.SIGKILL)
        compare.wait()
        deadline = time.monotonic() + 10
        while any(_running(pid, start) for pid, start in family.items()) and time.monotonic() < deadline:
            time.sleep(0.2)
        survivors = [_command_line(pid) for pid, start in family.items() if _running(pid, start)]
        assert not survivors, f"{len(survivors)} of compare's {len(family)} processes alive 10 s after its kill -9: {survivors}"
    finally:
        for pid, start in family.items():
            if _running(pid, start):
                os.kill(pid, signal.SIGKILL)
        if compare.poll() is None:
            compare.kill()
