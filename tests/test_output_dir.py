"""The run folder: checked before any data is read, replaced without a mixture, movable, readable by others."""

import json
import os
import shutil
import stat

import pytest

from medfed.cli import INTERRUPTED, main
from medfed.federated.loop import FederatedLoop


def _fit(config, *arguments):
    return main(["fit", "--config", str(config), "--quiet", *arguments])


def _one_line_naming_output_dir(capsys):
    error = capsys.readouterr().err
    assert error.startswith("medfed: error: config key 'output_dir'") and error.count("\n") == 1, error
    return error


def test_an_output_dir_that_is_a_file_is_refused_before_any_data_is_read(tiny_run_config, tmp_path, reading_forbidden, capsys):
    (tmp_path / "run").write_text("not a folder")
    assert _fit(tiny_run_config) == 2
    assert "run is a file, expected a folder" in _one_line_naming_output_dir(capsys)
    assert _fit(tiny_run_config, f"output_dir={tmp_path / 'run' / 'below'}") == 2
    assert "run is a file, expected a folder" in _one_line_naming_output_dir(capsys)


def test_an_output_dir_that_cannot_be_written_is_refused_before_any_data_is_read(
    tiny_run_config, tmp_path, reading_forbidden, capsys, monkeypatch
):
    monkeypatch.setattr(os, "access", lambda path, mode: False)
    assert _fit(tiny_run_config) == 2
    assert f"cannot write in {tmp_path} (permission denied)" in _one_line_naming_output_dir(capsys)


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write in any folder")
def test_a_read_only_output_dir_is_refused(tiny_run_config, tmp_path, reading_forbidden, capsys):
    (tmp_path / "run").mkdir(mode=0o555)
    assert _fit(tiny_run_config) == 2
    assert "(permission denied)" in _one_line_naming_output_dir(capsys)


def test_overwrite_replaces_a_run_but_moves_no_other_files(tiny_run_config, tmp_path, finished_tiny_run, capsys):
    run = shutil.copytree(finished_tiny_run, tmp_path / "run")
    (run / "notes.txt").write_text("mine")
    assert _fit(tiny_run_config, "--overwrite") == 2
    assert "also holds 'notes.txt', which no run writes" in _one_line_naming_output_dir(capsys)
    assert _fit(tiny_run_config, "--overwrite", "--resume") == 2
    assert "pass only one" in capsys.readouterr().err

    (run / "notes.txt").unlink()
    (run / "checkpoints" / ".round-3.ckpt.4242-0a1b2c3d.tmp").write_bytes(b"a killed save")
    assert _fit(tiny_run_config, "--overwrite", "trainer.rounds=1") == 0
    assert len(json.loads((run / "results.json").read_text())["history"]) == 1
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["round-1.ckpt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run", "tiny.yaml"]  # the earlier run deleted at the end


def _tree(folder):
    return {str(path.relative_to(folder)): path.read_bytes() for path in sorted(folder.rglob("*")) if path.is_file()}


def test_an_interrupted_overwrite_keeps_the_earlier_run_whole_and_apart(tiny_run_config, tmp_path, finished_tiny_run, monkeypatch, capsys):
    run = shutil.copytree(finished_tiny_run, tmp_path / "run")
    earlier = _tree(run)
    original = FederatedLoop._run_round

    def interrupt_in_round_2(self, round_index):
        if round_index == 2:
            raise KeyboardInterrupt
        return original(self, round_index)

    monkeypatch.setattr(FederatedLoop, "_run_round", interrupt_in_round_2)
    new_run = ["strategy.name=fedavg", "trainer.rounds=2"]
    assert _fit(tiny_run_config, "--overwrite", *new_run) == INTERRUPTED
    monkeypatch.setattr(FederatedLoop, "_run_round", original)

    previous = tmp_path / "run.previous"
    assert _tree(previous) == earlier  # the earlier run, byte for byte, and nothing of the new one
    assert json.loads((run / "config.json").read_text())["strategy"]["name"] == "fedavg"
    assert not (run / "results.json").exists() and [p.name for p in (run / "checkpoints").iterdir()] == ["round-1.ckpt"]
    assert [p.name for p in (run / "csv").iterdir()] == ["version_0"]
    capsys.readouterr()

    assert _fit(tiny_run_config, "--overwrite", *new_run) == 2  # which of the two to keep is the user's call
    assert "run.previous the run it replaces" in _one_line_naming_output_dir(capsys)
    assert _fit(tiny_run_config, "--resume", *new_run) == 0
    assert json.loads((run / "results.json").read_text())["strategy"] == "fedavg"
    assert not previous.exists()  # deleted once the new run finished


