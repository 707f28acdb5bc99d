"""Secure aggregation: the server half gets only a sum, which gives FedAvg's aggregate; incompatible runs are refused.

* Declarations: a strategy declares ``secure_sums`` exactly where it
  declares no ``secure_aggregation_refusal``.
* In process, for every strategy declaring ``secure_sums``: a loop whose
  server holds each summed phase's replies only as their weighted mean
  (``ServerHalf.aggregate_summed``) ends round 1 with the ordinary loop's
  server state and round 2 with its metrics, and its server half is never
  handed a site's own non-empty reply.
* The server's check refuses every strategy with a refusal and every
  compressing up codec (any down codec passes), and a round of one site;
  ``python -m medfed deploy submit`` refuses pFedNet and ``codec.up=cer+stc``
  in one line with exit status 2, before any SuperLink is contacted.
* A site's half: with ``require-secure-aggregation`` it joins no plain run
  and answers no plain work request; it hands SecAgg+ its plain vectors and
  weight, never coded by its link, and refuses a vector SecAgg+ would clip.
* On a real Flower federation on localhost (SuperLink, three SuperNodes and
  their runners; ``deploy`` marker), FedAvg without and with
  ``deploy.secure_aggregation=true`` (Flower's SecAgg+): the probe
  ``tests/secagg_probe/sitecustomize.py`` records, in the ServerApp process,
  every call of the server half's ``aggregate`` and ``aggregate_summed``.
  Secure: only the summed reply reaches the server half (the one key
  ``SUMMED``, never a site index), and its round-1 vectors equal the plain
  run's sample-weighted mean of the sites' replies within 1e-4 (SecAgg+'s
  quantisation); the metrics agree within 2e-3. With ``MEDFED_DEPLOY_FULL=1``
  also: a clipping range only one site's reply exceeds makes that site drop
  out, and the sum is the other two's weighted mean; a secure run resumed
  after round 1 gives the uninterrupted secure run's sums and metrics
  exactly; with a clipping range no reply fits, every site drops out at the collect stage with its reason,
  SecAgg+ halts, the server half receives nothing and the run goes on.
* A hostile site under SecAgg+ (``tests/hostile_runner.py --secure`` in place
  of site 2's runner: a plain weight of 10^9, a vector with 7 extra entries
  declared so, the same with its honest shape declared) is refused at the
  collect stage and left out as a dropout, named in the round's failure; the
  honest sites' round completes and the server half's sum equals their
  weighted mean of what they handed SecAgg+ (the probe, in their processes).
"""

import copy
import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from medfed.federated.sites import InProcessSites, SummedReplies
from medfed.federated.strategies import registered
from medfed.federated.protocol import SUMMED
from toy_federation import one_torch_thread  # noqa: F401 (autouse fixture)
from toy_federation import BatchNormClassifier, build_loop, seeded, two_group_federation, with_a_body

STRATEGIES = registered()

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "clinical_delta1.yaml"
SUMMABLE = sorted(name for name, cls in STRATEGIES.items() if cls.secure_sums)


# ---------------------------------------------------------------------------- declarations and the loop
def test_the_strategies_secure_aggregation_fits_declare_what_is_summed_and_the_others_declare_why_not():
    assert {"fedavg", "fedprox", "fedper", "ditto", "pfedme", "superfed"} <= set(SUMMABLE)
    for name, cls in STRATEGIES.items():
        assert (cls.secure_aggregation_refusal is None) == bool(cls.secure_sums), name
        assert set(cls.secure_sums) <= set(cls.phases), name
    for name in ("pfednet", "fedamp", "ifca", "fpfc", "apple", "pgfed", "local", "pooled"):
        assert not STRATEGIES[name].secure_sums


class SummingSites(InProcessSites):
    """The simulator's sites, the server holding each summed phase's replies only as their weighted mean (as SecAgg+ hands it)."""

    def __init__(self, sites, links, secure_sums):
        super().__init__(sites, links)
        self.secure_sums = secure_sums
        self.phase = None
        self._summed = None

    def work(self, work, messages, timing):
        self.phase = work.phase
        return super().work(work, messages, timing)

    def replies(self, candidates):
        received, refused = super().replies(candidates)
        summed = self.secure_sums.get(self.phase)
        if summed is None or not received:
            return received, refused
        weights = {index: 1.0 if summed.weight is None else float(reply.pop(summed.weight)) for index, reply in received.items()}
        total = sum(weights.values())
        keys = next(iter(received.values())).keys()
        mean = {key: sum(weights[index] * reply[key].double() for index, reply in received.items()) / total for key in keys}
        reply = {key: value.float() for key, value in mean.items()}
        if summed.weight is not None:
            reply[summed.weight] = torch.tensor([total])
        self._summed = SummedReplies(reply, sorted(received))
        return {}, refused

    def summed_replies(self):
        summed, self._summed = self._summed, None
        return summed


