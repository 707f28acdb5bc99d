"""The deployment's pieces that need no running federation: run config and resume checks, a site's rewind, the runner's options, medfed records."""

import copy
import re
from pathlib import Path

import pytest

pytest.importorskip("flwr")

import torch  # noqa: E402
from flwr.app import Array, Context, RecordDict  # noqa: E402

from medfed.checkpoint import FOLDER, read_checkpoint, save_checkpoint  # noqa: E402
from medfed.config import FederationConfig, to_yaml  # noqa: E402
from medfed.deploy import runner, server_app  # noqa: E402
from medfed.deploy.records import from_record, to_record  # noqa: E402
from medfed.deploy.worker import SiteWorker  # noqa: E402
from medfed.errors import ConfigError, DataError, MessageError  # noqa: E402
from medfed.tasks import clinical  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
RUN_CONFIG = {
    "config": str(REPO / "configs" / "clinical_delta1.yaml"), "overrides": "federation.n_sites=3 federation.label_ratio=null",
    "run-name": "r1", "output-dir": "/tmp/out", "reply-timeout-s": 60.0, "resume": False,
}


def test_a_good_run_config_is_resolved():
    settings = server_app.run_settings(RUN_CONFIG)
    assert settings.resolved.run.federation.n_sites == 3 and settings.reply_timeout_s == 60.0


@pytest.mark.parametrize("config", ["brats_lack0.yaml", "luna16_delta1.yaml"])
def test_every_task_can_be_deployed(config):
    settings = server_app.run_settings({**RUN_CONFIG, "config": str(REPO / "configs" / config), "overrides": "federation.label_ratio=null"})
    assert settings.resolved.task.name == config.split("_")[0]


@pytest.mark.parametrize(
    "change,message",
    [
        ({"run-name": None}, "run config key 'run-name': expected a str"),
        ({"run-name": "../elsewhere"}, "run config key 'run-name': run name '../elsewhere'"),
        ({"reply-timeout-s": "soon"}, "run config key 'reply-timeout-s': expected a float"),
        ({"reply-timeout-s": 0}, "expected seconds > 0"),
        ({"overrides": "federation.n_sites=3 'unclosed"}, "run config key 'overrides': No closing quotation"),
        ({"overrides": "federation.n_sites=3 trainer.nope=1"}, "unknown config key 'trainer.nope'"),
        ({"overrides": "federation.n_sites=3"}, "config key 'federation.label_ratio'"),
        ({"config": "no-such-config"}, "config file no-such-config not found"),
        ({"config": str(REPO / "configs" / "luna16_delta1.yaml"), "overrides": ""}, "config key 'federation.label_ratio'"),
    ],
)
def test_a_bad_run_config_is_one_line_naming_the_key(change, message):
    with pytest.raises(ConfigError, match=re.escape(message)) as error:
        server_app.run_settings({**RUN_CONFIG, **change})
    assert "\n" not in str(error.value)


def test_the_server_app_prints_one_error_line_and_contacts_no_site(capsys):
    _main({**RUN_CONFIG, "overrides": ""})
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 and lines[0].startswith("medfed: error: config key 'federation.label_ratio'")


def test_the_server_app_holds_its_output_dir_a_second_run_on_it_is_one_line_before_any_site_is_contacted(tmp_path, capsys):
    # (The ServerApp wrote its checkpoints and results.json with no lock: two runs, or fit and a deployment, mixed.)
    import os

    from medfed.output_dir import hold_output_dir

    with hold_output_dir(tmp_path / "out"):
        _main({**RUN_CONFIG, "output-dir": str(tmp_path / "out")})
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        f"medfed: error: run config key 'output-dir' = {str(tmp_path / 'out')!r} is being written by another run (pid {os.getpid()} on host"
    ), lines