def test_a_moved_run_folder_resumes_to_the_same_metrics(tiny_run_config, tmp_path, finished_tiny_run):
    moved_from = shutil.copytree(finished_tiny_run, tmp_path / "elsewhere")  # its config names another folder
    (moved_from / "checkpoints" / "round-2.ckpt").unlink()  # as if interrupted in round 2
    (moved_from / "results.json").unlink()
    moved_from.rename(tmp_path / "run")
    assert _fit(tiny_run_config, "--resume", "trainer.rounds=2") == 0
    resumed, uninterrupted = (json.loads((folder / "results.json").read_text()) for folder in (tmp_path / "run", finished_tiny_run))
    assert [r["metrics"] for r in resumed["history"]] == [r["metrics"] for r in uninterrupted["history"]]
    assert resumed["communication"] == uninterrupted["communication"]
    assert not moved_from.exists()  # nothing written where the folder was


def test_the_run_folder_is_readable_by_other_users(finished_tiny_run):
    for path in [finished_tiny_run, *finished_tiny_run.rglob("*")]:
        assert stat.S_IMODE(path.stat().st_mode) == (0o755 if path.is_dir() else 0o644), path


# --- one run at a time (issue 24) ---------------------------------------------------------------------

_HOLD = """
import sys, time
from pathlib import Path
from medfed.output_dir import hold_output_dir
with hold_output_dir(Path(sys.argv[1])):
    print("held", flush=True)
    time.sleep(120)
"""