@pytest.mark.parametrize("name", SUMMABLE)
def test_a_server_holding_only_the_weighted_sum_ends_where_the_ordinary_loop_ends(name):
    federation = two_group_federation(n_sites=3, n_train=24, n_features=3)
    model = with_a_body(name, BatchNormClassifier)

    def loop():
        return build_loop(name, federation, seeded(model, 3, 2), batch_size=8, update_norm_limit=None)

    ordinary, summing = loop(), loop()
    summing.sites = SummingSites(list(summing.sites), summing.links, STRATEGIES[name].secure_sums)
    received = []
    aggregate = summing.server.aggregate
    summing.server.aggregate = lambda ctx, replies: (received.append({i: sorted(r) for i, r in replies.items()}), aggregate(ctx, replies))[1]
    ordinary.fit(1)
    summing.fit(1)
    for key, value in ordinary.server.state_dict().items():  # the server step of the sum is the server step of the replies
        if isinstance(value, torch.Tensor):
            torch.testing.assert_close(summing.server.state_dict()[key], value, atol=1e-6, rtol=1e-5)
    ordinary.fit(2)
    summing.fit(2)
    summed = [call for call in received if list(call) == [SUMMED]]
    assert len(summed) == 2 and all(not keys for call in received if call not in summed for keys in call.values()), received
    # never a site's own non-empty reply (L2GD's mix phase replies with nothing, which needs no sum)
    for expected, got in zip(ordinary.history, summing.history):
        for site, metrics in expected["metrics"].items():
            assert got["metrics"][site] == pytest.approx(metrics, abs=1e-4), (name, site)


# ---------------------------------------------------------------------------- refusals before any site is contacted
def _run_config(tmp_path: Path, overrides: str) -> dict:
    return {"config": str(CONFIG), "overrides": f"federation.label_ratio=null deploy.secure_aggregation=true {overrides}",
            "output-dir": str(tmp_path / "out"), "run-name": "refused", "reply-timeout-s": 10.0, "resume": False}


def test_the_servers_check_refuses_every_strategy_declaring_a_refusal_and_every_compressing_up_codec(tmp_path):
    pytest.importorskip("flwr")
    from medfed.config import CODEC_NAMES
    from medfed.deploy.server_app import run_settings
    from medfed.errors import ConfigError

    for name, cls in STRATEGIES.items():
        if name == "pooled":
            continue  # refused in a deployment whatever the secure aggregation
        if cls.secure_aggregation_refusal is None:
            assert run_settings(_run_config(tmp_path, f"strategy.name={name}")).resolved.run.deploy.secure_aggregation
        else:
            with pytest.raises(ConfigError, match=f"^config key 'deploy.secure_aggregation': strategy '{name}' cannot"):
                run_settings(_run_config(tmp_path, f"strategy.name={name}"))
    for codec in CODEC_NAMES:
        for direction in ("up", "down"):
            overrides = f"strategy.name=fedavg codec.{direction}={codec}"
            if direction == "up" and codec != "dense":
                with pytest.raises(ConfigError, match="^" + re.escape(f"config key 'codec.up' = '{codec}': secure aggregation masks dense vectors")):
                    run_settings(_run_config(tmp_path, overrides))
            else:
                run_settings(_run_config(tmp_path, overrides))
    with pytest.raises(ConfigError, match="^config key 'deploy.secure_aggregation': 1 site"):
        run_settings(_run_config(tmp_path, "strategy.name=fedavg federation.n_sites=3 federation.participation=0.3"))