def test_the_server_app_writes_nothing_through_a_lock_planted_as_a_symlink(tmp_path, capsys):
    # (the ServerApp opened <output-dir>.lock following links, as fit did: the link's target was truncated)
    victim = tmp_path / "precious.txt"
    victim.write_text("mine")
    (tmp_path / "out.lock").symlink_to(victim)
    _main({**RUN_CONFIG, "output-dir": str(tmp_path / "out")})
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 and lines[0] == (
        f"medfed: error: run config key 'output-dir' = {str(tmp_path / 'out')!r}: its lock file {tmp_path / 'out.lock'} "
        "is a symbolic link, not a lock a run wrote; nothing was written through it: delete it and run again"
    ), lines
    assert victim.read_text() == "mine"


@pytest.mark.parametrize(
    "arguments,message",
    [
        (["--runtime-api-address", "localhost", "--insecure"], "--runtime-api-address: expected host:port"),
        (["--runtime-api-address", "127.0.0.1:99999", "--insecure"], "expected host:port"),
        (["--runtime-api-address", "127.0.0.1:9094", "--root-certificates", "/no/such/ca.pem"], "--root-certificates: no file"),
        (["--runtime-api-address", "127.0.0.1:9094", "--insecure", "--poll-s", "0"], "--poll-s: expected seconds in (0, 60]"),
    ],
)
def test_the_runner_refuses_bad_options_in_one_line_with_status_2(arguments, message, capsys):
    assert runner.main(arguments) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("medfed runner: error: ") and message in lines[0]


def test_records_carry_codec_streams_unchanged_and_refuse_other_arrays():
    wires = [{"all": ((2, 3), b"\x00\x01\xff"), "empty": ((0,), None), "odd:key/1": ((1,), b"x")}, {}, {"all": ((4,), b"yz")}]
    fields, back = from_record(to_record({"seq": 3, "requests": [{"kind": "work"}]}, wires))
    assert fields == {"seq": 3, "requests": [{"kind": "work"}]} and back == wires
    record = to_record({}, [{"all": ((1,), b"ab")}])
    record["wire"]["0:all"] = Array(dtype="uint8", shape=(2,), stype="numpy.ndarray", data=b"ab")
    with pytest.raises(ValueError, match="expected a medfed-codec stream"):
        from_record(record)


def _main(run_config: dict) -> None:
    """The ServerApp's main on ``run_config`` without a grid (a site contacted would be an AttributeError): it must refuse."""
    context = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=run_config)
    with pytest.raises((ConfigError, DataError)):
        server_app.main(grid=None, context=context)


def _checkpointed(tmp_path: Path, rounds: int) -> dict:
    """RUN_CONFIG with its output-dir in ``tmp_path`` holding a checkpoint of round 1 of its config run for ``rounds`` rounds."""
    run_config = {**RUN_CONFIG, "output-dir": str(tmp_path / "out"), "overrides": f"{RUN_CONFIG['overrides']} trainer.rounds={rounds}"}
    config = server_app.run_settings(run_config).resolved.config
    loop_state = {"links": [], "history": [], "server": {}, "failure_streaks": [], "excluded": {}, "num_threads": 1}
    sites = [{"seq": 2, "round": 1} for _ in range(config["federation"]["n_sites"])]  # FlowerSites.state_dict()'s shape
    save_checkpoint(tmp_path / "out" / FOLDER, {"round": 1, "config": config, "sites": sites, **loop_state}, keep=2)
    return run_config


