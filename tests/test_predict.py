"""``medfed predict``: a site's model of a finished run applied to a new scan, written on the input's grid."""

from pathlib import Path

import nibabel as nib
import numpy as np
import pytest

from medfed.cli import main
from medfed.data.brats import find_cases


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, tiny_brats_root):
    """A 1-round fedavg run on the tiny data (site 2 lacks T1, as in the tiny config)."""
    from conftest import TINY_RUN

    folder = tmp_path_factory.mktemp("predict")
    config = folder / "tiny.yaml"
    config.write_text(TINY_RUN.format(root=tiny_brats_root, output=folder / "run"))
    assert main(["fit", "--config", str(config), "--quiet", "trainer.rounds=1", "strategy.name=fedavg"]) == 0
    return folder / "run"


def test_predict_writes_a_mask_on_the_input_grid_and_affine(finished_run, tiny_brats_root, tmp_path):
    case = find_cases(tiny_brats_root)[0]
    out = tmp_path / "pred.nii.gz"
    assert main(["predict", "--run", str(finished_run), "--site", "site2", "--input", str(case.image_files[0].parent), "--out", str(out)]) == 0
    written, reference = nib.load(out), nib.load(case.image_files[0])
    assert written.shape == reference.shape
    np.testing.assert_array_equal(written.affine, reference.affine)
    labels = np.asarray(written.dataobj)
    assert labels.dtype == np.uint8 and set(np.unique(labels)) <= {0, 1}

    four_files = tmp_path / "from_files.nii.gz"
    arguments = ["predict", "--run", str(finished_run), "--site", "site2", "--input", *map(str, case.image_files), "--out", str(four_files)]
    assert main(arguments) == 0
    np.testing.assert_array_equal(np.asarray(nib.load(four_files).dataobj), labels)  # the same reader, the same answer


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda a: a.__setitem__(a.index("--site") + 1, "site9"), "--site 'site9': the run has sites site0, site1, site2"),
        (lambda a: a.__setitem__(a.index("--input") + 1, "/nonexistent/case"), "/nonexistent/case: not found"),
        (lambda a: a.__setitem__(a.index("--run") + 1, "/nonexistent/run"), "--run /nonexistent/run: no config.json there"),
    ],
)
def test_bad_predict_input_is_one_line_naming_it(finished_run, tiny_brats_root, tmp_path, capsys, change, message):
    case = find_cases(tiny_brats_root)[0]
    arguments = ["predict", "--run", str(finished_run), "--site", "site0", "--input", str(case.image_files[0].parent), "--out", str(tmp_path / "p.nii.gz")]
    change(arguments)
    assert main(arguments) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and message in error
    assert not (tmp_path / "p.nii.gz").exists()


def test_an_existing_output_is_kept_without_overwrite(finished_run, tiny_brats_root, tmp_path, capsys):
    case = find_cases(tiny_brats_root)[0]
    out = tmp_path / "pred.nii.gz"
    out.write_bytes(b"earlier")
    arguments = ["predict", "--run", str(finished_run), "--site", "site0", "--input", str(case.image_files[0].parent), "--out", str(out)]
    assert main(arguments) == 2 and "exists; pass --overwrite" in capsys.readouterr().err
    assert out.read_bytes() == b"earlier"
    assert main([*arguments, "--overwrite"]) == 0 and nib.load(out).shape == nib.load(case.image_files[0]).shape


def _bomb():
    lines = ['{"a": &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"],']
    lines += [f'"{chr(98 + k)}": &{chr(98 + k)} [{",".join(["*" + chr(97 + k)] * 9)}],' for k in range(8)]
    return "\n".join(lines).rstrip(",") + "}"


@pytest.mark.parametrize(
    "content, message",
    [(_bomb(), "aliases (*name) are expanded"), ("[" * 50_000 + "]" * 50_000, "nested deeper than 64 levels")],
    ids=["alias-bomb", "50000-brackets"],
)
def test_a_hostile_config_json_in_the_run_folder_is_one_line_in_well_under_a_second(
    finished_run, tiny_brats_root, tmp_path, capsys, content, message
):
    import shutil
    import time

    run = shutil.copytree(finished_run, tmp_path / "run")
    (run / "config.json").write_text(content)
    case = find_cases(tiny_brats_root)[0]
    arguments = ["predict", "--run", str(run), "--site", "site0", "--input", str(case.image_files[0].parent), "--out", str(tmp_path / "p.nii.gz")]
    start = time.perf_counter()
    assert main(arguments) == 2
    assert time.perf_counter() - start < 1.0  # well under a second; typically a few ms
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and error.startswith(f"medfed: error: {run / 'config.json'}: not valid YAML") and message in error


