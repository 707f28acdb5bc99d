"""``medfed predict``: a site's model of a finished run applied to a new scan, written on the input's grid."""

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


def test_region_masks_become_brats_labels():
    from medfed.predict import _brats_labels

    masks = np.array([[0, 1, 1, 1], [0, 0, 1, 1], [0, 0, 0, 1]], dtype=bool).reshape(3, 4, 1, 1)  # (WT, TC, ET) per voxel
    assert _brats_labels(masks).ravel().tolist() == [0, 2, 1, 4]  # background, oedema, necrotic core, enhancing