_C = {"compute": {}}  # a reply's compute field, when the case is not about it


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"losses": {"": 0.5}, "non_finite": [], **_C}, r"expected the fields \['compute', 'losses', 'non_finite', 'train_s'\]"),  # a missing field
        ({"losses": {"": 0.5}, "non_finite": [], "train_s": 1.0, "norms": {"all": 0.1}, **_C}, "expected the fields"),  # norms: never asked
        ({"losses": "low", "non_finite": [], "train_s": 1.0, **_C}, "field 'losses' is not an object"),
        ({"losses": {"": "low"}, "non_finite": [], "train_s": 1.0, **_C}, "reply loss '': field 'loss' is not a finite number"),
        ({"losses": {"": float("nan")}, "non_finite": [], "train_s": 1.0, **_C}, "is not a finite number"),
        ({"losses": {}, "non_finite": [7], "train_s": 1.0, **_C}, "not a string"),
        ({"losses": {}, "non_finite": [], "train_s": -1.0, **_C}, "train_s below 0"),
        ({"losses": {}, "non_finite": [], "train_s": True, **_C}, "field 'train_s' is not a finite number"),
        ({"losses": {}, "non_finite": [], "train_s": 1.0, "compute": {"train/fit/": -1.0}}, "not a count of epochs >= 0"),
        ({"losses": {}, "non_finite": [], "train_s": 1.0, "compute": {"train/fit/": float("inf")}}, "is not a finite number"),
        ({"error": 7}, "field 'error' is not a string"),
        ([1, 2], "expected an object, got list"),
    ],
)
def test_a_malformed_work_reply_is_one_message_error_naming_the_site(fields, message):
    with pytest.raises(MessageError, match=message) as error:
        server_app._work_result(fields, "site2")
    assert str(error.value).startswith("message from site2: reply")
    good = server_app._work_result({"losses": {"": 0.5, "personal": 1}, "non_finite": ["all"], "train_s": 2.0, "compute": {"train/fit/": 1.5}}, "site2")
    assert good.losses == {None: 0.5, "personal": 1.0} and good.non_finite == ["all"] and good.error is None
    assert good.compute == {"train/fit/": 1.5}
    assert server_app._work_result({"error": "RuntimeError: disk full"}, "site2").error == "RuntimeError: disk full"


@pytest.mark.parametrize(
    "change, message",
    [
        ({"metrics": {"accuracy": "high"}}, "metric 'accuracy': field 'value' is not a finite number"),
        ({"metrics": {"accuracy": float("nan")}}, "is not a finite number"),
        ({"compute": {"evaluation": -2.0}}, "not a count of epochs >= 0"),
        ({"adapt_losses": {"": None}}, "adapt loss '': field 'loss' is not a finite number"),
        ({"adapt_error": 3}, "field 'adapt_error' is not a string"),
        ({"extra": 1}, "expected the fields"),
    ],
)
def test_a_malformed_delivery_reply_is_one_message_error_naming_the_site(change, message):
    good = {"metrics": {"accuracy": 0.75}, "compute": {"evaluation": 1.0}, "adapt_losses": {"": 0.25}, "adapt_error": None}
    with pytest.raises(MessageError, match=message) as error:
        server_app._evaluation({**good, **change}, "site1")
    assert str(error.value).startswith("message from site1: ")
    evaluation = server_app._evaluation(good, "site1")
    assert evaluation.metrics == {"accuracy": 0.75} and evaluation.compute == {"evaluation": 1.0}
    assert evaluation.adapt_losses == {None: 0.25} and evaluation.adapt_error is None
    assert server_app._evaluation({**good, "adapt_error": "ValueError: x"}, "site1").adapt_error == "ValueError: x"


@pytest.mark.parametrize(
    "change, message",
    [
        ({"site_index": 3}, "site-index 3; this federation has sites 0..2"),
        ({"site_index": True}, "field 'site_index' is not a whole number"),
        ({"input_shape": [30, -1]}, "input_shape must be up to 8 positive whole numbers"),
        ({"num_samples": 0}, "num_classes and num_samples must be at least 1"),
        ({"num_samples": 1.5}, "field 'num_samples' is not a whole number"),
        ({"num_evaluated": -1}, "num_evaluated must be at least 0"),
        ({"generated": 1}, "field 'generated' is not true or false"),
    ],
)
def test_a_malformed_node_description_is_refused(change, message):
    description = {"site_index": 1, "input_shape": [30], "num_classes": 2, "num_samples": 120, "num_evaluated": 30, "generated": False}
    assert server_app._description(dict(description), 3) == description
    with pytest.raises(MessageError, match=re.escape(message)):
        server_app._description({**description, **change}, 3)


