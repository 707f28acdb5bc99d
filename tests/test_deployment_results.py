"""A deployment's results.json has the simulator's schema and numbers, and ``compare``'s tables read it.

The ServerApp (:func:`medfed.deploy.server_app.main`) runs here on a Grid
that calls each node's ClientApp in this process (no SuperLink, no
SuperNodes: tests/test_deploy.py runs the real ones); each site's worker
reads its own records file, as a deployed hospital does. The simulator runs
the same config on the whole table. Their results.json must have the same
keys, the same per-round numbers (metrics, validation metrics, losses,
bytes) and the same per-site table; ``compare``'s rows and markdown tables
(:mod:`medfed.compare.tables`) built from the deployment's folder must equal
those built from the simulator's, but for the wall time.
"""

import json
import re
from pathlib import Path
from uuid import uuid4

import pytest

pytest.importorskip("flwr")

from flwr.app import Context, Message, RecordDict  # noqa: E402
from flwr.common.constant import SUPERLINK_NODE_ID  # noqa: E402
from flwr.supercore.task_identity import TaskIdentity  # noqa: E402

from medfed.cli import main  # noqa: E402
from medfed.compare.grid import Grid  # noqa: E402
from medfed.compare.plan import Run  # noqa: E402
from medfed.compare.tables import collect, comparison_rows, markdown, reported_metrics  # noqa: E402
from medfed.config import FederationConfig  # noqa: E402
from medfed.deploy import client_app, server_app  # noqa: E402
from medfed.errors import MessageError  # noqa: E402
from medfed.results import format_table  # noqa: E402
from medfed.tasks import clinical  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "clinical_delta1.yaml"


class InProcessGrid:
    """The ServerApp's Grid without a SuperLink: each node's ClientApp answers a message as soon as it is pushed.

    Node ``100 + i`` is site ``i`` (``partition-id``, :func:`medfed.deploy.client_app.simulation_app`).
    """

    def __init__(self, app, n_nodes: int, run_config: dict) -> None:
        self.app = app
        self.contexts = {
            100 + index: Context(run_id=1, node_id=100 + index, node_config={"partition-id": index}, state=RecordDict(), run_config=run_config)
            for index in range(n_nodes)
        }
        self.replies: dict[str, Message] = {}

    def get_node_ids(self) -> list[int]:
        return list(self.contexts)

    def _answer(self, message: Message) -> tuple[str, Message]:
        message.metadata.__dict__["_message_id"] = message_id = str(uuid4())  # what a SuperLink does (flwr's InMemoryGrid)
        return message_id, self.app(message, self.contexts[message.metadata.dst_node_id])

    def send_and_receive(self, messages, timeout=None) -> list[Message]:
        return [self._answer(message)[1] for message in messages]

    def push_messages(self, messages) -> list[str]:
        ids = []
        for message in messages:
            message_id, self.replies[message_id] = self._answer(message)
            ids.append(message_id)
        return ids

    def pull_messages(self, message_ids) -> list[Message]:
        return [self.replies.pop(message_id) for message_id in message_ids if message_id in self.replies]


@pytest.fixture(scope="module")
def two_engines(tmp_path_factory) -> tuple[Path, Path]:
    """The output folders of a 2-round fedavg run with a validation split: deployed (in-process grid), simulated."""
    return _both_engines(tmp_path_factory.mktemp("engines"))


def _both_engines(tmp: Path, *more: str) -> tuple[Path, Path]:
    """A 2-round fedavg run with a validation split and the overrides ``more``, deployed and simulated: their folders."""
    csv = tmp / "all" / "breast_cancer.csv"
    files = clinical.site_records(clinical.Options(csv=str(csv)), FederationConfig(n_sites=3), 0, tmp / "sites")
    overrides = [
        f"data.csv={csv}", "federation.n_sites=3", "federation.label_ratio=null", "federation.validation_fraction=0.2",
        "trainer.rounds=2", "trainer.num_threads=1", "logger.wandb=disabled", "strategy.name=fedavg", *more,
    ]
    deployed, simulated = tmp / "deployed", tmp / "simulated"
    run_config = {
        "config": str(CONFIG), "overrides": " ".join(overrides), "run-name": "r1", "output-dir": str(deployed),
        "reply-timeout-s": 60.0, "resume": False,
    }
    workers = dict(client_app._WORKERS)
    identity = (TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id)
    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 1, SUPERLINK_NODE_ID  # as Flower's ServerApp runtime sets it
    try:
        grid = InProcessGrid(client_app.simulation_app([file.parent for file in files], tmp / "state"), len(files), run_config)
        server_app.main(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=run_config))
    finally:  # Flower's process identity and the module's cache of site workers as they were
        TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id = identity
        client_app._WORKERS.clear()
        client_app._WORKERS.update(workers)
    assert main(["fit", "--config", str(CONFIG), "--quiet", *overrides, f"output_dir={simulated}"]) == 0
    return deployed, simulated


def _results(folder: Path) -> dict:
    return json.loads((folder / "results.json").read_text())


