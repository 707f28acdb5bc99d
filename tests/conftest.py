"""Shared fixtures: a private preprocessed-data cache, tiny generated BraTS and LUNA16 data sets, a tiny run config on it, a finished run, no data reading."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import nibabel
import pytest

import medfed.tasks.brats
from medfed.cli import main
from medfed.data.phantoms.brats import generate_brats_phantoms
from medfed.data.phantoms.luna16 import generate_luna16_phantoms

TINY_RUN = """
data:
  task: brats
  root: {root}
  generate: {{cases_per_site: 3, seed: 0, resolution_mm: 4.0}}
  patch_size: 32
  tumour_patches_per_case: 4
  background_patches_per_case: 2
federation:
  n_sites: 3
  missing_channel: {{channel: 1, sites: [2]}}
model:
  name: unet
  channels: [4, 8, 16]
  strides: [2, 2]
  num_res_units: 1
strategy:
  name: pfednet
  pfednet: {{lam: 0.3, min_sketch_samples: 4}}
trainer:
  rounds: 3
  batch_size: 8
  seed: 0
  num_threads: 1
logger:
  wandb: disabled
output_dir: {output}
"""


@pytest.fixture(scope="session", autouse=True)
def private_cache_home(tmp_path_factory) -> Iterator[Path]:
    """XDG_CACHE_HOME in a temporary folder for the whole session (inherited by CLI subprocesses).

    The preprocessed-data cache (``medfed.data.cache``) then never writes to
    the home folder.
    """
    cache_home = tmp_path_factory.mktemp("xdg_cache")
    previous = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = str(cache_home)
    yield cache_home
    if previous is None:
        del os.environ["XDG_CACHE_HOME"]
    else:
        os.environ["XDG_CACHE_HOME"] = previous


@pytest.fixture(scope="session")
def tiny_brats_root(tmp_path_factory) -> Path:
    """3 sites x 3 generated cases at 4 mm, written once per test session."""
    root = tmp_path_factory.mktemp("data") / "brats2017"
    return generate_brats_phantoms(root, n_sites=3, cases_per_site=3, seed=0, resolution_mm=4.0, progress=False)


@pytest.fixture(scope="session")
def tiny_luna_root(tmp_path_factory) -> Path:
    """3 sites x 4 generated series, 64 x 64 in-plane, 2-3 nodules and 12 other candidates each, written once per test session."""
    return generate_luna16_phantoms(
        tmp_path_factory.mktemp("luna") / "luna16", seed=1, n_sites=3, series_per_site=4, matrix_size=64, z_extent_mm=20.0,
        nodules_per_series=(2, 3), nodule_diameter_mm=(3.0, 6.0), negatives_per_series=12, progress=False,
    )


@pytest.fixture
def tiny_run_config(tmp_path, tiny_brats_root) -> Path:
    """A YAML run config on the tiny data set, output under ``tmp_path/run``."""
    path = tmp_path / "tiny.yaml"
    path.write_text(TINY_RUN.format(root=tiny_brats_root, output=tmp_path / "run"))
    return path


@pytest.fixture(scope="session")
def finished_tiny_run(tmp_path_factory, tiny_brats_root) -> Path:
    """The output folder of a finished 2-round run of the tiny config, written under umask 022 (copy it to change it)."""
    folder = tmp_path_factory.mktemp("finished")
    config = folder / "tiny.yaml"
    config.write_text(TINY_RUN.format(root=tiny_brats_root, output=folder / "run"))
    umask = os.umask(0o022)
    try:
        assert main(["fit", "--config", str(config), "--quiet", "trainer.rounds=2"]) == 0
    finally:
        os.umask(umask)
    return folder / "run"


@pytest.fixture
def reading_forbidden(monkeypatch):
    """Make every way the BraTS task reaches its files fail loudly."""

    def forbidden(*args, **kwargs):
        raise AssertionError("data were read before the config was checked")

    for name in ("find_cases", "load_case", "brats_phantoms"):
        monkeypatch.setattr(medfed.tasks.brats, name, forbidden)
    monkeypatch.setattr(nibabel, "load", forbidden)