@pytest.mark.parametrize(
    "change,message",
    [
        ({"resume": True, "overrides": "federation.n_sites=3 federation.label_ratio=null trainer.batch_size=7"},
         "run config resume=true: the config differs from the checkpoint's"),
        ({"resume": False}, "holds an earlier run's checkpoints; resume=true continues that run"),
        ({"resume": True, "output-dir": "elsewhere"}, "run config resume=true: no checkpoint in "),
    ],
)
def test_a_refused_resume_is_one_line_before_any_site_is_contacted(tmp_path, capsys, change, message):
    run_config = {**_checkpointed(tmp_path, rounds=1), **change}
    if "output-dir" in change:
        run_config["output-dir"] = str(tmp_path / change["output-dir"])
    _main(run_config)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 and lines[0].startswith("medfed: error: ") and message in lines[0], lines
    if "differs" in message:
        assert lines[0].endswith("at trainer.batch_size")


def test_a_resume_may_raise_trainer_rounds(tmp_path):
    run_config = _checkpointed(tmp_path, rounds=1)
    raised = {**run_config, "resume": True, "overrides": run_config["overrides"].replace("trainer.rounds=1", "trainer.rounds=2")}
    state = server_app.resumed_state(server_app.run_settings(raised))
    assert state["round"] == 1 and state["sites"][0] == {"seq": 2, "round": 1}


def test_a_deployment_checkpoint_whose_site_entry_is_damaged_is_one_line(tmp_path):
    run_config = _checkpointed(tmp_path, rounds=1)
    (checkpoint,) = (tmp_path / "out" / FOLDER).glob("*.ckpt")
    state = read_checkpoint(checkpoint)
    state["sites"][1] = {"seq": -1, "round": 1}
    checkpoint.unlink()
    save_checkpoint(tmp_path / "out" / FOLDER, state, keep=2)
    with pytest.raises(DataError, match="deployed site 1's entry is .* expected whole numbers >= 0 at seq, round"):
        server_app.resumed_state(server_app.run_settings({**run_config, "resume": True}))


def _worker(tmp_path: Path) -> tuple[SiteWorker, dict]:
    """Site 1 of the clinical federation (fedavg, dense messages) built from its own records, and its run's config."""
    csv = tmp_path / "all" / "breast_cancer.csv"
    files = clinical.site_records(clinical.Options(csv=str(csv)), FederationConfig(n_sites=3), 0, tmp_path / "sites")
    run_config = {**RUN_CONFIG, "overrides": f"{RUN_CONFIG['overrides']} data.csv={csv} strategy.name=fedavg"}
    config = server_app.run_settings(run_config).resolved.config
    return SiteWorker(to_yaml(config), 1, files[1].parent, tmp_path / "state"), config


def test_a_site_that_failed_in_a_round_is_put_back_to_its_snapshot_of_the_previous_round(tmp_path):
    worker, _ = _worker(tmp_path)
    server = copy.deepcopy(worker.link)  # the server's end starts where the site's does
    global_model = {"all": worker.site.slot(worker.site.evaluated_slot).module.get_vector("all").clone()}

    def delivery(round_index: int, restore: bool) -> tuple[dict, dict]:
        request = {"kind": "deliver", "round": round_index, "restore": restore, "evaluate": round_index > 0}
        return request, server.encode("down", global_model)

    worker.handle(1, [delivery(0, restore=False)])
    start = read_checkpoint(worker.snapshots / "round-0.ckpt")["sites"][0]
    work = {"kind": "work", "round": 1, "phase_index": 0, "phase": "fit", "local_epochs": 1, "norms": False}
    [(fields, _)] = worker.handle(2, [(work, server.encode("down", global_model))])
    assert "error" not in fields and not _same(worker.site.state_dict(), start)  # it trained; say its reply was refused
    worker.handle(3, [delivery(1, restore=True)])  # back to round 1's start, then round 1's delivery (the same model)
    assert _same(worker.site.state_dict(), start)
    assert _same(worker.link.state_dict()["known"], server.state_dict()["known"])