def test_a_scan_whose_sequences_are_on_different_grids_is_refused_naming_the_files(finished_run, tiny_brats_root, tmp_path, capsys):
    import shutil

    case = find_cases(tiny_brats_root)[0]
    folder = shutil.copytree(case.image_files[0].parent, tmp_path / case.image_files[0].parent.name)
    t1ce = folder / case.image_files[2].name
    image = nib.load(t1ce)
    moved = image.affine.copy()
    moved[:3, 3] += (40.0, 0.0, 0.0)
    nib.save(nib.Nifti1Image(np.asarray(image.dataobj), moved, header=image.header), t1ce)
    arguments = ["predict", "--run", str(finished_run), "--site", "site0", "--input", str(folder), "--out", str(tmp_path / "p.nii.gz")]
    assert main(arguments) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and f"{t1ce}: its voxel grid differs from {case.image_files[0].name}'s (origins 40 mm apart" in error
    assert not (tmp_path / "p.nii.gz").exists()


def test_a_run_folder_whose_config_and_checkpoint_are_of_different_runs_is_one_line(finished_run, tiny_brats_root, tmp_path, capsys):
    import json
    import shutil

    run = shutil.copytree(finished_run, tmp_path / "run")
    config = json.loads((run / "config.json").read_text())
    config["model"]["channels"] = [8, 16, 32]  # another run's config.json (two runs wrote one folder)
    (run / "config.json").write_text(json.dumps(config))
    case = find_cases(tiny_brats_root)[0]
    arguments = ["predict", "--run", str(run), "--site", "site0", "--input", str(case.image_files[0].parent), "--out", str(tmp_path / "p.nii.gz")]
    assert main(arguments) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "config.json and the checkpoint round-1.ckpt are of different runs (they differ at model.channels)" in error


@pytest.mark.parametrize("out, overwrite, message", [
    ("folder", True, "is a folder; give the mask's file name"),
    ("pred.png", False, "expected a NIfTI file name ending in .nii or .nii.gz"),
    ("locked/below/pred.nii.gz", False, "cannot write in {tmp}/locked (permission denied)"),
])
def test_an_unusable_out_is_one_line_naming_it_before_anything_is_read(finished_run, tiny_brats_root, tmp_path, capsys, monkeypatch, out, overwrite, message):
    # (issue 32, item 8: an existing folder with --overwrite, a name without .nii[.gz] and an unwritable parent were tracebacks)
    import os

    import medfed.predict

    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "kept.txt").write_text("mine")
    (tmp_path / "locked").mkdir()
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode: Path(path) != tmp_path / "locked" and real_access(path, mode))
    monkeypatch.setattr("medfed.data.brats.load_case", lambda *args: pytest.fail("the scan was read"))
    case = find_cases(tiny_brats_root)[0]
    arguments = ["predict", "--run", str(finished_run), "--site", "site0", "--input", str(case.image_files[0].parent),
                 "--out", str(tmp_path / out), *(["--overwrite"] if overwrite else [])]
    assert main(arguments) == 2
    error = capsys.readouterr().err
    assert error.startswith(f"medfed: error: --out {tmp_path / out}: {message.format(tmp=tmp_path)}"), error
    assert error.count("\n") == 1 and (tmp_path / "folder" / "kept.txt").read_text() == "mine"
    assert sorted(path.name for path in (tmp_path / "locked").iterdir()) == []


def test_a_full_disk_while_the_mask_is_written_is_one_line_and_the_earlier_mask_is_kept(finished_run, tiny_brats_root, tmp_path, capsys, monkeypatch):
    import errno

    import medfed.predict

    def no_space(image, path):
        Path(path).write_bytes(b"half")
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(nib, "save", no_space)  # predict imports nibabel where it writes
    out = tmp_path / "pred.nii.gz"
    out.write_bytes(b"earlier")
    case = find_cases(tiny_brats_root)[0]
    arguments = ["predict", "--run", str(finished_run), "--site", "site0", "--input", str(case.image_files[0].parent), "--out", str(out), "--overwrite"]
    assert main(arguments) == 2
    assert capsys.readouterr().err == f"medfed: error: --out {out}: could not be written (No space left on device); nothing was replaced\n"
    assert out.read_bytes() == b"earlier" and sorted(path.name for path in tmp_path.iterdir() if path.name.startswith(".")) == []
