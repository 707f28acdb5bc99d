"""A real Flower deployment on localhost (a SuperLink and three SuperNodes as subprocesses) gives the simulator's numbers.

Each SuperNode gets its site index and its own data folder (that site's
records only) through --node-config; the per-site metrics and the bytes of
every round must equal the simulator's run of the same config and seed,
bit for bit on the CPU. Marked ``deploy``: several minutes on a loaded
two-core machine (Flower starts a ClientApp process per message).
"""

import json
from pathlib import Path

import pytest

pytest.importorskip("flwr")

from medfed.cli import main  # noqa: E402
from medfed.config import FederationConfig  # noqa: E402
from medfed.deploy.local import LocalFederation  # noqa: E402
from medfed.tasks import clinical  # noqa: E402

pytestmark = pytest.mark.deploy
REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "clinical_delta1.yaml"


def _overrides(csv: Path, strategy: str, extra: tuple[str, ...] = ()) -> list[str]:
    return [
        f"data.csv={csv}", "federation.n_sites=3", "federation.label_ratio=null", "trainer.rounds=2",
        "trainer.num_threads=1", "logger.wandb=disabled", f"strategy.name={strategy}", *extra,
    ]


def _simulate(tmp: Path, overrides: list[str]) -> dict:
    assert main(["fit", "--config", str(CONFIG), "--quiet", *overrides, f"output_dir={tmp / 'sim'}"]) == 0
    return json.loads((tmp / "sim" / "results.json").read_text())


def _deploy(tmp: Path, overrides: list[str], files: list[Path]) -> dict:
    env = {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    with LocalFederation(tmp / "flwr", env=env) as federation:
        federation.start_superlink()
        for index, file in enumerate(files):
            federation.start_supernode(index, file.parent, state_dir=str(tmp / f"state{index}"))
        run_config = {"config": str(CONFIG), "overrides": " ".join(overrides), "output-dir": str(tmp / "deployed"), "run-name": "test"}
        result = federation.run(REPO, run_config, timeout_s=1500)
        assert result.returncode == 0, result.stdout[-3000:]
    return json.loads((tmp / "deployed" / "results.json").read_text())


def _site_files(tmp: Path) -> tuple[Path, list[Path]]:
    csv = tmp / "all" / "breast_cancer.csv"
    files = clinical.site_records(clinical.Options(csv=str(csv)), FederationConfig(n_sites=3), 0, tmp / "sites")
    return csv, files


@pytest.mark.parametrize(
    "strategy,extra",
    [("fedavg", ()), ("pfednet", ()), ("fedavg", ("codec.up=cer+stc", "codec.down=cer+stc"))],
    ids=["fedavg", "pfednet", "fedavg-cer-stc"],
)
def test_a_localhost_deployment_gives_the_simulators_metrics_and_bytes(tmp_path, strategy, extra):
    csv, files = _site_files(tmp_path)
    overrides = _overrides(csv, strategy, extra)
    simulated = _simulate(tmp_path, overrides)
    deployed = _deploy(tmp_path, overrides, files)
    assert [r["metrics"] for r in deployed["history"]] == [r["metrics"] for r in simulated["history"]]
    assert [r["bytes"] for r in deployed["history"]] == [r["bytes"] for r in simulated["history"]]
    assert [r["train_loss"] for r in deployed["history"]] == [r["train_loss"] for r in simulated["history"]]
    assert sum(r["bytes"]["site0"]["up"] for r in deployed["history"]) > 0