def _same(a, b) -> bool:
    """Whether two nested states (dicts, lists, tensors, numbers) are equal, tensors element for element."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and bool(torch.equal(a.cpu(), b.cpu()))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[key], b[key]) for key in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def test_a_site_goes_back_only_to_an_intact_snapshot_of_its_own_config_and_forgets_the_later_rounds(tmp_path):
    worker, config = _worker(tmp_path)

    def rewind(seq: int, round_index: int) -> dict:
        [(fields, wire)] = worker.handle(seq, [({"kind": "rewind", "round": round_index}, {})])
        assert wire == {}
        return fields

    def snapshot(round_index: int, snapshot_config: dict) -> Path:
        state = {"round": round_index, "config": snapshot_config, "sites": [worker.site.state_dict()], "links": [worker.link.state_dict()]}
        return save_checkpoint(worker.snapshots, state, keep=3)

    assert rewind(5, 1) == {"error": "site1 cannot go back to the end of round 1: its state folder keeps the ends of rounds none"}
    other = {**config, "trainer": {**config["trainer"], "batch_size": 7, "rounds": 9}}  # rounds may change, the batch size not
    snapshot(1, other)
    assert rewind(5, 1)["error"].endswith("its snapshot was written with another config (at trainer.batch_size)")
    damaged = snapshot(1, config)
    damaged.write_bytes(damaged.read_bytes()[:-80] + bytes(80))
    assert "its snapshot of that round is damaged" in rewind(5, 1)["error"]
    snapshot(1, config)
    later = snapshot(2, config)
    assert rewind(5, 1) == {} and not later.exists()
    assert rewind(5, 1) == {}  # a rewind is answered again whatever its number (a resumed server numbers from its checkpoint)
    with pytest.raises(ValueError, match="older than the last one it answered"):
        worker.handle(4, [({"kind": "deliver"}, {})])


@pytest.fixture
def in_a_run(monkeypatch):
    """Flower's Message needs the run it is made in (a ServerApp's, set by Flower)."""
    from flwr.supercore.task_identity import TaskIdentity

    for field in ("_run_id", "_node_id", "_task_id"):
        monkeypatch.setattr(TaskIdentity, field, 1)


class _FakeGrid:
    """A Grid whose nodes 100, 101, ... answer each message with ``answer(site, request fields, wire)``:
    ``(fields, wire)``, ``"error: <reason>"`` (the ClientApp's Flower error), or None (no reply, ever)."""

    def __init__(self, n_sites: int, answer) -> None:
        self.n_sites, self.answer = n_sites, answer
        self.replies: dict[str, object] = {}

    def get_node_ids(self) -> list[int]:
        return [100 + index for index in range(self.n_sites)]

    def push_messages(self, messages) -> list[str]:
        ids = []
        for message in messages:
            index = message.metadata.dst_node_id - 100
            message_id = f"m{len(self.replies)}-{index}"
            fields, wires = from_record(message.content)
            requests = fields["requests"]
            answer = self.answer(index, requests[-1], wires[-1])
            if isinstance(answer, str):
                self.replies[message_id] = _reply(message_id, error=answer.removeprefix("error: "))
            elif answer is not None:  # the answers to the requests that rode along come first, empty
                replies = [{}] * (len(requests) - 1) + [answer[0]]
                record = to_record({"site_index": index, "replies": replies}, [{}] * (len(requests) - 1) + [answer[1]])
                self.replies[message_id] = _reply(message_id, content=record)
            ids.append(message_id)
        return ids

    def pull_messages(self, message_ids):
        return [self.replies.pop(message_id) for message_id in message_ids if message_id in self.replies]


def _reply(message_id: str, content=None, error: str | None = None):
    from types import SimpleNamespace

    return SimpleNamespace(
        metadata=SimpleNamespace(reply_to_message_id=message_id), content=content,
        has_error=lambda: error is not None, error=SimpleNamespace(reason=error),
    )


def _flower_sites(n_sites: int, answer, timeout_s: float = 0.3):
    """FlowerSites over a fake grid, every site identified, FedAvg's dense links on a 3-value model."""
    from medfed.federated.link import Link

    sites = server_app.FlowerSites(_FakeGrid(n_sites, answer), n_sites, "config: x", timeout_s)
    sites.node_of_site = {index: 100 + index for index in range(n_sites)}
    sites._known_nodes = set(sites.node_of_site.values())
    sites.declared_samples = [10] * n_sites
    initial = {"all": torch.zeros(3), "buffers": torch.zeros(1)}
    sites.links = [Link({"name": "dense"}, {"name": "dense"}, {"all": "all"}, initial, torch.device("cpu"), peer=name) for name in sites.names]
    site_links = [Link({"name": "dense"}, {"name": "dense"}, {"all": "all"}, initial, torch.device("cpu"), peer="server") for _ in sites.names]
    return sites, site_links


def test_a_deployed_site_whose_setup_reply_is_an_error_malformed_or_late_is_refused_and_the_others_set_up(in_a_run):
    # (A RuntimeError ended the run before round 1.)
    def answer(index, request, wire):
        if index == 1:
            return "error: ValueError: sketch of 3 samples"
        if index == 2:
            return None  # never answers
        if index == 3:
            return {"unexpected": 1}, {}
        return {}, site_links[index].encode("up", {"num_samples": torch.tensor([7.0])})

    sites, site_links = _flower_sites(4, answer)
    replies, refused = sites.setup()
    assert list(replies) == [0] and torch.equal(replies[0]["num_samples"], torch.tensor([7.0]))
    assert refused == {
        1: "site1: ValueError: sketch of 3 samples",
        2: "no reply within reply-timeout-s = 0.3 s",
        3: "malformed reply: message from site3: setup reply: expected the fields [], got ['unexpected']",
    }


def test_a_deployed_site_that_does_not_answer_a_phase_in_time_fails_that_phase_and_the_others_go_on(in_a_run):
    # (A RuntimeError ended the run.)
    from medfed.federated.site_work import PhaseWork

    good = {"losses": {"": 0.5}, "non_finite": [], "compute": {"train/fit": 1.0}, "train_s": 0.1}

    def answer(index, request, wire):
        if index == 1:
            return None
        return good, site_links[index].encode("up", {"all": torch.ones(3), "buffers": torch.ones(1), "num_samples": torch.tensor([10.0])})

    sites, site_links = _flower_sites(3, answer)
    for index in range(3):  # the server's messages decode at the sites
        site_links[index].decode = lambda direction, wire: {}
    timing = {"train_s": 0.0}
    results = sites.work(PhaseWork(1, 0, "fit", 1), {index: {} for index in range(3)}, timing)
    assert results[1].error == "no reply within reply-timeout-s = 0.3 s"
    assert results[0].error is None and results[2].error is None and results[0].losses == {None: 0.5}
    received, refused = sites.replies([0, 2])
    assert sorted(received) == [0, 2] and refused == {} and torch.equal(received[2]["all"], torch.ones(3))


def test_a_deployed_site_whose_delivery_reply_is_malformed_an_error_or_late_has_no_evaluation_and_the_others_do(in_a_run):
    # (A RuntimeError ended the run; the loop then fails the site in that round, its metrics NaN: test_faults.)
    good = {"metrics": {"accuracy": 0.75}, "compute": {"evaluation": 1.0}, "adapt_losses": {}, "adapt_error": None, "validation": {}}
    answers = {0: (good, {}), 1: ({**good, "metrics": {"accuracy": "high"}}, {}), 2: "error: OSError: disk full", 3: None}
    sites, _ = _flower_sites(4, lambda index, request, wire: answers[index])
    evaluations = sites.deliver(1, {index: {} for index in range(4)}, evaluate=True, timing={})
    assert evaluations["site0"].metrics == {"accuracy": 0.75} and evaluations["site0"].error is None
    assert evaluations["site1"].metrics == {} and evaluations["site1"].error == (
        "message from site1: metric 'accuracy': field 'value' is not a finite number (got str)"
    )
    assert evaluations["site2"].error == "site2: OSError: disk full"
    assert evaluations["site3"].error == "no reply within reply-timeout-s = 0.3 s"
    assert sites.delivered == 1
