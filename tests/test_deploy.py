"""A real Flower deployment on localhost gives the simulator's numbers; a killed and restarted SuperNode rejoins; a resumed server continues.

Always (CI): fedavg with dense messages; pfednet with CER+STC codecs both
ways, site 1's SuperNode killed and restarted in round 2, then the server
resumed from its round-1 checkpoint while the sites had finished round 2.
With ``MEDFED_DEPLOY_FULL=1`` also: pfednet with dense messages and a
restart; fedavg with CER+STC; fedavg run for 1 round and resumed with
``trainer.rounds=2``, a site without its snapshot of round 1 refused first;
``python -m medfed deploy submit`` refusing a bad run config (exit status
2, nothing submitted) and reporting a run whose sites cannot build
themselves (exit status 1, Flower's failed status and reason).

One SuperLink and, per site, a SuperNode (``--isolation process``) and its
resident runner (:mod:`medfed.deploy.runner`), all child processes on
127.0.0.1 with free ports, shared by the tests of this module; each test
submits its runs with ``flwr run``. Each SuperNode gets its site index and
its own data folder (that site's records only) through ``--node-config``.
The per-site metrics, training losses and bytes of every round must equal the
simulator's run of the same config and seed, bit for bit on the CPU; the
simulator runs in a child process while the deployment runs. Every process
is stopped by its process id, whatever the outcome: the simulator's when its
test ends, the federation's when the module's tests end.
"""

import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

pytest.importorskip("flwr")

from medfed.config import FederationConfig  # noqa: E402
from medfed.deploy.local import CONNECTION, LocalFederation, run_config_text  # noqa: E402
from medfed.tasks import clinical  # noqa: E402

