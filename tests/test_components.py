"""Resolving a run config's components: every default filled in, every bad key refused before any data is read."""

import dataclasses

import pytest
import torch

from medfed.components import resolve
from medfed.config import load_config, to_yaml
from medfed.errors import ConfigError
from medfed.federated.strategies.fedamp import FedAMP
from medfed.federated.strategies.pfednet import PFedNet
from medfed.models.segmentation import UNetSegmenter


def test_the_resolved_config_holds_every_component_default(tiny_run_config):
    resolved = resolve(load_config(tiny_run_config, ["strategy.fedamp.sigma=2.0"]))
    config = resolved.config
    assert config["model"] == {"name": "unet", **dataclasses.asdict(resolved.model_options)}
    assert config["model"]["lr"] == UNetSegmenter.Options().lr and config["model"]["channels"] == [4, 8, 16]
    expected_pfednet = dataclasses.asdict(PFedNet.Options(lam=0.3, min_sketch_samples=4))
    assert config["strategy"] == {"name": "pfednet", "pfednet": expected_pfednet, "fedamp": dataclasses.asdict(FedAMP.Options(sigma=2.0))}
    assert config["data"]["task"] == "brats" and config["data"]["background_patches_per_case"] == 2
    assert config["data"]["generate"] == {"cases_per_site": 3, "seed": 0, "resolution_mm": 4.0}


def test_the_printed_config_loads_back_to_itself(tiny_run_config, tmp_path):
    config = resolve(load_config(tiny_run_config)).config
    printed = tmp_path / "printed.yaml"
    printed.write_text(to_yaml(config))
    assert resolve(load_config(printed)).config == config


def test_the_task_refuses_a_model_its_samples_do_not_fit(tiny_run_config):
    with pytest.raises(ConfigError, match=r"config key 'model.name' = 'logreg': the brats task's samples fit unet only"):
        resolve(load_config(tiny_run_config, ["model.name=logreg", "model.channels=null"]))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
@pytest.mark.parametrize("device", ["cuda", "gpu"])
def test_a_device_the_machine_lacks_is_a_config_error(tiny_run_config, device):
    with pytest.raises(ConfigError, match=rf"config key 'trainer.device' = '{device}': this machine has no CUDA GPU"):
        resolve(load_config(tiny_run_config, [f"trainer.device={device}"]))