@pytest.mark.parametrize("override, named", [
    ("strategy.name=pfednet", "config key 'deploy.secure_aggregation': strategy 'pfednet' cannot be securely aggregated: its server step needs each site's own vector"),
    ("strategy.name=fedavg codec.up=cer+stc", "config key 'codec.up' = 'cer+stc': secure aggregation masks dense vectors"),
])
def test_deploy_submit_refuses_a_secure_run_it_cannot_have_in_one_line_with_status_2_before_contacting_anything(tmp_path, override, named):
    pytest.importorskip("flwr")
    overrides = f"federation.label_ratio=null deploy.secure_aggregation=true {override}"
    run_config = (f'config="{CONFIG}" overrides="{overrides}" output-dir="{tmp_path / "out"}" run-name="refused"')
    home = tmp_path / "flwr-home"  # no SuperLink connection at all: contacting one would fail differently
    command = [sys.executable, "-m", "medfed", "deploy", "submit", str(REPO), "nowhere", "--run-config", run_config]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO), "FLWR_HOME": str(home)})
    assert done.returncode == 2, done.stdout + done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"medfed: error: {named}"), done.stderr
    assert done.stdout == "" and not (tmp_path / "out").exists() and not home.exists()


# ---------------------------------------------------------------------------- a site's half
def _site(tmp_path: Path, secure: bool, require_secure: bool):
    """Site 1 of the clinical federation (FedAvg) built from its own records, the server's end of its link, the model."""
    pytest.importorskip("flwr")
    from medfed.config import FederationConfig, to_yaml
    from medfed.deploy.server_app import run_settings
    from medfed.deploy.worker import SiteWorker
    from medfed.tasks import clinical

    csv = tmp_path / "all" / "breast_cancer.csv"
    files = clinical.site_records(clinical.Options(csv=str(csv)), FederationConfig(n_sites=3), 0, tmp_path / "sites")
    run_config = _run_config(tmp_path, f"federation.n_sites=3 data.csv={csv} strategy.name=fedavg deploy.secure_aggregation={secure}")
    config = run_settings(run_config).resolved.config
    worker = SiteWorker(to_yaml(config), 1, files[1].parent, tmp_path / "state", require_secure=require_secure)
    server = copy.deepcopy(worker.link)
    return worker, server, {"all": worker.site.slot(worker.site.evaluated_slot).module.get_vector("all").clone()}


def test_a_site_requiring_secure_aggregation_joins_no_plain_run_and_sends_nothing_in_the_clear(tmp_path):
    with pytest.raises(ValueError, match="^site1 takes part only in runs with secure aggregation .*require-secure-aggregation=true"):
        _site(tmp_path / "plain", secure=False, require_secure=True)
    worker, server, model = _site(tmp_path / "secure", secure=True, require_secure=True)
    work = {"kind": "work", "round": 1, "phase_index": 0, "phase": "fit", "local_epochs": 1}
    [(fields, wire)] = worker.handle(1, [(work, server.encode("down", model))])  # asked in the clear: refused
    assert fields == {"error": "site1 sends its replies only under secure aggregation (its node config "
                               "require-secure-aggregation=true), and this one was asked in the clear"} and wire == {}


def test_a_site_hands_secagg_its_plain_vectors_and_weight_and_refuses_a_vector_it_would_clip(tmp_path):
    worker, server, model = _site(tmp_path, secure=True, require_secure=False)
    n = worker.description["num_samples"]
    work = {"kind": "work", "round": 1, "phase_index": 0, "phase": "fit", "local_epochs": 1, "secure": True, "max_weight": n,
            "clipping_range": 8.0}
    before = copy.deepcopy(worker.link.state_dict())
    [(fields, vectors)] = worker.handle(1, [(work, server.encode("down", model))])
    assert fields["weight"] == n and set(fields) == {"losses", "non_finite", "compute", "train_s", "weight"}
    trained = worker.site.slot(worker.site.evaluated_slot).module
    assert set(vectors) == {"all", "buffers"} and torch.equal(vectors["all"], trained.get_vector("all").float().cpu())
    assert worker.link.state_dict()["bytes_sent"]["up"] == before["bytes_sent"]["up"] == 0  # never coded by the link
    tight = {**work, "round": 2, "clipping_range": 1e-9}
    [(fields, vectors)] = worker.handle(2, [(tight, server.encode("down", model))])
    largest = float(trained.get_vector("all").abs().max())
    assert fields == {"error": f"site1: its weighted reply reaches {largest:.4g}, outside SecAgg+'s clipping range +-1e-09 "
                               "(deploy.clipping_range); it sends no clipped vector"} and vectors == {}


