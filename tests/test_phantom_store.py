import fcntl
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

import medfed.tasks.brats
from medfed.components import resolve
from medfed.config import load_config
from medfed.data.phantoms.store import MARKER, describe_generated, hold, is_cached, write_marker
from medfed.errors import DataError

REPOSITORY = Path(__file__).resolve().parents[1]


def _writer(text):
    def write(folder):
        (folder / "data.txt").write_text(text)
        write_marker(folder, "gen", 1, {"n": len(text)}, description=f"generated {text}", files=["data.txt"])

    return write


def _generate(root, text):
    with hold(root, "gen", 1, {"n": len(text)}, _writer(text)) as path:
        return path


def _siblings(root):
    return sorted(p.name for p in root.parent.iterdir())


def test_write_then_cache_then_replace(tmp_path):
    root = tmp_path / "set"
    assert _generate(root, "one") == root
    assert (root / "data.txt").read_text() == "one"
    assert describe_generated(root) == "generated one"
    assert is_cached(root, "gen", 1, {"n": 3}) and not is_cached(root, "gen", 2, {"n": 3})
    assert not is_cached(root, "gen", 1, {"n": 4}) and not is_cached(root, "other", 1, {"n": 3})
    (root / "data.txt").unlink()
    assert not is_cached(root, "gen", 1, {"n": 3})  # a listed file is missing
    _generate(root, "one")
    assert (root / "data.txt").read_text() == "one"
    _generate(root, "three")  # its own output may be replaced
    assert (root / "data.txt").read_text() == "three"
    assert _siblings(root) == [".set.lock", "set"]  # no staging or retired folders left


def test_a_failed_write_leaves_the_old_data_set_intact(tmp_path):
    root = tmp_path / "set"
    _generate(root, "one")

    def crash(folder):
        (folder / "data.txt").write_text("half")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        with hold(root, "gen", 1, {"n": 4}, crash):
            pass
    assert (root / "data.txt").read_text() == "one"
    assert _siblings(root) == [".set.lock", "set"]


def test_staging_folders_a_killed_generator_left_are_removed_at_the_next_start(tmp_path):
    root = tmp_path / "set"
    _generate(root, "one")
    for stale in (".set.partial", ".set.partial-k3j2h1", ".set.old"):
        (tmp_path / stale).mkdir()
        (tmp_path / stale / "data.txt").write_text("half")
    _generate(root, "one")  # cached: only read
    assert _siblings(root) == [".set.lock", "set"]


def test_folders_and_files_are_readable_by_other_users(tmp_path):
    umask = os.umask(0o022)
    try:
        root = _generate(tmp_path / "shared" / "set", "one")
    finally:
        os.umask(umask)
    for path in (root, root / "data.txt", root / MARKER, root.parent / ".set.lock"):
        assert stat.S_IMODE(path.stat().st_mode) == (0o755 if path.is_dir() else 0o644), path


def test_foreign_folders_are_never_replaced(tmp_path):
    root = tmp_path / "user_data"
    root.mkdir()
    (root / "scan.nii.gz").write_text("precious")
    with pytest.raises(DataError, match="refusing to replace"):
        _generate(root, "x")
    (root / MARKER).write_text(json.dumps({"generator": "another"}))
    with pytest.raises(DataError, match="refusing to replace"):
        _generate(root, "x")
    assert (root / "scan.nii.gz").read_text() == "precious"


def test_describe_generated(tmp_path):
    assert describe_generated(tmp_path) is None
    (tmp_path / MARKER).write_text("{not json")
    with pytest.raises(DataError, match=MARKER):
        describe_generated(tmp_path)


GENERATE_IN_ANOTHER_PROCESS = """
import logging
import sys
from pathlib import Path
from medfed.data.phantoms.store import hold, write_marker

def write(folder):
    (folder / "data.txt").write_text("three")
    write_marker(folder, "gen", 1, {"n": 5}, description="generated three", files=["data.txt"])

logging.basicConfig(level=logging.INFO, format="%(message)s")
with hold(Path(sys.argv[1]), "gen", 1, {"n": 5}, write) as root:
    print((root / "data.txt").read_text())
"""


def test_a_generation_with_other_parameters_waits_until_a_reader_is_done(tmp_path):
    root = tmp_path / "set"
    with hold(root, "gen", 1, {"n": 3}, _writer("one")) as held:
        other = subprocess.Popen(
            [sys.executable, "-c", GENERATE_IN_ANOTHER_PROCESS, str(root)],
            cwd=REPOSITORY,
            env={**os.environ, "PYTHONPATH": str(REPOSITORY)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert other.stderr.readline().startswith(f"waiting for another medfed run using the data set at {root}")
        assert other.poll() is None
        assert (held / "data.txt").read_text() == "one" and _siblings(root) == [".set.lock", "set"]
    stdout, stderr = other.communicate(timeout=60)
    assert other.returncode == 0, stderr
    assert stdout == "three\n" and (root / "data.txt").read_text() == "three"


def test_a_task_holds_its_generated_data_set_while_it_reads_it(tiny_run_config, tiny_brats_root, monkeypatch):
    lock = tiny_brats_root.with_name(f".{tiny_brats_root.name}.lock")

    def held():
        with open(lock) as other_run:  # try another run's exclusive lock, as a generator would take it
            try:
                fcntl.flock(other_run, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return True
            return False

    original = medfed.tasks.brats.load_case
    checked = []

    def load_case(case, resample=False):
        checked.append(held())
        return original(case, resample)

    monkeypatch.setattr(medfed.tasks.brats, "load_case", load_case)
    resolved = resolve(load_config(tiny_run_config, ["data.cache=false"]))
    federation = resolved.task.build_federation(resolved.data_options, resolved.run.federation, seed=0, progress=False)
    assert checked and all(checked)  # while the federation is built
    assert not held()
    volumes = federation.volumes.site_volumes(0)
    next(volumes)
    assert held()  # while whole volumes are evaluated
    volumes.close()
    assert not held()
