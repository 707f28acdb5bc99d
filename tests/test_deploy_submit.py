"""``python -m medfed deploy submit``: a bad run config is refused here (exit 2, flwr never started); the run's Flower status is the exit status."""

import json
import subprocess
from pathlib import Path

import pytest

pytest.importorskip("flwr")

from medfed.cli import main  # noqa: E402
from medfed.deploy import submit  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
GOOD = [f'config="{REPO / "configs" / "clinical_delta1.yaml"}" overrides="federation.n_sites=3 federation.label_ratio=null" run-name="r1"']


def _never(*args, **kwargs):
    raise AssertionError(f"flwr was started: {args}")


@pytest.mark.parametrize(
    "run_config,message",
    [
        (['reply-timeout-s="soon"'], "run config key 'reply-timeout-s': expected a float"),
        (['no-such-key=1'], "run config key 'no-such-key': unknown; expected one of config, output-dir, overrides"),
        (['overrides="trainer.nope=1 federation.label_ratio=null"'], "unknown config key 'trainer.nope'"),
        (['overrides="federation.label_ratio.delta=2"'], "config key 'federation.label_ratio'"),
        (['run-name="../elsewhere"'], "run config key 'run-name'"),
        (["key=value=oops 'unclosed"], "--run-config"),
    ],
)
def test_a_bad_run_config_is_one_line_with_status_2_and_flwr_never_starts(monkeypatch, capsys, run_config, message):
    monkeypatch.setattr(subprocess, "Popen", _never)
    monkeypatch.setattr(subprocess, "run", _never)
    arguments = ["deploy", "submit", str(REPO), "somewhere"]
    for value in run_config:
        arguments += ["--run-config", value]
    assert main(arguments) == 2
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("medfed: error: ") and message in lines[0], captured.err
    assert captured.out == ""


def test_an_app_folder_without_pyproject_is_refused(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(subprocess, "Popen", _never)
    assert main(["deploy", "submit", str(tmp_path), "somewhere"]) == 2
    assert "no pyproject.toml" in capsys.readouterr().err


class FakeFlwr:
    """``flwr run`` (its output lines, or Ctrl-C after them) and ``flwr ls`` (one run's status) as subprocess fakes."""

    def __init__(self, lines, status=None, details="", interrupt=False):
        self.lines, self.status, self.details, self.interrupt = lines, status, details, interrupt
        self.commands = []
        self.terminated = False

    def popen(self, command, **kwargs):
        self.commands.append(command)
        fake = self

        class Process:
            returncode = 0

            @property
            def stdout(self):
                yield from fake.lines
                if fake.interrupt:
                    raise KeyboardInterrupt

            def wait(self):
                return 0

            def terminate(self):
                fake.terminated = True

        return Process()

    def run(self, command, **kwargs):
        self.commands.append(command)
        run = {"run-id": command[command.index("--run-id") + 1], "status": self.status, "status-details": self.details}
        return subprocess.CompletedProcess(command, 0, stdout=json.dumps({"success": True, "runs": [run]}, indent=2), stderr="")


def _submit(monkeypatch, fake):
    monkeypatch.setattr(subprocess, "Popen", fake.popen)
    monkeypatch.setattr(subprocess, "run", fake.run)
    return main(["deploy", "submit", str(REPO), "rehearsal", "--run-config", GOOD[0]])


def test_a_finished_run_exits_0_and_its_log_is_passed_through(monkeypatch, capsys):
    fake = FakeFlwr(["Successfully started run 42\n", "medfed round 1: ...\n"], status="finished:completed")
    assert _submit(monkeypatch, fake) == 0
    run, ls = fake.commands
    assert run[len(submit.FLWR):] == ["run", str(REPO), "rehearsal", "--stream", "--run-config", GOOD[0]]
    assert ls[len(submit.FLWR):] == ["ls", "rehearsal", "--run-id", "42", "--format", "json"]
    captured = capsys.readouterr()
    assert "medfed round 1: ..." in captured.out and "run 42 finished:completed" in captured.err


def test_a_failed_run_exits_1_with_its_reason_in_one_line(monkeypatch, capsys):
    reason = "medfed: error: config key 'data.csv': file not found"
    fake = FakeFlwr(["Successfully started run 7\n", reason + "\n"], status="finished:failed", details=reason)
    assert _submit(monkeypatch, fake) == 1
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("medfed: error:")]
    assert errors == [f"medfed: error: run 7 finished:failed: {reason}"]


def test_a_run_flwr_could_not_submit_exits_1(monkeypatch, capsys):
    fake = FakeFlwr(["Error: the SuperLink connection 'rehearsal' is not defined\n"])
    assert _submit(monkeypatch, fake) == 1
    assert "flwr run submitted no run" in capsys.readouterr().err
    assert len(fake.commands) == 1  # no flwr ls


def test_ctrl_c_exits_130_and_says_how_to_stop_the_run(monkeypatch, capsys):
    fake = FakeFlwr(["Successfully started run 9\n"], interrupt=True)
    assert _submit(monkeypatch, fake) == 130
    assert fake.terminated
    assert "flwr stop 9 rehearsal" in capsys.readouterr().err
