"""Every registered strategy, with dense and with CER+STC messages, for 2 rounds on a CUDA GPU, and resumed there.

Marked ``gpu`` and skipped where torch sees no CUDA device (CI, laptops). Each
case is the real CLI job (``medfed fit``) on the tiny generated BraTS
federation of ``conftest.py``, with ``trainer.device=cuda``: the sites' models,
the server's state, the links' codecs, the checkpoints and the whole-volume
evaluation all on the GPU. A tensor created on the wrong device anywhere on
that path is a crash, which these catch.

``MEDFED_SMOKE_DEVICE=cpu pytest -m gpu tests/test_gpu.py`` rehearses the same
cases on the CPU.
"""

import json
import math
import os

import pytest
import torch

from medfed.cli import main
from medfed.federated.strategies import registered

STRATEGIES = registered()

DEVICE = os.environ.get("MEDFED_SMOKE_DEVICE", "cuda")
CODECS = {"dense": ["codec.up=dense", "codec.down=dense"], "cer+stc": ["codec.up=cer+stc", "codec.down=stc", "codec.gamma=0.001"]}

#: strategy options beyond the defaults that take another path on the device (the shipped brats configs use FedAMP's heuristic attention)
VARIANTS = {name: [] for name in STRATEGIES} | {"fedamp-heuristic": ["strategy.name=fedamp", "strategy.fedamp.variant=heuristic"]}

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize("codec", sorted(CODECS))
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_two_rounds_on_the_device(tiny_run_config, tmp_path, variant, codec):
    name = variant.split("-")[0]
    overrides = [f"strategy.name={name}", *VARIANTS[variant], f"trainer.device={DEVICE}", "trainer.rounds=2", *CODECS[codec]]
    assert main(["fit", "--config", str(tiny_run_config), "--quiet", *overrides]) == 0
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert f"device={DEVICE}" in results["timing"]["machine"]
    assert len(results["history"]) == 2
    for row in results["sites"]:
        assert 0.0 <= row["label_iou"] <= 1.0 and 0.0 <= row["iou"] <= 1.0 and 0.0 <= row["dice_wt"] <= 1.0
    for record in results["history"]:
        assert all(math.isfinite(loss) for phases in record["train_loss"].values() for loss in phases.values())
    communication = results["communication"]
    if name == "local":
        assert communication["bytes_up"] == 0
    else:
        assert communication["bytes_up"] > 0
        if codec == "cer+stc":  # real encoded bytes, far fewer than the dense vectors
            assert communication["compression_ratio_up"] > 10


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_a_run_resumed_on_the_device_goes_on_from_its_checkpoint(tiny_run_config, tmp_path, variant):
    """Round 1, then --resume to round 2: the halves' states come back from a CPU-mapped checkpoint onto the device."""
    name = variant.split("-")[0]
    overrides = [f"strategy.name={name}", *VARIANTS[variant], f"trainer.device={DEVICE}"]
    assert main(["fit", "--config", str(tiny_run_config), "--quiet", *overrides, "trainer.rounds=1"]) == 0
    assert main(["fit", "--config", str(tiny_run_config), "--quiet", *overrides, "trainer.rounds=2", "--resume"]) == 0
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert [record["round"] for record in results["history"]] == [1, 2]
    for row in results["sites"]:
        assert 0.0 <= row["label_iou"] <= 1.0
