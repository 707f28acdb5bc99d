"""Checkpoints: checksummed, the newest k kept, every damage a one-line error before any data is read."""

import errno
import io
import json
import shutil

import pytest
import torch

import medfed.checkpoint as checkpoint_module
from medfed.checkpoint import FOLDER, checkpoints, read_checkpoint, resume_state, save_checkpoint
from medfed.cli import main
from medfed.errors import DataError


def _state(round_index):
    site = {"slots": {"model": {"module": {"weight": torch.arange(4.0)}, "optimizer": {}}}, "generator": None, "data_orders": {}, "strategy": {}}
    return {"round": round_index, "config": {"trainer": {"rounds": 9}}, "sites": [site], "links": []}


def test_a_checkpoint_round_trips(tmp_path):
    state = {**_state(1), "generator": torch.Generator().manual_seed(3).get_state(), "history": [{"mean": {"iou": 0.5}}]}
    loaded = read_checkpoint(save_checkpoint(tmp_path, state, keep=1))
    assert torch.equal(loaded["sites"][0]["slots"]["model"]["module"]["weight"], torch.arange(4.0)) and torch.equal(loaded["generator"], state["generator"])
    assert loaded["history"] == state["history"] and loaded["config"] == state["config"]


def test_only_the_newest_checkpoints_are_kept(tmp_path):
    for round_index in (1, 2, 9, 10):
        save_checkpoint(tmp_path, _state(round_index), keep=2)
    assert [path.name for path in checkpoints(tmp_path)] == ["round-9.ckpt", "round-10.ckpt"]
    assert sorted(path.name for path in tmp_path.iterdir()) == ["round-10.ckpt", "round-9.ckpt"]  # no temporary left


def test_stale_temporaries_are_removed_when_a_run_resumes(tmp_path, finished_tiny_run):
    run = shutil.copytree(finished_tiny_run, tmp_path / "run")
    stale = [run / FOLDER / ".round-3.ckpt.4242-0a1b2c3d.tmp", run / ".results.json.4242-0a1b2c3d.tmp"]
    for path in stale:
        path.write_bytes(b"half a save")
    config = json.loads((run / "config.json").read_text())
    assert resume_state(run, config)["round"] == 2
    assert not any(path.exists() for path in stale)


