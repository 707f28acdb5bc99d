"""``compare`` against what it does not control (issue 32): a full disk, a failed run's reason."""

import errno
import multiprocessing
import threading

import pytest

import medfed.compare
from medfed.cli import main
from medfed.compare.plan import Run, plan_runs
from medfed.compare.grid import read_grid
from test_compare import fake_comparison, write_fake_grid, write_fake_results  # noqa: F401 (fixture)


def test_a_full_disk_while_compare_writes_its_tables_is_one_line_with_status_2_and_the_runs_are_kept(fake_comparison, capsys, monkeypatch):
    # (compare itself ended in an OSError traceback from atomic_write of tuning.csv; the runs had failed cleanly)
    grid, out = fake_comparison
    before = sorted(path for path in out.rglob("results.json"))

    def no_space(rows, path):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(medfed.compare, "write_csv", no_space)
    assert main(["compare", "--grid", str(grid), "--quiet"]) == 2
    error = capsys.readouterr().err.splitlines()[-1]
    assert error.startswith(f"medfed: error: {out / 'comparison.csv'} could not be written (No space left on device); "), error
    assert " MiB free under " in error and error.endswith("free some space and run the same command again (it tabulates them without running them again)")
    assert sorted(out.rglob("results.json")) == before


class _LoggingContext:
    """A stand-in for the run server's context: its "process" writes ``lines`` to the run's log and reports ``code``."""

    def __init__(self, lines, code):
        self.lines, self.code = lines, code
        self.Pipe = multiprocessing.Pipe

    def Process(self, target, args, name):
        run, _, status = args
        context = self

        class Written:
            exitcode = context.code
            pid = None

            def start(self):
                run.log.write_text("".join(line + "\n" for line in context.lines))
                status.send(context.code)

            def join(self):
                pass

        return Written()


@pytest.mark.parametrize("lines, reason", [
    (["medfed: info: federation.label_ratio kept 484 of 569 records", "medfed: warning: round 1: site site2 left out",
      "medfed: error: /out/run/results.json could not be written (No space left on device); 3 MiB free under /out"],
     "medfed: error: /out/run/results.json could not be written (No space left on device); 3 MiB free under /out"),
    (["medfed: info: one", "Traceback (most recent call last):", '  File "x.py", line 1', "ValueError: bad"],
     'medfed: info: one | Traceback (most recent call last): |   File "x.py", line 1 | ValueError: bad'),
])
def test_a_failed_runs_reason_is_its_error_line_not_the_info_line_before_it(tmp_path, lines, reason):
    from medfed.compare.runner import _fit

    run = Run("tiny", tmp_path / "tiny.yaml", "fedavg", 0, tmp_path / "run", (), 1, tmp_path / "logs" / "seed0.log", "new")
    reader, _ = multiprocessing.Pipe(duplex=False)
    ended = []
    _fit(_LoggingContext(lines, 2), [run], reader, {}, threading.Lock(), threading.Event(), lambda *status: ended.append(status))
    assert ended == [(run, 2, reason)]


@pytest.mark.slow  # a real first compare: its run server and one 2-round run (15-35 s on two busy cores)
def test_a_second_compare_on_one_output_is_refused_naming_the_first_and_touches_nothing(tmp_path, capsys):
    # (both exited 1 claiming 2 failed runs each, all 4 had finished, and the loser's one-line error replaced the winner's log)
    import os
    import socket
    import subprocess
    import sys
    import time

    from test_compare import REPOSITORY, write_grid

    grid = write_grid(tmp_path, tmp_path / "out", strategies="[local]", seeds="[0]")
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPOSITORY)}
    first = subprocess.Popen([sys.executable, "-m", "medfed", "compare", "--grid", str(grid), "--quiet"], env=environment,
                             stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "out.lock").exists() and first.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert main(["compare", "--grid", str(grid), "--quiet"]) == 2
    finally:
        _, first_err = first.communicate(timeout=300)
    error = capsys.readouterr().err
    assert error == (f"medfed: error: compare's output {str(tmp_path / 'out')!r} is being written by another compare "
                     f"(pid {first.pid} on host {socket.gethostname()}, started {error.split('started ')[1].split(')')[0]}); "
                     "wait for it to end, or give this one another --output\n"), error
    assert first.returncode == 0, first_err
    log = (tmp_path / "out" / "logs" / "tiny_clinical" / "local" / "seed0.log").read_text()
    assert "error" not in log and (tmp_path / "out" / "tiny_clinical" / "local" / "seed0" / "results.json").is_file()
    assert not (tmp_path / "out.lock").exists()


def _set_every_metric(path, value):
    import json

    results = json.loads(path.read_text())
    for record in results["history"]:
        for metrics in record["metrics"].values():
            for name in metrics:
                metrics[name] = value
    path.write_text(json.dumps(results, indent=2))


@pytest.mark.parametrize("tamper, fault", [
    (lambda path: _set_every_metric(path, 0.123456), "does not match its SHA-256 integrity trailer: it was changed after the run wrote it"),
    (lambda path: path.write_text(path.read_text().rsplit(',\n  "integrity"', 1)[0] + "\n}"),
     "holds no integrity trailer ('integrity', written with every results.json since medfed sealed them)"),
])
def test_a_results_json_changed_by_hand_is_refused_by_name_and_nothing_is_tabulated(fake_comparison, capsys, tamper, fault):
    # (every accuracy set to 0.123456 by hand was tabulated by the next compare)
    grid, out = fake_comparison
    assert main(["compare", "--grid", str(grid), "--quiet"]) == 0
    table = (out / "comparison.md").read_bytes()
    capsys.readouterr()
    changed = out / "tiny_b" / "ditto" / "seed1" / "results.json"
    tamper(changed)
    assert main(["compare", "--grid", str(grid), "--quiet"]) == 2
    error = capsys.readouterr().err.splitlines()[-1]  # after the plan's count
    assert error == f"medfed: error: {changed}: {fault}; compare does not count it: restore the file, or delete its run folder to run it again", error
    assert (out / "comparison.md").read_bytes() == table


def test_a_runs_results_json_is_sealed_and_verifies_and_its_trailer_is_its_last_key(finished_tiny_run):
    import json

    from medfed.results import INTEGRITY, results_fault

    results = json.loads((finished_tiny_run / "results.json").read_text())
    assert list(results)[-1] == INTEGRITY and results_fault(results) is None
    metrics = results["history"][-1]["metrics"]["site0"]
    name = next(name for name, value in metrics.items() if isinstance(value, float))
    metrics[name] += 1e-12
    assert results_fault(results) is not None  # the last bit of one value counts