# ---------------------------------------------------------------------------- a real federation on localhost
@pytest.fixture(scope="module")
def federation(tmp_path_factory):
    pytest.importorskip("flwr")
    from medfed.config import FederationConfig
    from medfed.deploy.local import LocalFederation
    from medfed.tasks import clinical

    tmp = tmp_path_factory.mktemp("secagg")
    probe = tmp / "probe"
    probe.mkdir()
    csv = tmp / "all" / "breast_cancer.csv"
    files = clinical.site_records(clinical.Options(csv=str(csv)), FederationConfig(n_sites=3), 0, tmp / "sites")
    env = {"OMP_NUM_THREADS": "1", "PYTHONPATH": f"{REPO / 'tests' / 'secagg_probe'}{os.pathsep}{REPO}", "MEDFED_SECAGG_PROBE": str(probe)}
    with LocalFederation(tmp / "flwr", env=env) as local:  # stops every process it started, whatever happens
        local.start_superlink()
        for index, file in enumerate(files):
            local.start_supernode(index, file.parent, state_dir=str(tmp / f"state{index}"))
        yield local, csv, tmp, probe


def _deploy(federation, name: str, *extra: str, resume: bool = False) -> tuple[dict, list[dict], float]:
    """One run on the federation (``resume``: continue run ``name``): its results, the probe's record of the server
    half's calls, its wall time."""
    local, csv, tmp, probe = federation
    for old in probe.iterdir():
        old.unlink()
    overrides = [f"data.csv={csv}", "federation.n_sites=3", "federation.label_ratio=null", "trainer.rounds=2",
                 "trainer.num_threads=1", "logger.wandb=disabled", "strategy.name=fedavg", *extra]
    run_config = {"config": str(CONFIG), "overrides": " ".join(overrides), "output-dir": str(tmp / name), "run-name": name,
                  "reply-timeout-s": 120.0, "resume": resume}
    tic = time.perf_counter()
    log = local.run(REPO, run_config, 400)
    wall = time.perf_counter() - tic
    path = tmp / name / "results.json"
    assert path.is_file(), f"the run wrote no results.json; its log ends:\n{log[-3000:]}"
    calls = [torch.load(file, weights_only=True) for file in sorted(probe.iterdir()) if not file.name.startswith("site-")]
    return json.loads(path.read_text()), calls, wall


def _handed_to_secagg(federation) -> dict[tuple[int, int], dict]:
    """What each site handed SecAgg+ to mask in the last run, by (round, site): its vectors and weight (the probe's site records)."""
    records = [torch.load(file, weights_only=True) for file in sorted(federation[3].iterdir()) if file.name.startswith("site-")]
    return {(record["round"], record["site"]): record for record in records}


def _weighted_mean(replies: dict) -> dict:
    total = sum(float(reply["num_samples"]) for reply in replies.values())
    return {key: sum(float(reply["num_samples"]) * reply[key].double() for reply in replies.values()) / total
            for key in ("all", "buffers") if key in next(iter(replies.values()))}


@pytest.fixture(scope="module")
def plain_run(federation):
    """FedAvg on the federation without secure aggregation: results, the server half's calls, wall time."""
    return _deploy(federation, "plain")


@pytest.fixture(scope="module")
def secure_run(federation):
    """The same run with ``deploy.secure_aggregation=true``."""
    return _deploy(federation, "secure", "deploy.secure_aggregation=true")


