"""FedAMP, APPLE, PGFed and PGFedMo through the CLI on the tiny generated BraTS set (MONAI U-Net)."""

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from medfed.cli import main
from medfed.compression.codecs import make_codec
from medfed.config import load_config, to_plain_dict
from medfed.federated.strategies import strategy_from_config
from medfed.models.segmentation import UNetSegmenter

BRATS_LACK0 = Path(__file__).resolve().parents[1] / "configs" / "brats_lack0.yaml"

# model vectors each participant sends up / receives down per round from round 2 on (APPLE: M = 1)
MODELS_PER_ROUND = {"fedamp": (1, 1), "apple": (1, 1), "pgfed": (2, 3), "pgfedmo": (2, 3)}


@pytest.mark.parametrize(
    "strategy, overrides",
    [
        ("fedamp", ["strategy.fedamp.variant=heuristic"]),
        ("apple", ["strategy.apple.download_budget=1", "strategy.apple.dr_lr=0.01"]),
        ("pgfed", []),
        ("pgfedmo", ["strategy.pgfedmo.beta=0.8"]),
    ],
)
def test_peer_runs_on_a_unet_with_partial_participation(tiny_run_config, tmp_path, strategy, overrides):
    args = ["fit", "--config", str(tiny_run_config), "--quiet", f"strategy.name={strategy}", "federation.participation=0.6"]
    assert main([*args, *overrides]) == 0
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert results["strategy"] == strategy
    for row in results["sites"]:
        assert 0.0 <= row["iou"] <= 1.0 and 0.0 <= row["label_iou"] <= 1.0

    unet = UNetSegmenter(4, 2, UNetSegmenter.Options(channels=[4, 8, 16], strides=[2, 2], num_res_units=1))
    model_bytes = len(make_codec("dense").encode(torch.zeros(unet.parameter_split.size("all"))))
    up, down = MODELS_PER_ROUND[strategy]
    for record in results["history"][1:]:
        assert len(record["participants"]) == 2
        for site, sent in record["bytes"].items():
            taking_part = site in record["participants"]
            assert sent["up"] // model_bytes == (up if taking_part else 0), (site, sent)
            assert sent["down"] // model_bytes == (down if taking_part else 0), (site, sent)



@pytest.mark.parametrize("name", ["fedamp", "apple", "pgfed", "pgfedmo"])
def test_brats_lack0_lists_every_option_of_the_peers(name):
    group = to_plain_dict(load_config(BRATS_LACK0, [f"strategy.name={name}"]))["strategy"]
    cls, options = strategy_from_config(group)  # validates every strategy's subgroup
    assert cls.name == name
    assert {key: getattr(options, key) for key in group[name]} == group[name]
    assert set(group[name]) == {field.name for field in dataclasses.fields(options)}
