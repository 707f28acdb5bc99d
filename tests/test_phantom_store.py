import json

import pytest

from medfed.data.phantoms.store import MARKER, describe_generated, is_cached, write_atomically, write_marker
from medfed.errors import DataError


def _writer(text):
    def write(folder):
        (folder / "data.txt").write_text(text)
        write_marker(folder, "gen", 1, {"n": len(text)}, description=f"generated {text}", files=["data.txt"])

    return write


def test_write_then_cache_then_replace(tmp_path):
    root = tmp_path / "set"
    write_atomically(root, "gen", _writer("one"))
    assert (root / "data.txt").read_text() == "one"
    assert describe_generated(root) == "generated one"
    assert is_cached(root, "gen", 1, {"n": 3}) and not is_cached(root, "gen", 2, {"n": 3})
    assert not is_cached(root, "gen", 1, {"n": 4}) and not is_cached(root, "other", 1, {"n": 3})
    (root / "data.txt").unlink()
    assert not is_cached(root, "gen", 1, {"n": 3})  # a listed file is missing
    write_atomically(root, "gen", _writer("three"))  # its own output may be replaced
    assert (root / "data.txt").read_text() == "three"
    assert [p.name for p in tmp_path.iterdir()] == ["set"]  # no staging or retired folders left


def test_a_failed_write_leaves_the_old_data_set_intact(tmp_path):
    root = tmp_path / "set"
    write_atomically(root, "gen", _writer("one"))

    def crash(folder):
        (folder / "data.txt").write_text("half")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        write_atomically(root, "gen", crash)
    assert (root / "data.txt").read_text() == "one"
    assert [p.name for p in tmp_path.iterdir()] == ["set"]


def test_foreign_folders_are_never_replaced(tmp_path):
    root = tmp_path / "user_data"
    root.mkdir()
    (root / "scan.nii.gz").write_text("precious")
    with pytest.raises(DataError, match="refusing to replace"):
        write_atomically(root, "gen", _writer("x"))
    (root / MARKER).write_text(json.dumps({"generator": "another"}))
    with pytest.raises(DataError, match="refusing to replace"):
        write_atomically(root, "gen", _writer("x"))
    assert (root / "scan.nii.gz").read_text() == "precious"


def test_describe_generated(tmp_path):
    assert describe_generated(tmp_path) is None
    (tmp_path / MARKER).write_text("{not json")
    with pytest.raises(DataError, match=MARKER):
        describe_generated(tmp_path)