@pytest.mark.deploy
def test_fedavg_with_secagg_plus_gives_the_server_half_only_the_sum_and_the_plain_runs_aggregate(plain_run, secure_run):
    plain, plain_calls, plain_s = plain_run
    secure, secure_calls, secure_s = secure_run
    print(f"\nround times, this machine: plain {[r['timing']['round_s'] for r in plain['history']]} s (run {plain_s:.1f} s), "
          f"SecAgg+ {[r['timing']['round_s'] for r in secure['history']]} s (run {secure_s:.1f} s); round-1 bytes of site0: "
          f"plain {plain['history'][0]['bytes']['site0']}, SecAgg+ {secure['history'][0]['bytes']['site0']}")

    # the plain run's server half gets every site's own reply; the secure one's never does
    assert [call["keys"] for call in plain_calls] == [[0, 1, 2], [0, 1, 2]]
    assert [call["method"] for call in secure_calls] == ["aggregate_summed", "aggregate"] * 2
    assert all(call["keys"] == [SUMMED] for call in secure_calls if call["method"] == "aggregate")
    summed = secure_calls[0]["summed"]
    assert float(summed["num_samples"]) == sum(float(r["num_samples"]) for r in plain_calls[0]["replies"].values())

    # round 1 trains from the same model at every site in both runs: the sum is the plain weighted mean, quantised
    expected = _weighted_mean(plain_calls[0]["replies"])
    assert set(summed) == {*expected, "num_samples"}
    for key, mean in expected.items():
        assert summed[key].shape == mean.shape
        error = float((summed[key].double() - mean).abs().max()) if mean.numel() else 0.0
        assert error < 1e-4, (key, error)
        assert mean.numel() == 0 or not any(
            torch.allclose(summed[key].double(), reply[key].double(), atol=1e-3) for reply in plain_calls[0]["replies"].values()
        )

    for ours, theirs in zip(secure["history"], plain["history"]):
        assert ours["participants"] == theirs["participants"] and ours["failures"] == theirs["failures"] == []
        for site, metrics in theirs["metrics"].items():
            assert ours["metrics"][site] == pytest.approx(metrics, abs=2e-3), site
        assert all(ours["bytes"][site]["up"] > 0 for site in ours["bytes"])


@pytest.mark.deploy
@pytest.mark.skipif(os.environ.get("MEDFED_DEPLOY_FULL") != "1", reason="the full deployment set: MEDFED_DEPLOY_FULL=1 (one more 1-round run, about a minute)")
def test_sites_that_would_be_clipped_drop_out_so_secagg_halts_and_the_round_fails_without_a_sum(federation):
    # A clipping range no weighted entry fits: every site refuses to send a clipped vector (an error at SecAgg+'s
    # collect stage), too few are left to unmask, nothing is aggregated, and every site fails the round with the reason.
    results, calls, _ = _deploy(federation, "clipped", "deploy.secure_aggregation=true", "deploy.clipping_range=1e-9",
                                "federation.max_consecutive_failures=null", "trainer.rounds=1")
    assert calls == []  # the server half received nothing
    (record,) = results["history"]
    assert sorted(failure["site"] for failure in record["failures"]) == ["site0", "site1", "site2"]
    for failure in record["failures"]:
        assert failure["phase"] == "fit" and failure["reason"].startswith("secure aggregation, collect masked vectors stage: ")
        assert f"{failure['site']}: its weighted reply reaches" in failure["reason"] and "clipping range +-1e-09" in failure["reason"]
    assert all(record["bytes"][site]["up"] == 0 for site in record["bytes"])


@pytest.mark.deploy
@pytest.mark.skipif(os.environ.get("MEDFED_DEPLOY_FULL") != "1", reason="the full deployment set: MEDFED_DEPLOY_FULL=1 (one more 1-round run, about a minute)")
def test_a_site_dropping_out_leaves_the_sum_of_the_others(federation, plain_run):
    # Round 1 trains alike in every run, so the plain run tells how far each site's weighted reply reaches: a clipping
    # range between the two largest makes exactly one site refuse to send (it drops out at the collect stage). SecAgg+
    # removes the masks the others added for it (2 of 3 shares rebuild its key) and the sum is the other two's.
    _, plain_calls, _ = plain_run
    replies = plain_calls[0]["replies"]
    largest_n = max(float(reply["num_samples"]) for reply in replies.values())
    reach = {index: max(float(reply[key].abs().max()) for key in ("all", "buffers") if reply[key].numel()) * float(reply["num_samples"]) / largest_n
             for index, reply in replies.items()}
    ranked = sorted(reach, key=reach.get)
    dropped, clipping = ranked[-1], (reach[ranked[-1]] + reach[ranked[-2]]) / 2
    results, calls, _ = _deploy(federation, "dropout", "deploy.secure_aggregation=true", f"deploy.clipping_range={clipping!r}",
                                "trainer.rounds=1")
    (record,) = results["history"]
    (failure,) = record["failures"]
    assert failure["site"] == f"site{dropped}" and failure["reason"].startswith("secure aggregation, collect masked vectors stage: ")
    assert "clipping range" in failure["reason"]
    summed = calls[0]["summed"]
    others = {index: reply for index, reply in replies.items() if index != dropped}
    assert float(summed["num_samples"]) == sum(float(reply["num_samples"]) for reply in others.values())
    for key, mean in _weighted_mean(others).items():
        error = float((summed[key].double() - mean).abs().max()) if mean.numel() else 0.0
        assert error < 1e-4, (key, error)