pytestmark = pytest.mark.deploy
FULL = pytest.mark.skipif(
    os.environ.get("MEDFED_DEPLOY_FULL") != "1",
    reason="the full deployment set, about 6 minutes on a loaded 2-core machine: MEDFED_DEPLOY_FULL=1 python -m pytest -m deploy",
)
REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "clinical_delta1.yaml"
ENV = {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
RUN_TIMEOUT_S = 300


@dataclass
class Rehearsal:
    """The module's running federation, the full table (for the simulator) and each site's own file."""

    local: LocalFederation
    csv: Path
    files: list[Path]
    tmp: Path


@pytest.fixture(scope="module")
def rehearsal(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("deploy")
    csv = tmp / "all" / "breast_cancer.csv"
    files = clinical.site_records(clinical.Options(csv=str(csv)), FederationConfig(n_sites=3), 0, tmp / "sites")
    with LocalFederation(tmp / "flwr", env=ENV) as local:  # stops every process it started, whatever happens
        local.start_superlink()
        for index, file in enumerate(files):
            local.start_supernode(index, file.parent, state_dir=str(tmp / f"state{index}"))
        yield Rehearsal(local, csv, files, tmp)


def _overrides(rehearsal: Rehearsal, strategy: str, *extra: str) -> list[str]:
    return [
        f"data.csv={rehearsal.csv}", "federation.n_sites=3", "federation.label_ratio=null", "trainer.rounds=2",
        "trainer.num_threads=1", "logger.wandb=disabled", f"strategy.name={strategy}", *extra,
    ]


@contextmanager
def _simulating(rehearsal: Rehearsal, name: str, overrides: list[str]) -> Iterator[Callable[[], dict]]:
    """The simulator's run of the same config in a child process; yields a function waiting for its results."""
    out = rehearsal.tmp / f"sim-{name}"
    command = [sys.executable, "-m", "medfed", "fit", "--config", str(CONFIG), "--quiet", *overrides, f"output_dir={out}"]
    popen = subprocess.Popen(command, env={**os.environ, **ENV}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)

    def results() -> dict:
        output, _ = popen.communicate(timeout=RUN_TIMEOUT_S)
        assert popen.returncode == 0, output.decode(errors="replace")[-3000:]
        return json.loads((out / "results.json").read_text())

    try:
        yield results
    finally:
        if popen.poll() is None:
            popen.kill()  # by its pid; it starts no children
            popen.communicate()


def _run_config(rehearsal: Rehearsal, name: str, overrides: list[str]) -> dict:
    return {
        "config": str(CONFIG), "overrides": " ".join(overrides), "output-dir": str(rehearsal.tmp / f"deployed-{name}"),
        "run-name": name, "reply-timeout-s": 120.0,
    }


def _results(rehearsal: Rehearsal, name: str, log: str) -> dict:
    path = rehearsal.tmp / f"deployed-{name}" / "results.json"
    assert path.is_file(), f"the run wrote no results.json; its log ends:\n{log[-3000:]}"
    return json.loads(path.read_text())


def _assert_same_numbers(deployed: dict, simulated: dict) -> None:
    assert len(deployed["history"]) == len(simulated["history"]) == 2
    for key in ("metrics", "train_loss", "bytes", "participants", "failures"):
        assert [r[key] for r in deployed["history"]] == [r[key] for r in simulated["history"]], key
    assert sum(r["bytes"]["site0"]["up"] for r in deployed["history"]) > 0


def _errors(log: str) -> list[str]:
    """The ServerApp's ``medfed: error:`` lines in a run's log."""
    return [line for line in log.splitlines() if line.startswith("medfed: error:")]


def _resume(rehearsal: Rehearsal, name: str, overrides: list[str]) -> dict:
    """Submit the run ``name`` again with ``resume=true`` and wait for it; its results."""
    log = rehearsal.local.run(REPO, {**_run_config(rehearsal, name, overrides), "resume": True}, RUN_TIMEOUT_S)
    assert "medfed: resumed after round 1" in log, log[-3000:]
    return _results(rehearsal, name, log)


def _run_with_a_restart(rehearsal: Rehearsal, name: str, overrides: list[str], resume: bool = False) -> tuple[dict, ...]:
    """Deploy and simulate ``overrides``; once round 1 is over, kill site 1's SuperNode and runner and start them again.

    With ``resume``, once the run is over its server loses round 2 (its
    checkpoint and results.json deleted: it died after the sites had
    finished round 2, before checkpointing it) and the run is resumed.

    Returns:
        The deployed and the simulated results, then the resumed run's with ``resume``.
    """
    local = rehearsal.local
    with _simulating(rehearsal, name, overrides) as simulated:
        submitted = local.submit(REPO, _run_config(rehearsal, name, overrides))
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while "medfed round 1:" not in submitted.log.read_text():  # round 1 is over: round 2's first phase is under way
            assert submitted.running() and time.monotonic() < deadline, submitted.log.read_text()[-3000:]
            time.sleep(0.1)
        local.stop_supernode(1, kill=True)  # SIGKILL: SuperNode and runner gone mid-round, as in a crash
        restarted = local.start_supernode(1, rehearsal.files[1].parent, state_dir=str(rehearsal.tmp / "state1"))
        log = local.wait(submitted, RUN_TIMEOUT_S)
        results = _results(rehearsal, name, log), simulated()
        if resume:
            out = rehearsal.tmp / f"deployed-{name}"
            (out / "checkpoints" / "round-2.ckpt").unlink()
            (out / "results.json").unlink()
            results += (_resume(rehearsal, name, overrides),)
    assert restarted.running()
    assert "train message" in local.runners[1].log.read_text(), "the restarted node's runner answered no round-2 message"
    return results


def test_pfednet_with_cer_stc_codecs_a_supernode_killed_mid_run_and_a_server_resumed_behind_its_sites_gives_the_simulators_numbers(
    rehearsal,
):
    # The run CI makes: the personalised strategy with two phases, lossy stateful codecs both ways (K at
    # both ends, the site's residual A and O kept in its state folder), and a crash in the middle of round 2.
    # Then the server loses round 2 and is resumed from round 1: every site goes back to its end of round 1
    # (models, optimisers, data orders, pFedNet's state, its codec state) and round 2 runs again.
    overrides = _overrides(rehearsal, "pfednet", "codec.up=cer+stc", "codec.down=cer+stc")
    deployed, simulated, resumed = _run_with_a_restart(rehearsal, "pfednet-cer-stc", overrides, resume=True)
    _assert_same_numbers(deployed, simulated)
    assert all(r["bytes"][site]["up"] < r["bytes"][site]["dense_up"] for r in deployed["history"] for site in r["bytes"])
    _assert_same_numbers(resumed, simulated)


def test_fedavg_on_three_supernodes_gives_the_simulators_metrics_and_bytes(rehearsal):
    overrides = _overrides(rehearsal, "fedavg")
    with _simulating(rehearsal, "fedavg", overrides) as simulated:
        log = rehearsal.local.run(REPO, _run_config(rehearsal, "fedavg", overrides), RUN_TIMEOUT_S)
        _assert_same_numbers(_results(rehearsal, "fedavg", log), simulated())


@FULL
def test_pfednet_with_a_supernode_killed_mid_run_gives_the_simulators_metrics_and_bytes(rehearsal):
    overrides = _overrides(rehearsal, "pfednet")
    _assert_same_numbers(*_run_with_a_restart(rehearsal, "pfednet", overrides))


@FULL
def test_fedavg_with_cer_stc_codecs_gives_the_simulators_byte_counts(rehearsal):
    overrides = _overrides(rehearsal, "fedavg", "codec.up=cer+stc", "codec.down=cer+stc")
    with _simulating(rehearsal, "fedavg-cer-stc", overrides) as simulated:
        log = rehearsal.local.run(REPO, _run_config(rehearsal, "fedavg-cer-stc", overrides), RUN_TIMEOUT_S)
        deployed = _results(rehearsal, "fedavg-cer-stc", log)
        _assert_same_numbers(deployed, simulated())
    assert all(r["bytes"]["site0"]["up"] < r["bytes"]["site0"]["dense_up"] for r in deployed["history"])


def _deploy_submit(rehearsal: Rehearsal, run_config: dict) -> subprocess.CompletedProcess:
    """``python -m medfed deploy submit`` of ``run_config`` to the rehearsal's SuperLink (its output captured)."""
    command = [sys.executable, "-m", "medfed", "deploy", "submit", str(REPO), CONNECTION, "--run-config", run_config_text(run_config)]
    env = {**os.environ, **ENV, "FLWR_HOME": str(rehearsal.local.flwr_home())}
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)


@FULL
def test_deploy_submit_refuses_a_bad_run_config_in_one_line_with_status_2_before_submitting(rehearsal):
    overrides = [o for o in _overrides(rehearsal, "fedavg") if not o.startswith("federation.label_ratio")]  # the file's ratio
    submitted = _deploy_submit(rehearsal, _run_config(rehearsal, "bad", overrides))
    assert submitted.returncode == 2, submitted.stdout[-3000:] + submitted.stderr[-3000:]
    errors = submitted.stderr.splitlines()
    assert len(errors) == 1 and errors[0].startswith("medfed: error: config key 'federation.label_ratio'"), submitted.stderr
    assert "started run" not in submitted.stdout and not (rehearsal.tmp / "deployed-bad").exists()


@FULL
def test_deploy_submit_exits_1_with_the_reason_when_the_run_fails(rehearsal):
    overrides = [*_overrides(rehearsal, "fedavg"), "data.csv=/nowhere/records.csv"]  # no site holds records.csv
    submitted = _deploy_submit(rehearsal, _run_config(rehearsal, "failing", overrides))
    assert submitted.returncode == 1, submitted.stdout[-3000:] + submitted.stderr[-3000:]
    errors = [line for line in submitted.stderr.splitlines() if line.startswith("medfed: error:")]
    assert len(errors) == 1 and "finished:failed" in errors[0] and "could not build its site" in errors[0], submitted.stderr


@FULL
def test_a_deployment_run_for_one_round_and_resumed_for_two_gives_the_simulators_numbers(rehearsal):
    # The server's checkpoint and the sites at the same round; trainer.rounds raised. A site whose snapshot
    # of round 1 is missing refuses first: the run ends with one line naming it and the round.
    name, local = "resume-rounds", rehearsal.local
    overrides = _overrides(rehearsal, "fedavg")
    first = [o.replace("trainer.rounds=2", "trainer.rounds=1") for o in overrides]
    with _simulating(rehearsal, name, overrides) as simulated:
        assert len(_results(rehearsal, name, local.run(REPO, _run_config(rehearsal, name, first), RUN_TIMEOUT_S))["history"]) == 1
        (rehearsal.tmp / f"deployed-{name}" / "results.json").unlink()
        snapshot = rehearsal.tmp / "state1" / name / "rounds" / "round-1.ckpt"
        snapshot.rename(snapshot.with_name("aside"))
        log = local.run(REPO, {**_run_config(rehearsal, name, overrides), "resume": True}, RUN_TIMEOUT_S)
        errors = _errors(log)
        assert len(errors) == 1 and "site1 cannot go back to the end of round 1" in errors[0], log[-3000:]
        assert not (rehearsal.tmp / f"deployed-{name}" / "results.json").exists()
        snapshot.with_name("aside").rename(snapshot)
        _assert_same_numbers(_resume(rehearsal, name, overrides), simulated())


def test_a_site_sending_garbage_nan_a_wrong_shape_an_inflated_or_missing_sample_count_or_unreadable_metrics_is_dropped_from_exactly_those_rounds(
    rehearsal,
):
    # Site 2's runner is replaced by tests/hostile_runner.py: medfed's own ClientApp, whose work replies in
    # rounds 1-5 are altered after the site made them (random bytes, an intact NaN stream, the shape
    # (2, -1), 1e9 samples, no sample count), and whose delivery reply in round 6 (after an honest work
    # reply) holds words for metrics. The real ServerApp must refuse each, leave site 2 out of that round
    # only (put back at its end, so its honest round 6 work counts), count its round 6 as failed with its
    # metrics missing, and finish the run. Last in the module: site 2 gets its own runner back afterwards.
    local, name = rehearsal.local, "hostile"
    overrides = [o.replace("trainer.rounds=2", "trainer.rounds=6") for o in _overrides(rehearsal, "fedavg")]
    overrides.append("federation.max_consecutive_failures=null")  # six failures in a row: still a site
    local.stop_runner(2)
    try:
        hostile = local.start_runner(2, [sys.executable, str(REPO / "tests" / "hostile_runner.py")])
        log = local.run(REPO, _run_config(rehearsal, name, overrides), RUN_TIMEOUT_S)
    finally:
        local.stop_runner(2)
        local.start_runner(2)
    history = _results(rehearsal, name, log)["history"]
    assert [len(record["failures"]) for record in history] == [1] * 6, log[-3000:]
    reasons = {
        1: "malformed reply: message from site2, payload 'all': dense stream: ",  # not a medfed stream, or its CRC
        2: "malformed reply: message from site2, payload 'all': dense stream: holds NaN or infinite values",
        3: "malformed reply: message from site2, payload 'all': expected a shape of non-negative integers, got (2, -1)",
        4: "reply 'num_samples' = 1e+09 is not a whole number from 0 to the ",
        5: "reply lacks 'num_samples' (expected the keys 'all', 'buffers', 'num_samples')",
        6: "message from site2: metric ",
    }
    for record, (round_index, reason) in zip(history, reasons.items()):
        (failure,) = record["failures"]
        phase = "deliver" if round_index == 6 else "fit"
        assert failure["round"] == round_index and failure["site"] == "site2" and failure["phase"] == phase
        assert failure["reason"].startswith(reason), failure["reason"]
        assert record["participants"] == ["site0", "site1", "site2"] and record["excluded"] == []
        if phase == "fit":
            assert record["bytes"]["site2"]["up"] == 0  # a refused reply is undone on the server's link
    assert history[-1]["bytes"]["site2"]["up"] > 0 and history[-1]["bytes"]["site2"]["up"] == history[-1]["bytes"]["site0"]["up"]
    assert all(value is None for value in history[-1]["metrics"]["site2"].values())  # NaN in the record: null in JSON
    evaluated = [value for record in history for site, metrics in record["metrics"].items() for value in metrics.values()
                 if (record["round"], site) != (6, "site2")]
    assert all(math.isfinite(value) for value in evaluated)
    assert "train message" in hostile.log.read_text()  # the hostile runner answered site 2's messages