def _truncated(data):
    return data[: len(data) // 2]


def _zeroed(data):
    return b""


def _garbled(data):
    return bytes(255 - byte for byte in data)


def _one_weight_edited(data):
    """The payload saved again with one weight changed, the old checksum trailer kept."""
    cut = data.rindex(b"\nmedfed checkpoint sha256 ")
    payload, trailer = data[:cut], data[cut:]
    state = torch.load(io.BytesIO(payload), weights_only=True)
    weights = next(iter(state["sites"][0]["slots"]["model"]["module"].values()))
    weights.view(-1)[0] += 0.5
    edited = io.BytesIO()
    torch.save(state, edited)
    return edited.getvalue() + trailer


@pytest.mark.parametrize("damage", [_truncated, _zeroed, _garbled, _one_weight_edited])
def test_a_damaged_checkpoint_is_one_line_naming_it_and_the_previous_one(
    tiny_run_config, tmp_path, finished_tiny_run, reading_forbidden, capsys, damage
):
    run = shutil.copytree(finished_tiny_run, tmp_path / "run")
    newest = run / FOLDER / "round-2.ckpt"
    newest.write_bytes(damage(newest.read_bytes()))
    assert main(["fit", "--config", str(tiny_run_config), "--quiet", "--resume"]) == 2
    error = capsys.readouterr().err
    assert error.startswith(f"medfed: error: --resume: checkpoint {newest} ") and error.count("\n") == 1
    assert "previous checkpoint round-1.ckpt is intact: move round-2.ckpt out of" in error and "Traceback" not in error


def test_following_the_advice_resumes_from_the_previous_checkpoint(tiny_run_config, tmp_path, finished_tiny_run, capsys):
    run = shutil.copytree(finished_tiny_run, tmp_path / "run")
    newest = run / FOLDER / "round-2.ckpt"
    newest.write_bytes(_garbled(newest.read_bytes()))
    (run / FOLDER / "round-1.ckpt").write_bytes(b"")
    assert main(["fit", "--config", str(tiny_run_config), "--quiet", "--resume"]) == 2
    assert "no earlier checkpoint is intact; start the run again with --overwrite" in capsys.readouterr().err

    shutil.copy(finished_tiny_run / FOLDER / "round-1.ckpt", run / FOLDER)
    newest.rename(tmp_path / "round-2.ckpt.damaged")
    assert main(["fit", "--config", str(tiny_run_config), "--quiet", "--resume", "trainer.rounds=2"]) == 0
    history = json.loads((run / "results.json").read_text())["history"]
    assert [record["round"] for record in history] == [1, 2]


class _RunsCode:
    """Unpickling this would create ``marker``."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return open, (str(self.marker), "w")


def test_a_crafted_checkpoint_is_refused_without_running_its_code(tiny_run_config, tmp_path, finished_tiny_run, capsys, monkeypatch):
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")  # torch.load's own default would run it
    run = shutil.copytree(finished_tiny_run, tmp_path / "run")
    marker = tmp_path / "code-ran"
    crafted = save_checkpoint(run / FOLDER, {**_state(3), "sites": _RunsCode(marker)}, keep=3)  # a valid checksum
    with pytest.raises(DataError, match="refused by torch.load.weights_only=True"):
        read_checkpoint(crafted)
    assert main(["fit", "--config", str(tiny_run_config), "--quiet", "--resume"]) == 2
    error = capsys.readouterr().err
    assert f"checkpoint {crafted} cannot be unpickled safely" in error and "round-2.ckpt is intact" in error
    assert not marker.exists()


def test_resuming_with_fewer_rounds_than_done_is_refused(tiny_run_config, tmp_path, finished_tiny_run, reading_forbidden, capsys):
    shutil.copytree(finished_tiny_run, tmp_path / "run")
    assert main(["fit", "--config", str(tiny_run_config), "--quiet", "--resume", "trainer.rounds=1"]) == 2
    error = capsys.readouterr().err
    assert error.startswith("medfed: error: config key 'trainer.rounds' = 1: the run to resume has done 2 rounds")


def test_resuming_with_another_config_is_refused(tiny_run_config, tmp_path, finished_tiny_run, reading_forbidden, capsys):
    shutil.copytree(finished_tiny_run, tmp_path / "run")
    assert main(["fit", "--config", str(tiny_run_config), "--quiet", "--resume", "trainer.seed=1"]) == 2
    assert "the config differs from the checkpoint's" in capsys.readouterr().err


@pytest.mark.parametrize(
    "failure",
    [
        RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 31426816 vs 31426704"),  # torch on a full disk
        OSError(errno.ENOSPC, "No space left on device"),
    ],
)
def test_a_checkpoint_that_cannot_be_written_is_one_error_naming_it_and_the_earlier_ones_stay(tmp_path, monkeypatch, failure):
    save_checkpoint(tmp_path, {"round": 1, "config": {}, "sites": []}, keep=2)
    before = (tmp_path / "round-1.ckpt").read_bytes()

    def failing_save(state, file):
        file.write(b"partial")
        raise failure

    monkeypatch.setattr(torch, "save", failing_save)  # the torch medfed.checkpoint imports when it saves
    with pytest.raises(DataError) as raised:
        save_checkpoint(tmp_path, {"round": 2, "config": {}, "sites": []}, keep=2)
    message = str(raised.value)
    assert str(tmp_path / "round-2.ckpt") in message and "MiB free" in message and "--resume" in message
    assert ("unexpected pos" in message) if isinstance(failure, RuntimeError) else ("No space left on device" in message)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["round-1.ckpt"]  # no temporary left, the earlier one intact
    assert (tmp_path / "round-1.ckpt").read_bytes() == before


def _without(state, *path):
    """``state`` with the entry at ``path`` (keys and list indices) deleted."""
    import copy

    changed = copy.deepcopy(state)
    holder = changed
    for key in path[:-1]:
        holder = holder[key]
    del holder[path[-1]]
    return changed


@pytest.mark.parametrize(
    "path, message",
    [
        (("links",), "lacks the key 'links'"),
        (("sites", 0, "strategy"), "site 0's state lacks the key 'strategy'"),
        (("sites", 0, "slots", "model", "module"), "site 0's model slot 'model' lacks the key 'module'"),
    ],
)
def test_a_checkpoint_passing_its_checksum_but_lacking_a_key_is_one_line(tmp_path, path, message):
    written = save_checkpoint(tmp_path, _without(_state(1), *path), keep=1)  # a valid checksum over an incomplete state
    with pytest.raises(DataError) as info:
        read_checkpoint(written)
    assert str(info.value).startswith(f"checkpoint {written}") and message in str(info.value)


def test_resuming_from_a_checkpoint_lacking_the_loops_state_is_one_line_naming_the_previous_one(
    tiny_run_config, tmp_path, finished_tiny_run, capsys
):
    run = shutil.copytree(finished_tiny_run, tmp_path / "run")
    newest = checkpoints(run / FOLDER)[-1]
    state = read_checkpoint(newest)
    del state["server"]
    save_checkpoint(run / FOLDER, state, keep=5)  # the same round, rewritten with a valid checksum
    assert main(["fit", "--config", str(tiny_run_config), "--quiet", "--resume"]) == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"checkpoint {newest} lacks the key 'server'" in error and "Traceback" not in error


def test_a_background_checkpoint_holds_the_state_of_its_round_while_training_goes_on(tmp_path, monkeypatch):
    writes = []
    original = checkpoint_module.save_checkpoint

    def slow_save(folder, state, keep):  # the writer is still at it when the loop changes its tensors
        writes.append(state["round"])
        release.wait(10)
        return original(folder, state, keep)

    import threading

    release = threading.Event()
    monkeypatch.setattr(checkpoint_module, "save_checkpoint", slow_save)
    writer = checkpoint_module.BackgroundCheckpoints(tmp_path, {"trainer": {"rounds": 9}}, keep=2)
    state = _state(1)
    weight = state["sites"][0]["slots"]["model"]["module"]["weight"]
    writer({key: value for key, value in state.items() if key != "config"})  # returns at once: the copy is taken
    weight.add_(100.0)  # the next round trains in place
    release.set()
    writer.wait()
    saved = read_checkpoint(tmp_path / FOLDER / "round-1.ckpt")
    assert torch.equal(saved["sites"][0]["slots"]["model"]["module"]["weight"], torch.arange(4.0))  # round 1's values
    assert saved["config"] == {"trainer": {"rounds": 9}} and writes == [1] and writer.write_s > 0


def test_a_background_write_that_fails_raises_at_the_next_checkpoint_and_the_earlier_ones_stay(tmp_path, monkeypatch):
    writer = checkpoint_module.BackgroundCheckpoints(tmp_path, {}, keep=2)
    writer({"round": 1, "sites": [], "links": []})
    writer.wait()

    def failing_save(state, file):
        file.write(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", failing_save)  # the module imports torch where it writes
    writer({"round": 2, "sites": [], "links": []})  # the training thread goes on
    with pytest.raises(DataError, match="round-2.ckpt could not be written.*No space left"):
        writer({"round": 3, "sites": [], "links": []})
    assert [path.name for path in checkpoints(tmp_path / FOLDER)] == ["round-1.ckpt"]
    writer.wait()  # the error was raised once