@pytest.mark.deploy
@pytest.mark.skipif(os.environ.get("MEDFED_DEPLOY_FULL") != "1", reason="the full deployment set: MEDFED_DEPLOY_FULL=1 (two more runs, about two minutes)")
def test_a_secure_run_resumed_after_round_1_gives_the_uninterrupted_secure_runs_numbers(federation, secure_run):
    # SecAgg+'s masks cancel exactly and each site seeds its stochastic rounding from (seed, site, round, phase): the
    # resumed run's sums, and so its numbers, are the uninterrupted run's.
    secure, secure_calls, _ = secure_run
    first, _, _ = _deploy(federation, "resumed", "deploy.secure_aggregation=true", "trainer.rounds=1")
    assert first["history"][0]["metrics"] == secure["history"][0]["metrics"]
    (federation[2] / "resumed" / "results.json").unlink()
    resumed, calls, _ = _deploy(federation, "resumed", "deploy.secure_aggregation=true", resume=True)
    assert [call["method"] for call in calls] == ["aggregate_summed", "aggregate"] and calls[0]["round"] == 2
    for key, value in secure_calls[2]["summed"].items():
        assert torch.equal(calls[0]["summed"][key], value), key
    assert [r["metrics"] for r in resumed["history"]] == [r["metrics"] for r in secure["history"]]


@pytest.mark.deploy
def test_a_hostile_site_under_secagg_is_dropped_at_the_collect_stage_and_named_and_the_honest_sum_goes_on(federation):
    # (Before: a plain weight of 10^9, or a vector with 7 extra entries, failed all three sites in every round: "the
    # securely summed reply of sites [0, 1, 2] is refused ... declared 455", "operands could not be broadcast".)
    local = federation[0]
    local.stop_runner(2)
    try:
        local.start_runner(2, [sys.executable, str(REPO / "tests" / "hostile_runner.py"), "--secure"])
        results, calls, _ = _deploy(federation, "hostile", "deploy.secure_aggregation=true", "trainer.rounds=3",
                                    "federation.max_consecutive_failures=null")
        handed = _handed_to_secagg(federation)
    finally:
        local.stop_runner(2)
        local.start_runner(2)
    stage = "secure aggregation, collect masked vectors stage: "
    reasons = {
        1: "refused before the sum: site2: plain weight 1000000000, expected a whole number from 0 to ",
        2: "refused before the sum: site2: vector 'all' declared of shape [38], expected [31] (the model vector's size)",
        3: "malformed reply: message from site2: secure aggregation reply: masked arrays of shapes [[38], [0]], but it declared [[31], [0]]",
    }
    summed = [call["summed"] for call in calls if call["method"] == "aggregate_summed"]
    assert [record["round"] for record in results["history"]] == [1, 2, 3] and len(summed) == 3, calls
    for record, sum_ in zip(results["history"], summed):
        (failure,) = record["failures"]
        assert failure["site"] == "site2" and failure["phase"] == "fit", failure
        assert failure["reason"].startswith(stage + reasons[record["round"]]), failure["reason"]
        assert failure["reason"].endswith("left out of the sum as a dropout (its masks removed with its neighbours' shares)")
        assert record["excluded"] == [] and record["participants"] == ["site0", "site1", "site2"]
        assert all(math.isfinite(value) for site in ("site0", "site1") for value in record["metrics"][site].values())
        honest = {site: handed[(record["round"], site)] for site in (0, 1)}
        total = sum(float(h["weight"]) for h in honest.values())
        assert float(sum_["num_samples"]) == total  # the honest sites' weights only
        for key in ("all", "buffers"):
            mean = sum(float(h["weight"]) * h["vectors"][key].double() for h in honest.values()) / total
            assert sum_[key].shape == mean.shape
            error = float((sum_[key].double() - mean).abs().max()) if mean.numel() else 0.0
            assert error < 1e-4, (record["round"], key, error)  # SecAgg+'s quantisation