def test_a_robust_rule_runs_on_flower_as_in_the_simulator(two_engines, tmp_path):
    # (issue 32: aggregation.name is the server half's policy in both engines, set where the loop is assembled)
    deployed, simulated = map(_results, _both_engines(tmp_path, "aggregation.name=median"))
    assert deployed["config"]["aggregation"]["name"] == simulated["config"]["aggregation"]["name"] == "median"
    for key in ("metrics", "validation", "train_loss"):
        assert [r[key] for r in deployed["history"]] == [r[key] for r in simulated["history"]], key
    mean = _results(two_engines[1])
    assert [r["metrics"] for r in mean["history"]] != [r["metrics"] for r in simulated["history"]]  # the rule was applied


def test_a_deployment_writes_the_simulators_schema_and_numbers(two_engines):
    deployed, simulated = map(_results, two_engines)
    assert set(deployed) == set(simulated) - {"baselines"}  # the trivial baselines read every site's data: the simulator's
    assert (deployed["engine"], simulated["engine"]) == ("flower-deployment", "simulator")
    assert len(deployed["history"]) == 2
    for key in ("metrics", "validation", "train_loss", "bytes", "participants", "failures", "compute"):
        assert [r[key] for r in deployed["history"]] == [r[key] for r in simulated["history"]], key
    assert set(deployed["history"][-1]["validation"]) == {"site0", "site1", "site2"}
    assert deployed["sites"] == simulated["sites"] and deployed["mean"] == simulated["mean"]
    assert deployed["communication"] == simulated["communication"] and deployed["communication"]["bytes_up"] > 0
    assert deployed["compute"] == simulated["compute"]
    for ours, theirs in zip(deployed["federation"]["sites"], simulated["federation"]["sites"], strict=True):
        assert {key: ours[key] for key in ("name", "n_train", "n_test")} == {key: theirs[key] for key in ("name", "n_train", "n_test")}
    for key in ("task", "generated", "holdout", "input_shape", "num_classes"):
        assert deployed["federation"][key] == simulated["federation"][key], key
    assert deployed["timing"]["wall_s"] > 0 and set(deployed["timing"]) == set(simulated["timing"])
    # the printed table: the same rows under a title naming each engine's data
    assert format_table(deployed).splitlines()[1:] == format_table(simulated).splitlines()[1:]


def test_compare_tabulates_a_deployment_as_it_tabulates_the_simulator(two_engines, tmp_path):
    def tables(folder: Path) -> tuple[list[dict], str, dict]:
        run = Run("clinical_delta1", CONFIG, "fedavg", 0, folder, (), 1, tmp_path / "log", "done")
        finished = collect([run])
        metrics = reported_metrics(finished)
        rows = comparison_rows(finished, metrics)
        grid = Grid(configs=[str(CONFIG)], strategies=["fedavg"], seeds=[0])
        return rows, markdown(grid, "test", ["clinical_delta1"], rows, finished, {}, metrics), finished[0].results

    (deployed_rows, deployed_md, deployed), (simulated_rows, simulated_md, _) = map(tables, two_engines)
    assert [row["site"] for row in deployed_rows] == ["site0", "site1", "site2"]
    assert [row["wall_s"] for row in deployed_rows] == [deployed["timing"]["wall_s"]] * 3
    without_wall = lambda rows: [{key: value for key, value in row.items() if key != "wall_s"} for row in rows]
    assert without_wall(deployed_rows) == without_wall(simulated_rows)
    # the metric tables: everything from the first metric's heading to the wall times
    section = lambda md: re.sub(r" · [0-9.]+ s", "", md[md.index("\n## "):md.index("## Wall time")])  # each run's own wall time
    assert section(deployed_md) == section(simulated_md)
    mean_last = sum(row["last_accuracy"] for row in deployed_rows) / 3
    worst_last = min(row["last_accuracy"] for row in deployed_rows)  # one seed: its worst site
    assert f"| fedavg | **{mean_last:.3f}** | {worst_last:.3f} | reference |" in deployed_md
    assert f"- clinical_delta1: {deployed['federation']['description']}" in deployed_md


@pytest.mark.parametrize(
    "validation, message",
    [
        (None, "expected a 'validation' object of metrics"),
        ([0.5], "expected a 'validation' object of metrics"),
        ({"accuracy": float("nan")}, "validation metric 'accuracy': field 'value' is not a finite number"),
        ({"accuracy": "high"}, "validation metric 'accuracy': field 'value' is not a finite number"),
    ],
)
def test_a_malformed_validation_in_a_delivery_reply_is_one_message_error_naming_the_site(validation, message):
    fields = {"metrics": {"accuracy": 0.5}, "compute": {}, "adapt_losses": {}, "adapt_error": None}
    assert server_app._validation({**fields, "validation": {"accuracy": 1}}, "site1") == (fields, {"accuracy": 1.0})
    assert server_app._validation({**fields, "validation": {}}, "site1") == (fields, {})
    reply = fields if validation is None else {**fields, "validation": validation}
    with pytest.raises(MessageError, match=re.escape(message)) as error:
        server_app._validation(reply, "site1")
    assert str(error.value).startswith("message from site1: ")
