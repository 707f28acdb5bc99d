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
