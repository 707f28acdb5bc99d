"""The command line answers at once when it trains nothing: no torch, Lightning or MONAI before work needs them.

Each command runs as ``python -m medfed ...`` in a fresh interpreter; the test
asserts its exit status and output, that torch, Lightning and MONAI were never
imported, and a generous wall-time bound (3 s; the figures on a 2-core VM are
in benchmarks/cli_start.py). The torch-free declarations the fast paths read
(the strategy catalog, the codec names) are checked against the registries
they stand for.
"""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from medfed.compression.codecs import CODEC_NAMES as CODECS
from medfed.compression.piecewise import MAX_QUANT_BITS as QUANT_BITS
from medfed.config import CODEC_NAMES, MAX_QUANT_BITS
from medfed.components import check_strategy_names
from medfed.errors import ConfigError
from medfed.federated.strategies import strategy_from_config, strategy_subgroups

REPOSITORY = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "lightning", "monai")
WALL_BOUND_S = 3.0
PROBE = """  # runs ``python -m medfed <arguments>``, then writes which of HEAVY it imported to $MEDFED_PROBE
import os, runpy, sys
sys.argv = ["medfed", *sys.argv[1:]]
try:
    runpy.run_module("medfed", run_name="__main__", alter_sys=True)
    code = 0
except SystemExit as exit:
    code = exit.code
with open(os.environ["MEDFED_PROBE"], "w") as report:
    report.write(",".join(name for name in {heavy!r} if name in sys.modules))
sys.exit(code)
""".format(heavy=HEAVY)


@pytest.mark.parametrize(
    "arguments, status, says",
    [
        (["--help"], 0, "{fit,compare,predict,strategies,deploy}"),
        (["fit", "--help"], 0, "--print-config"),
        (["compare", "--help"], 0, "--strategies"),
        (["strategies"], 0, "pfednet "),
        (["fit", "--config", "brats_lack0", "trainer.roundz=3"], 2, "unknown config key 'trainer.roundz'"),
        (["fit", "--config", "brats_lack0", "strategy.name=pfednett"], 2, "config key 'strategy.name' = 'pfednett'"),
        (["fit", "--config", "brats_lack0", "strategy.fedprx.mu=1"], 2, "unknown config key 'strategy.fedprx'"),
        (["fit", "--config", "brats_lack0", "codec.up=zip"], 2, "'codec.up'"),
        (["fit", "--config", "no_such_config"], 2, "no_such_config"),
    ],
    ids=lambda value: " ".join(value) if isinstance(value, list) else None,
)
def test_a_command_that_trains_nothing_answers_without_torch_lightning_or_monai(tmp_path, arguments, status, says):
    report = tmp_path / "imported.txt"
    environment = {**os.environ, "PYTHONPATH": str(REPOSITORY), "MEDFED_PROBE": str(report)}
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", PROBE, *arguments], cwd=tmp_path, env=environment, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    assert done.returncode == status, done.stderr
    if status == 2:
        assert done.stderr.startswith("medfed: error: ") and done.stderr.count("\n") == 1 and says in done.stderr, done.stderr
    else:
        assert says in done.stdout
    assert report.read_text() == "", f"imported {report.read_text()}"
    assert seconds < WALL_BOUND_S, f"{seconds:.2f} s"


def test_the_config_check_knows_every_codec_and_its_bounds():
    assert CODEC_NAMES == CODECS
    assert MAX_QUANT_BITS == QUANT_BITS


@pytest.mark.parametrize("group", [{"name": "pfednett"}, {"name": "fedavg", "fedprx": {}}, {"name": None}])
def test_the_torch_free_strategy_name_check_refuses_as_the_registry_does(group):
    with pytest.raises(ConfigError) as fast:
        check_strategy_names(group)
    with pytest.raises(ConfigError) as registry:
        strategy_from_config(group) if "fedprx" not in group else strategy_subgroups(group)
    assert str(fast.value) == str(registry.value)
