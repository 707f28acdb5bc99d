"""The command line: whole-config checks before any data is read, --print-config, Ctrl-C, an installed package."""

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import nibabel
import numpy as np
import pytest
import torch
import yaml

from medfed.cli import INTERRUPTED, main
from medfed.components import resolve
from medfed.config import load_config
from medfed.federated.loop import FederatedLoop

REPOSITORY = Path(__file__).resolve().parents[1]


BAD_OVERRIDES = [
    ("strategy.pfednet.lamda=3", "strategy.pfednet.lamda"),
    ("strategy.name=pfednett", "strategy.name"),
    ("model.lr=-1", "model.lr"),
    ("model.name=densenet", "model.name"),
    ("data.patch_size=7", "data.patch_size"),
    ("codec.up=zip", "codec.up"),
]
if not torch.cuda.is_available():
    BAD_OVERRIDES.append(("trainer.device=cuda", "trainer.device"))


@pytest.mark.parametrize("override, key", BAD_OVERRIDES)
def test_a_bad_config_fails_before_any_data_is_read(tiny_run_config, tmp_path, capsys, reading_forbidden, override, key):
    assert main(["fit", "--config", str(tiny_run_config), "--quiet", override]) == 2
    error = capsys.readouterr().err
    assert error.startswith("medfed: error: ") and error.count("\n") == 1 and f"'{key}" in error
    assert not (tmp_path / "run").exists()


def test_print_config_prints_the_full_resolved_config_and_touches_nothing(tiny_run_config, tmp_path, capsys, reading_forbidden):
    assert main(["fit", "--config", str(tiny_run_config), "--print-config", "strategy.name=fedavg"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed == resolve(load_config(tiny_run_config, ["strategy.name=fedavg"])).config
    assert printed["strategy"]["name"] == "fedavg" and "server_lr" in printed["strategy"]["pfednet"]
    assert printed["model"]["dropout"] == 0.0  # a component default the YAML never mentions
    assert not (tmp_path / "run").exists()


def _interrupt_in_round(monkeypatch, interrupted_round):
    original = FederatedLoop._run_round

    def interrupt(self, round_index):
        if round_index == interrupted_round:
            raise KeyboardInterrupt
        return original(self, round_index)

    monkeypatch.setattr(FederatedLoop, "_run_round", interrupt)
    return original


def test_ctrl_c_ends_with_one_line_saying_how_to_resume(tiny_run_config, tmp_path, capsys, monkeypatch):
    original = _interrupt_in_round(monkeypatch, 2)
    arguments = ["fit", "--config", str(tiny_run_config), "--quiet", "strategy.name=fedavg"]
    assert main(arguments) == INTERRUPTED
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "Traceback" not in error
    assert error.startswith(f"medfed: interrupted; every finished round is checkpointed in {tmp_path / 'run' / 'checkpoints'}")
    command = shlex.split(error.split("continue with: ")[1])
    assert command[:4] == ["python", "-m", "medfed", "fit"] and command[-1] == "--resume"
    monkeypatch.setattr(FederatedLoop, "_run_round", original)
    assert main(command[3:]) == 0  # the printed command resumes the run
    assert (tmp_path / "run" / "results.json").is_file()


def test_ctrl_c_before_any_round_finished_says_there_is_nothing_to_resume(tiny_run_config, capsys, monkeypatch):
    _interrupt_in_round(monkeypatch, 1)
    assert main(["fit", "--config", str(tiny_run_config), "--quiet", "strategy.name=local"]) == INTERRUPTED
    assert "no round had finished, so there is nothing to resume" in capsys.readouterr().err


def test_a_non_editable_install_runs_a_bundled_config_without_the_repository(tmp_path):
    wheels, target, elsewhere = tmp_path / "wheels", tmp_path / "site", tmp_path / "elsewhere"
    elsewhere.mkdir()
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", wheels, REPOSITORY], check=True, capture_output=True)
    (wheel,) = wheels.glob("medfed-*.whl")
    subprocess.run([*pip, "install", "--no-deps", "--target", target, wheel], check=True, capture_output=True)
    environment = {**os.environ, "PYTHONPATH": str(target), "OMP_NUM_THREADS": "1"}
    imported = subprocess.run(
        [sys.executable, "-c", "import medfed; print(medfed.__file__)"], cwd=elsewhere, env=environment, capture_output=True, text=True
    )
    assert Path(imported.stdout.strip()).is_relative_to(target)
    overrides = ["trainer.rounds=1", "trainer.num_threads=1", "logger.wandb=disabled", "output_dir=out"]
    fit = subprocess.run(
        [sys.executable, "-m", "medfed", "fit", "--config", "clinical_delta2", "--quiet", *overrides],
        cwd=elsewhere,
        env=environment,
        capture_output=True,
        text=True,
    )
    assert fit.returncode == 0, fit.stderr
    assert (elsewhere / "out" / "results.json").is_file()


def _broken_copy(tiny_brats_root, tmp_path, damage):
    root = tmp_path / "broken"
    shutil.copytree(tiny_brats_root, root)
    damage(root)
    return root


def _empty_case_folder(root):
    (root / "HGG" / "Brats17_EMPTY_1").mkdir()


def _no_tumour_anywhere(root):
    for segmentation in root.rglob("*_seg.nii.gz"):
        image = nibabel.load(segmentation)
        nibabel.save(nibabel.Nifti1Image(np.zeros(image.shape, dtype=np.uint8), image.affine), segmentation)


@pytest.mark.parametrize(
    "damage, overrides, named",
    [
        (_empty_case_folder, [], "Brats17_EMPTY_1"),
        (_no_tumour_anywhere, [], "site0"),
        (lambda root: None, ["federation.n_sites=9"], "'federation.n_sites'"),
    ],
)
def test_broken_data_fails_with_one_line_and_leaves_no_output_and_no_cache(
    tiny_run_config, tiny_brats_root, tmp_path, capsys, damage, overrides, named
):
    root = _broken_copy(tiny_brats_root, tmp_path, damage)
    cache = tmp_path / "cache"
    arguments = ["fit", "--config", str(tiny_run_config), "--quiet", "data.generate=null", f"data.root={root}", f"data.cache_dir={cache}"]
    assert main([*arguments, *overrides]) == 2
    error = capsys.readouterr().err
    assert error.startswith("medfed: error: ") and error.count("\n") == 1 and named in error
    assert not (tmp_path / "run").exists()
    assert not cache.exists() or not any(path.is_file() for path in cache.rglob("*"))
