"""The command line answers at once when it trains nothing: no torch, Lightning or MONAI before work needs them.

Each command runs as ``python -m medfed ...`` in a fresh interpreter; the test
asserts its exit status and output, that torch, Lightning and MONAI were never
imported, and a generous wall-time bound (3 s; the figures on a 2-core VM are
in benchmarks/cli_start.py). The torch-free declarations the fast paths read
(the strategy catalog, the codec names, the components' options in
:mod:`medfed.options`) are checked against the registries they stand for.
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
from medfed.components import resolve
from medfed.config import load_config
from medfed.federated.strategies import registered
from medfed.models import MODELS
from medfed.options.models import MODEL_OPTIONS
from medfed.options.strategies import STRATEGY_OPTIONS
from medfed.options.tasks import TASK_SPECS
from medfed.tasks import TASKS

STRATEGIES = registered()

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
        (["fit", "--config", "brats_lack0", "--print-config"], 0, "\n  pfednet:\n    lam: 0.1\n    lam_scale: fusion\n"),
        (["fit", "--config", "brats_lack0", "strategy.pfednet.lamm=1"], 2, "unknown config key 'strategy.pfednet.lamm'"),
        (["fit", "--config", "brats_lack0", "strategy.fedprox.mu=-1"], 2, "config key 'strategy.fedprox.mu' = -1"),
        (["fit", "--config", "brats_lack0", "model.num_res_unitz=1"], 2, "unknown config key 'model.num_res_unitz'"),
        (["fit", "--config", "brats_lack0", "data.patch_size=40"], 2, "config key 'data.patch_size' = 40"),
        (["fit", "--config", "brats_lack0", "data.train_samplng=fixed"], 2, "unknown config key 'data.train_samplng'"),
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


def test_the_torch_free_options_are_the_components_own():
    assert list(STRATEGY_OPTIONS) == list(STRATEGIES) and all(STRATEGY_OPTIONS[name] is cls.Options for name, cls in STRATEGIES.items())
    assert MODEL_OPTIONS.keys() == MODELS.keys() and all(MODEL_OPTIONS[name] is cls.Options for name, cls in MODELS.items())
    assert TASK_SPECS.keys() == TASKS.keys()
    for name, task in TASKS.items():
        spec = TASK_SPECS[name]
        assert (spec.name, spec.Options, spec.default_model, spec.models, spec.regions) == (
            task.name, task.Options, task.default_model, task.models, task.regions
        )


def test_a_resolved_run_hands_out_the_registered_components(tiny_run_config):
    resolved = resolve(load_config(tiny_run_config, ["strategy.name=pgfedmo", "strategy.pgfedmo.beta=0.25"]))
    assert resolved.strategy_cls is STRATEGIES["pgfedmo"] and resolved.strategy_options == STRATEGIES["pgfedmo"].Options(beta=0.25)
    assert resolved.model_cls is MODELS[resolved.model_name] and isinstance(resolved.model_options, resolved.model_cls.Options)
    assert resolved.task is TASKS[resolved.task_name] and isinstance(resolved.data_options, resolved.task.Options)


def test_an_earlier_run_in_the_output_folder_is_refused_before_torch_is_imported(tmp_path):
    earlier = tmp_path / "run"
    earlier.mkdir()
    (earlier / "results.json").write_text("{}")
    report = tmp_path / "imported.txt"
    environment = {**os.environ, "PYTHONPATH": str(REPOSITORY), "MEDFED_PROBE": str(report)}
    arguments = ["fit", "--config", "brats_lack0", f"output_dir={earlier}"]
    done = subprocess.run([sys.executable, "-c", PROBE, *arguments], cwd=tmp_path, env=environment, capture_output=True, text=True)
    assert done.returncode == 2 and done.stderr.startswith("medfed: error: ") and str(earlier) in done.stderr, done.stderr
    assert report.read_text() == "", f"imported {report.read_text()}"


FIRST_LINE = """  # runs ``python -m medfed <arguments>``; writes which of HEAVY were imported when stderr got its first line
import os, runpy, sys
class Spy:
    def __init__(self, stream):
        self.stream, self.first = stream, None
    def write(self, text):
        if self.first is None and text.strip():
            self.first = [name for name in {heavy!r} if name in sys.modules]
            with open(os.environ["MEDFED_PROBE"], "w") as report:
                report.write(repr((text.strip().splitlines()[0], self.first)))
        return self.stream.write(text)
    def __getattr__(self, name):
        return getattr(self.stream, name)
sys.stderr = Spy(sys.stderr)
sys.argv = ["medfed", *sys.argv[1:]]
try:
    runpy.run_module("medfed", run_name="__main__", alter_sys=True)
except SystemExit as exit:
    sys.exit(exit.code)
""".format(heavy=HEAVY)


def test_a_runs_first_line_comes_before_torch_lightning_and_monai_load(tiny_run_config, tmp_path):
    report = tmp_path / "first.txt"
    environment = {**os.environ, "PYTHONPATH": str(REPOSITORY), "MEDFED_PROBE": str(report)}
    arguments = ["fit", "--config", str(tiny_run_config), "trainer.rounds=1", "logger.wandb=disabled", f"output_dir={tmp_path / 'out'}"]
    done = subprocess.run([sys.executable, "-c", FIRST_LINE, *arguments], cwd=tmp_path, env=environment, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    line, imported = eval(report.read_text())  # noqa: S307 - the probe's own repr
    assert line == "medfed: fit tiny: pfednet on brats, 1 rounds, seed 0 (config checked)" and imported == []
    assert "loading torch" in done.stderr and "loading MONAI" in done.stderr  # then the wait for them, under a labelled bar
