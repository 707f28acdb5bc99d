import os
import stat

import pytest

from medfed.atomic import atomic_write, remove_stale_temporaries


@pytest.fixture
def umask_022():
    previous = os.umask(0o022)
    yield
    os.umask(previous)


def _mode(path):
    return stat.S_IMODE(path.stat().st_mode)


def test_a_written_file_has_the_mode_a_plain_open_gives(tmp_path, umask_022):
    path = tmp_path / "new" / "results.json"
    with atomic_write(path) as handle:
        handle.write("{}")
    assert path.read_text() == "{}" and _mode(path) == 0o644
    assert [p.name for p in path.parent.iterdir()] == ["results.json"]


def test_an_interrupted_write_leaves_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "results.json"
    path.write_text("old")
    with pytest.raises(KeyboardInterrupt):
        with atomic_write(path, "wb") as handle:
            handle.write(b"half of the new")
            raise KeyboardInterrupt
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["results.json"]


def test_stale_temporaries_are_removed_and_nothing_else(tmp_path):
    (tmp_path / "results.json").write_text("kept")
    (tmp_path / ".hidden").write_text("kept")
    stale = [tmp_path / ".results.json.4242-0a1b2c3d.tmp", tmp_path / ".last.ckpt.tmp"]
    for path in stale:
        path.write_text("torn")
    assert remove_stale_temporaries(tmp_path) == sorted(stale)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".hidden", "results.json"]
    assert remove_stale_temporaries(tmp_path / "missing") == []