@pytest.fixture
def held_by_another_process(tmp_path):
    """A live process holding ``tmp_path/run`` (yields it); killed with SIGKILL at the end, as a crashed run would die."""
    import subprocess
    import sys

    holder = subprocess.Popen([sys.executable, "-c", _HOLD, str(tmp_path / "run")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        yield holder
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.parametrize("arguments", [(), ("--resume",), ("--overwrite",)])
def test_a_second_run_on_a_held_output_dir_is_refused_naming_the_holder(
    tiny_run_config, tmp_path, finished_tiny_run, reading_forbidden, capsys, held_by_another_process, arguments
):
    import socket

    shutil.copytree(finished_tiny_run, tmp_path / "run")
    before = {path: path.read_bytes() for path in (tmp_path / "run").rglob("*") if path.is_file()}
    assert _fit(tiny_run_config, *arguments) == 2
    error = _one_line_naming_output_dir(capsys)
    assert f"is being written by another run (pid {held_by_another_process.pid} on host {socket.gethostname()}, started 20" in error
    assert {path: path.read_bytes() for path in (tmp_path / "run").rglob("*") if path.is_file()} == before  # untouched


def test_the_lock_of_a_killed_run_is_taken_over(tiny_run_config, tmp_path, finished_tiny_run, held_by_another_process, caplog):
    import logging

    shutil.copytree(finished_tiny_run, tmp_path / "run")
    dead = held_by_another_process.pid
    held_by_another_process.kill()
    held_by_another_process.wait()
    assert (tmp_path / "run.lock").exists()  # a kill -9 leaves the file, not the lock
    with caplog.at_level(logging.INFO, logger="medfed"):  # without --quiet, which keeps info lines back
        assert main(["fit", "--config", str(tiny_run_config), "--resume", "trainer.rounds=3"]) == 0
    assert any(f"no longer running (pid {dead} on host" in message for message in caplog.messages)
    assert not (tmp_path / "run.lock").exists()
    assert json.loads((tmp_path / "run" / "results.json").read_text())["history"][-1]["round"] == 3


def test_one_process_cannot_hold_a_folder_twice_and_the_lock_goes_with_the_block(tmp_path):
    from medfed.errors import ConfigError
    from medfed.output_dir import hold_output_dir, lock_file

    with hold_output_dir(tmp_path / "run"):
        with pytest.raises(ConfigError, match=rf"is being written by another run \(pid {os.getpid()} on host"):
            with hold_output_dir(tmp_path / "run"):
                pass
    assert not lock_file(tmp_path / "run").exists()
    with hold_output_dir(tmp_path / "run"):  # free again
        assert lock_file(tmp_path / "run").exists()


def test_two_overwrites_at_once_end_as_one_run_and_one_refusal_without_a_traceback(tiny_run_config, tmp_path, finished_tiny_run):
    import subprocess
    import sys

    shutil.copytree(finished_tiny_run, tmp_path / "run")
    command = [sys.executable, "-m", "medfed", "fit", "--config", str(tiny_run_config), "--quiet", "--overwrite", "trainer.rounds=1"]
    runs = [subprocess.Popen([*command, f"trainer.seed={seed}"], stderr=subprocess.PIPE, text=True, cwd=os.getcwd()) for seed in (1, 2)]
    outcomes = sorted((run.wait(timeout=600), run.stderr.read()) for run in runs)
    # started together, each holds the folder for the many seconds its run takes (both exited 0 before, one run silently lost)
    assert [status for status, _ in outcomes] == [0, 2], outcomes
    assert not any("Traceback" in err or "OSError" in err for _, err in outcomes), outcomes
    assert "is being written by another run (pid" in outcomes[1][1] and outcomes[1][1].count("medfed: error") == 1
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert results["config"] == json.loads((tmp_path / "run" / "config.json").read_text())
    assert len(results["history"]) == 1 and not (tmp_path / "run.previous").exists()


def test_a_full_disk_while_a_run_writes_is_one_line_naming_the_file_and_how_to_resume(tiny_run_config, tmp_path, capsys, monkeypatch):
    import errno

    import medfed.experiment

    def no_space(figure, path):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(medfed.experiment, "save_figure", no_space)  # the disk fills while the figures are written
    assert _fit(tiny_run_config, "trainer.rounds=1") == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "Traceback" not in error, error
    assert error.startswith(f"medfed: error: {tmp_path / 'run'}/") and "could not be written (No space left on device); " in error
    assert "MiB free under" in error and "--resume" in error
    assert (tmp_path / "run" / "checkpoints" / "round-1.ckpt").exists()  # what was written before stays


# --- a lock planted as a link (issue 32, item 1) ----------------------------------------------------------


def _plant(kind, lock, victim):
    if kind == "symlink":
        lock.symlink_to(victim)
    elif kind == "dangling symlink":
        lock.symlink_to(victim.with_name("created-by-a-run"))
    elif kind == "hard link":
        os.link(victim, lock)
    else:
        os.mkfifo(lock)


_PLANTED = {
    "symlink": "is a symbolic link",
    "dangling symlink": "is a symbolic link",
    "hard link": "is a file with 2 names (a hard link)",
    "fifo": "is not a regular file",
}


@pytest.mark.parametrize("kind", sorted(_PLANTED))
def test_a_lock_planted_as_a_link_is_refused_and_nothing_is_written_through_it(
    tiny_run_config, tmp_path, reading_forbidden, capsys, kind
):
    # (fit truncated a symlinked lock's target to its 67-byte lock JSON, exited 0 and removed the link;
    # a dangling one made it create a file at a path of someone else's choosing)
    victim = tmp_path / "elsewhere" / "precious.txt"
    victim.parent.mkdir()
    victim.write_bytes(b"x" * 1221)
    lock = tmp_path / "run.lock"
    _plant(kind, lock, victim)
    assert _fit(tiny_run_config) == 2
    error = _one_line_naming_output_dir(capsys)
    assert f"its lock file {lock} {_PLANTED[kind]}, not a lock a run wrote" in error, error
    assert victim.read_bytes() == b"x" * 1221
    assert sorted(p.name for p in victim.parent.iterdir()) == ["precious.txt"]  # no file created at the link's target
    assert os.path.lexists(lock) and not (tmp_path / "run").exists()  # the planted entry left for its owner to see


def test_a_lock_swapped_for_a_link_during_the_run_is_not_what_the_run_deletes(tmp_path):
    from medfed.output_dir import hold_output_dir, lock_file

    victim = tmp_path / "precious.txt"
    victim.write_text("mine")
    lock = lock_file(tmp_path / "run")
    with hold_output_dir(tmp_path / "run"):
        lock.unlink()
        lock.symlink_to(victim)
    assert lock.is_symlink() and victim.read_text() == "mine"


def test_a_newline_in_a_folder_name_keeps_the_error_one_line(tiny_run_config, tmp_path, reading_forbidden, capsys):
    # (issue 32, item 8: the path's newline split the one-line error in two)
    odd = tmp_path / "two\nlines"
    odd.write_text("a file, not a folder")
    text = tiny_run_config.read_text()
    tiny_run_config.write_text(text.replace(f"output_dir: {tmp_path / 'run'}", f"output_dir: {json.dumps(str(odd / 'run'))}"))
    assert _fit(tiny_run_config) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and error.endswith(f"{tmp_path}/two\\nlines is a file, expected a folder (or a path that does not exist yet)\n"), error
    # an override cannot carry it: YAML would fold the line break into a space, a path of another folder
    assert _fit(tiny_run_config, f"output_dir={odd / 'run'}") == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "its value holds a line break or NUL; write it YAML-quoted in the config file" in error, error
