"""Failing sites: the reply checks, and every strategy surviving a site that raises, sends NaN or sends x1e6."""

import logging

import pytest
import torch

from medfed.errors import RunFailed, SiteFailure
from medfed.federated.faults import (
    RoundStartStates, non_finite_keys, refused_replies, reply_key_fault, sample_count_fault, update_norms, update_outliers,
)
from medfed.federated.strategies import registered
from medfed.federated.strategies.fedavg import Averaged
from medfed.federated.protocol import RoundContext
from medfed.options.strategies import strategy_spec
from toy_federation import one_torch_thread  # noqa: F401 (autouse fixture)
from toy_federation import LinearClassifier, build_loop, seeded, two_group_federation, with_a_body

STRATEGIES = registered()

ALTERNATING = {"schedule": "alternating"}  # pFedNet's two phases (the default is one joint phase)
RAISES, SENDS_NAN, SENDS_HUGE = 1, 2, 3  # the faulty sites of a 6-site federation; 0, 4 and 5 stay healthy
FAULT_ROUND = 2


def _loop(name, n_sites=6, options=None, **kwargs):
    model = with_a_body(name, LinearClassifier)
    return build_loop(name, two_group_federation(n_sites=n_sites), seeded(model, 4, 2), options or strategy_spec(name).smoke, **kwargs)


def _model_keys(loop):
    """Reply keys that carry model weights (coded keys not declared against zeros, e.g. not PGFed's gradient)."""
    coded = {prefix for prefix, initial in loop.strategy.coded_keys.items() if initial != "zeros"}
    return lambda key: key.split("/")[0] in coded


def _inject_faults(loop, round_index=FAULT_ROUND):
    """In ``round_index``: site RAISES raises in training, SENDS_NAN replies NaN, SENDS_HUGE replies its weights x 1e6."""
    site = loop.sites[RAISES]
    train = site.train

    def failing_train(*args, **kwargs):
        if loop.round == round_index:
            raise RuntimeError("scanner archive unreachable")
        return train(*args, **kwargs)

    site.train = failing_train
    is_model = _model_keys(loop)
    for faulty in (loop.sites[SENDS_NAN], loop.sites[SENDS_HUGE]):
        reply = faulty.strategy.reply

        def faulty_reply(site, ctx, reply=reply):
            payload = reply(site, ctx)
            if loop.round == round_index and site.index == SENDS_NAN:
                payload = {key: torch.full_like(value, float("nan")) for key, value in payload.items()}
            if loop.round == round_index and site.index == SENDS_HUGE:
                payload = {key: value * 1e6 if is_model(key) else value for key, value in payload.items()}
            return payload

        faulty.strategy.reply = faulty_reply


def _without_sites(loop, absent, round_index=FAULT_ROUND):
    """The same loop where the ``absent`` site indices simply do not take part in ``round_index``."""
    participants = loop.participants
    loop.participants = lambda r: [i for i in participants(r) if r != round_index or i not in absent]
    return loop


def test_non_finite_keys_name_every_entry_with_a_nan_or_an_infinity():
    payload = {"all": torch.tensor([1.0, float("nan")]), "n": torch.tensor([2.0]), "g": torch.tensor([float("-inf")])}
    assert non_finite_keys(payload) == ["all", "g"]


def test_update_norms_are_measured_against_the_servers_message_of_the_same_key_else_as_the_entry_itself():
    message = {"all": torch.tensor([1.0, 1.0, 1.0, 1.0]), "core/0": torch.tensor([9.0, 9.0, 9.0, 9.0]), "gradient": torch.ones(2)}
    reply = {
        "all": torch.tensor([1.0, 4.0, 5.0, 1.0]),  # - message["all"]: (0, 3, 4, 0)
        "core/3": torch.tensor([1.0, 1.0, 1.0, 2.0]),  # not sent this phase (core/0 was): itself
        "gradient": torch.tensor([3.0, 4.0]),  # declared against zeros: itself, whatever was sent
        "num_samples": torch.tensor([100.0]),
        "shared": torch.zeros(0),
    }
    coded_keys = {"all": "all", "core": "all", "gradient": "zeros", "shared": "shared"}
    assert update_norms(reply, message, coded_keys) == {"all": 5.0, "core": 7.0**0.5, "gradient": 5.0}


def test_a_sample_count_above_the_declared_size_or_not_a_whole_number_is_refused():
    assert sample_count_fault({"all": torch.ones(3)}, 10) is None  # no count: nothing to check
    assert sample_count_fault({"num_samples": torch.tensor([10.0])}, 10) is None
    assert sample_count_fault({"num_samples": torch.tensor([0.0])}, 10) is None
    for bad in ([1e9], [11.0], [-1.0], [2.5], [1.0, 1.0]):
        assert "num_samples" in sample_count_fault({"num_samples": torch.tensor(bad)}, 10), bad
    # 2**24 + 3 is not a float32: the count travels rounded up to 2**24 + 4, and the declared size is compared so
    assert sample_count_fault({"num_samples": torch.tensor([float(2**24 + 3)])}, 2**24 + 3) is None


def test_refused_replies_check_the_keys_and_counts_first_and_measure_the_rest_for_outliers():
    message = {"all": torch.zeros(4)}
    replies = {i: {"all": torch.full((4,), 1.0 + 0.1 * i), "num_samples": torch.tensor([5.0])} for i in range(6)}
    replies[1]["num_samples"] = torch.tensor([1e9])  # inflated: refused, and not counted in the median
    replies[3]["all"] = torch.full((4,), 1e30)  # small claimed norms are never asked for: measured here
    del replies[4]["num_samples"]  # FedAvg's aggregate would meet a KeyError
    server, ctx = STRATEGIES["fedavg"].Server(None, None, 6, 0), RoundContext(1, "fit")
    server.averaged = Averaged("all", None)  # replies of "all" and "num_samples"
    reasons = refused_replies(replies, dict.fromkeys(replies, message), server, ctx, [5] * 6, {"all": "all"}, 10.0)
    assert sorted(reasons) == [1, 3, 4]
    assert reasons[1].startswith("reply 'num_samples' = 1e+09 is not a whole number from 0 to the 5 training samples")
    assert reasons[3].startswith("update norm 2e+30 of 'all' is over 10 x the median")
    assert reasons[4] == "reply lacks 'num_samples' (expected the keys 'all', 'num_samples')"
    assert sorted(refused_replies(replies, dict.fromkeys(replies, message), server, ctx, [5] * 6, {"all": "all"}, None)) == [1, 4]


def test_reply_keys_must_be_exactly_one_declared_set_and_the_reason_names_the_closest():
    one = (frozenset({"all", "num_samples"}),)
    assert reply_key_fault({"all": torch.ones(2), "num_samples": torch.ones(1)}, one) is None
    assert reply_key_fault({"all": torch.ones(2)}, one) == "reply lacks 'num_samples' (expected the keys 'all', 'num_samples')"
    assert reply_key_fault({"all": torch.ones(2), "num_samples": torch.ones(1), "x": torch.ones(1)}, one) == (
        "reply has the unexpected 'x' (expected the keys 'all', 'num_samples')"
    )
    assert reply_key_fault({"num_samples": torch.ones(1), "x": torch.ones(1)}, one) == (
        "reply lacks 'all' and has the unexpected 'x' (expected the keys 'all', 'num_samples')"
    )
    assert reply_key_fault({"x": torch.ones(1)}, (frozenset(),)) == "reply has the unexpected 'x' (expected no keys)"
    clusters = tuple(frozenset({"cluster_id", f"cluster/{j}"}) for j in range(3))  # the site chooses one
    assert reply_key_fault({"cluster_id": torch.ones(1), "cluster/2": torch.ones(2)}, clusters) is None
    assert reply_key_fault({"cluster_id": torch.ones(1), "cluster/7": torch.ones(2)}, clusters) == (
        "reply lacks 'cluster/0' and has the unexpected 'cluster/7' (expected the keys 'cluster/0', 'cluster_id')"
    )


def test_update_outliers_compare_each_key_with_its_median():
    norms = {0: {"all": 1.0, "gradient": 5.0}, 1: {"all": 1.2}, 2: {"all": 0.9, "gradient": 4.0}, 3: {"all": 12.5, "gradient": 6.0}}
    assert update_outliers(norms, 10.0) == {3: "update norm 12.5 of 'all' is over 10 x the median 1.1 of 4 replies"}
    assert update_outliers(norms, 12.0) == {}
    assert update_outliers({0: {"all": 0.0}, 1: {"all": 0.0}, 2: {"all": 3.0}}, 10.0) == {}  # a zero median flags nothing
    assert update_outliers({0: {"all": 1.0}, 1: {"all": 1e9}}, 10.0) == {}  # two replies: the median is their mean


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_a_site_that_raises_sends_nan_or_sends_huge_weights_is_left_out_of_that_round(name, caplog):
    # Every fault strikes in the round's first phase that can show it (APPLE's raising training and
    # huge weights: its fit phase, after "select", which trains nothing and only decides what the
    # site itself downloads), so each faulty
    # site's round equals not taking part in it: the other sites must end where they end in a run
    # in which sites 1-3 simply skip round 2. (A site failing later in pFedNet's round counts in
    # the shared phase: tested below.) Local training sends nothing: only its raising site fails.
    # Under pooled data only the pool site (site 0, healthy here) trains or sends anything, so none
    # of these faults can strike (test_pooled.py fails the pool site itself).
    faulty = _loop(name)
    _inject_faults(faulty)
    with caplog.at_level(logging.WARNING, logger="medfed"):
        faulty.fit(3)
    first = faulty.strategy.phases[0]
    first_training = next((phase for phase in faulty.strategy.phases if faulty.sites[RAISES].strategy.plan(RoundContext(FAULT_ROUND, phase))), None)
    expected = {} if first_training is None else {RAISES: (first_training, "RuntimeError: scanner archive unreachable")}
    if name != "local" and not faulty.strategy.pools_data:
        expected[SENDS_NAN] = (first, "non-finite reply")
        expected[SENDS_HUGE] = ("fit" if name == "apple" else first, "update norm")
    reference = _without_sites(_loop(name), set(expected))
    reference.fit(3)
    failures = faulty.history[FAULT_ROUND - 1]["failures"]
    assert [f["site"] for f in failures] == [f"site{i}" for i in sorted(expected)]
    for failure, (index, (phase, reason)) in zip(failures, sorted(expected.items())):
        assert failure["round"] == FAULT_ROUND and failure["phase"] == phase and failure["reason"].startswith(reason)
        assert f"round {FAULT_ROUND}: site site{index} left out of the {phase} phase" in caplog.text
        if phase == first:  # nothing it sent was encoded
            assert faulty.history[FAULT_ROUND - 1]["bytes"][f"site{index}"]["up"] == 0
    assert all(not record["failures"] for i, record in enumerate(faulty.history) if i != FAULT_ROUND - 1)
    assert not faulty.excluded and faulty.history[-1]["participants"] == [site.name for site in faulty.sites]
    for site in faulty.sites:
        if site.index not in expected:
            assert torch.equal(site.module.get_vector("all"), reference.sites[site.index].module.get_vector("all")), site.name
    for a, b in zip(faulty.history, reference.history):
        assert {s: m for s, m in a["metrics"].items() if s in ("site0", "site4", "site5")} == {
            s: m for s, m in b["metrics"].items() if s in ("site0", "site4", "site5")
        }


def test_a_pfednet_site_failing_in_the_personal_phase_counts_in_the_shared_one_and_is_delivered_the_new_shared_part():
    loop = _loop("pfednet", options=ALTERNATING)
    site = loop.sites[RAISES]
    train = site.train

    def fails_in_personal_phase(steps, slot, part, *args, **kwargs):
        if loop.round == FAULT_ROUND and part == "personal":
            raise RuntimeError("disk full")
        return train(steps, slot, part, *args, **kwargs)

    site.train = fails_in_personal_phase
    aggregated = []  # (round, phase, sites replying)
    aggregate = loop.server.aggregate
    loop.server.aggregate = lambda ctx, replies: (aggregated.append((ctx.round, ctx.phase, sorted(replies))), aggregate(ctx, replies))
    loop.fit(FAULT_ROUND)
    failure = {"round": FAULT_ROUND, "site": "site1", "phase": "personal", "reason": "RuntimeError: disk full"}
    assert loop.history[-1]["failures"] == [failure]
    assert aggregated[-2:] == [(FAULT_ROUND, "shared", [0, 1, 2, 3, 4, 5]), (FAULT_ROUND, "personal", [0, 2, 3, 4, 5])]
    assert torch.equal(site.module.get_vector("shared"), loop.server.shared)  # put back, then delivered x_{t+1}
    assert torch.equal(site.module.get_vector("personal"), loop.server.personal[:, RAISES])


def test_a_failing_site_gets_back_its_start_of_round_state():
    loop = _loop("fedamp")
    loop.fit(1)
    site = loop.sites[SENDS_HUGE]
    before = site.state_dict()
    before = {"module": {k: v.clone() for k, v in before["slots"]["model"]["module"].items()}, "generator": before["generator"].clone()}
    _inject_faults(loop)
    loop.fit(2)
    assert loop.history[-1]["failures"][-1]["site"] == "site3"
    for key, value in site.module.state_dict().items():  # FedAMP delivers nothing: the site keeps its model
        assert torch.equal(value, before["module"][key]), key
    assert torch.equal(site.orders.generator.get_state(), before["generator"])  # and its data order


def test_a_site_failing_k_rounds_in_a_row_is_excluded_from_the_rest_of_the_run(caplog):
    loop = _loop("fedavg", max_consecutive_failures=2)
    site = loop.sites[RAISES]
    failing_rounds = {1, 3, 4}  # round 2 succeeds: the streak restarts

    def train(*args, train=site.train, **kwargs):
        if loop.round in failing_rounds:
            raise RuntimeError("no GPU")
        return train(*args, **kwargs)

    site.train = train
    with caplog.at_level(logging.WARNING, logger="medfed"):
        loop.fit(5)
    assert [len(record["failures"]) for record in loop.history] == [1, 0, 1, 1, 0]
    assert [record["excluded"] for record in loop.history] == [[], [], [], ["site1"], []]
    assert loop.excluded == {"site1": {"round": 4, "reason": "RuntimeError: no GPU"}}
    assert "site1" not in loop.history[-1]["participants"] and "site1" in loop.history[-1]["metrics"]  # still evaluated
    assert "round 4: site site1 excluded from the rest of the run after failing 2 rounds in a row" in caplog.text
    state = loop.state_dict()
    resumed = _loop("fedavg", max_consecutive_failures=2)
    resumed.load_state_dict(state)
    assert resumed.excluded == loop.excluded and resumed.failure_streaks == loop.failure_streaks


def test_stop_raises_at_the_first_failure_and_every_site_excluded_ends_the_run():
    loop = _loop("fedavg", on_site_failure="stop")
    _inject_faults(loop)
    loop.fit(1)
    with pytest.raises(SiteFailure, match="^site site1 failed in round 2 \\(fit phase\\): RuntimeError: scanner archive unreachable$"):
        loop.fit(2)

    loop = _loop("fedavg", n_sites=2, max_consecutive_failures=1)
    for site in loop.sites:
        site.train = lambda *args, **kwargs: 1 / 0
    loop.fit(1)
    with pytest.raises(SiteFailure, match="every site has been excluded \\(site0 after round 1: ZeroDivisionError"):
        loop.fit(2)


def test_a_site_claiming_more_samples_than_it_declared_or_replying_a_wrong_sized_model_is_left_out_of_that_round(caplog):
    # What the server decodes is checked by the server: a count over the site's declared training-set size
    # (FedAvg would weight by it) and a model vector one value longer than the model are refused, and the
    # round goes on exactly as if those sites had not taken part; their honest later rounds count again.
    faulty = _loop("fedavg")
    declared = faulty.sites.declared_samples
    assert declared == [site.n_train for site in faulty.sites] and min(declared) > 0
    tamper = {
        RAISES: lambda payload: {**payload, "num_samples": torch.tensor([1e9])},
        SENDS_NAN: lambda payload: {**payload, "all": torch.cat([payload["all"], torch.zeros(1)])},
    }
    for index, alter in tamper.items():
        site = faulty.sites[index]

        def altered_reply(site, phase, reply=site.strategy.reply, alter=alter):
            payload = reply(site, phase)
            return alter(payload) if faulty.round == FAULT_ROUND else payload

        site.strategy.reply = altered_reply
    with caplog.at_level(logging.WARNING, logger="medfed"):
        faulty.fit(3)
    reference = _without_sites(_loop("fedavg"), set(tamper))
    reference.fit(3)
    failures = faulty.history[FAULT_ROUND - 1]["failures"]
    assert [(f["site"], f["phase"]) for f in failures] == [("site1", "fit"), ("site2", "fit")]
    assert failures[0]["reason"] == (
        f"reply 'num_samples' = 1e+09 is not a whole number from 0 to the {declared[RAISES]} training samples the site declared"
    )
    d = faulty.sites[0].module.get_vector("all").numel()
    assert failures[1]["reason"] == (
        f"malformed reply: message from site2, payload 'all': shape ({d + 1},) holds {d + 1} values, "
        f"expected {d} like the key's known value"
    )
    assert all(not record["failures"] for i, record in enumerate(faulty.history) if i != FAULT_ROUND - 1)
    assert [r["metrics"] for r in faulty.history] == [r["metrics"] for r in reference.history]
    assert torch.equal(faulty.server.global_model, reference.server.global_model)


def _declarations_checked(loop):
    """Record, for every reply the server checks, its keys and what the server half declared: ``[(ctx, index, keys, declared)]``.

    The server half declares a phase's keys before the sites work (the loop hands them to the replies' checks) and
    a setup's after its replies: each entry is made when the second of the two, reply and declaration, arrives."""
    replies, declarations, checked = {}, {}, []

    def pair(index):
        if index in replies and index in declarations:
            ctx, declared = declarations.pop(index)
            checked.append((ctx, index, replies.pop(index), declared))

    for index, link in enumerate(loop.links):
        def send(direction, payload, index=index, link_send=link.send):
            received = link_send(direction, payload)
            if direction == "up":
                replies[index] = frozenset(received)
                pair(index)
            return received

        link.send = send
    declare = loop.server.reply_keys

    def reply_keys(ctx, index):
        declared = declare(ctx, index)
        declarations[index] = (ctx, declared)
        pair(index)
        return declared

    loop.server.reply_keys = reply_keys
    return checked


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_every_strategys_real_replies_have_exactly_the_keys_its_server_half_declares(name):
    # Two rounds: a round's replies may depend on the one before (PGFed's a_i from round 2 on).
    loop = _loop(name, n_sites=4)
    checked = _declarations_checked(loop)
    loop.fit(2)
    assert all(not record["failures"] for record in loop.history) and not loop.excluded
    phases = {(ctx.round, ctx.phase) for ctx, *_ in checked}
    assert phases == {(0, "setup")} | {(r, phase) for r in (1, 2) for phase in loop.strategy.phases}
    assert len(checked) == 4 * len(phases)  # every site's reply of every phase, setup included
    for ctx, index, keys, declared in checked:
        assert keys in declared, (ctx, index, keys, declared)
    if name != "local":
        assert any(keys for *_, keys, _ in checked)  # something was checked


@pytest.mark.parametrize("name", sorted(set(STRATEGIES) - {"local"}))
def test_a_reply_without_a_declared_key_drops_the_site_from_the_round(name, caplog):
    # In round 1 one site (the first that replies anything) leaves out one key of its first non-empty reply:
    # the server refuses it before its aggregate reads it (a KeyError before) and the run goes on.
    probe = _loop(name, n_sites=4)
    checked = _declarations_checked(probe)
    probe.fit(1)
    ctx, index, keys, _ = next(entry for entry in checked if entry[0].round == 1 and entry[2])
    removed = sorted(keys)[-1]
    loop = _loop(name, n_sites=4)
    site = loop.sites[index]

    def reply_without(view, reply_ctx, reply=site.strategy.reply):
        payload = reply(view, reply_ctx)
        if reply_ctx == ctx:
            payload.pop(removed)
        return payload

    site.strategy.reply = reply_without
    with caplog.at_level(logging.WARNING, logger="medfed"):
        loop.fit(2)
    assert [(f["site"], f["phase"]) for f in loop.history[0]["failures"]] == [(f"site{index}", ctx.phase)]
    assert loop.history[0]["failures"][0]["reason"].startswith(f"reply lacks {removed!r} (expected the keys ")
    assert not loop.history[1]["failures"] and not loop.excluded
    assert f"site{index} left out of the {ctx.phase} phase" in caplog.text


def test_a_site_whose_setup_reply_is_refused_is_excluded_from_the_start_and_the_run_goes_on(caplog):
    # APPLE's sites send their sample count at setup (its prior p_0): an inflated one excludes that site,
    # which never takes part, is evaluated every round, and has no weight in p_0.
    loop = _loop("apple", n_sites=4)
    site = loop.sites[2]
    setup = site.strategy.setup
    site.strategy.setup = lambda view, ctx: {**setup(view, ctx), "num_samples": torch.tensor([1e9])}
    with caplog.at_level(logging.WARNING, logger="medfed"):
        loop.fit(2)
    declared = loop.sites.declared_samples[2]
    reason = f"reply 'num_samples' = 1e+09 is not a whole number from 0 to the {declared} training samples the site declared"
    assert loop.excluded == {"site2": {"round": 0, "reason": reason}}
    assert [r.getMessage() for r in caplog.records] == [f"site site2 excluded from the run at setup: {reason}"]
    assert all(record["participants"] == ["site0", "site1", "site3"] and not record["failures"] for record in loop.history)
    assert set(loop.history[-1]["metrics"]) == {"site0", "site1", "site2", "site3"}
    assert loop.server.prior[2] == 0 and torch.isclose(loop.server.prior.sum(), torch.tensor(1.0, dtype=loop.server.prior.dtype))


def test_setup_replies_without_their_keys_exclude_the_sites_and_none_left_ends_the_run():
    loop = _loop("ifca", n_sites=4)
    for site in loop.sites[1:3]:
        site.strategy.setup = lambda view, ctx: {}  # no cluster index
    loop.fit(1)
    assert sorted(loop.excluded) == ["site1", "site2"]
    assert loop.excluded["site1"]["reason"] == "reply lacks 'cluster_id' (expected the keys 'cluster_id')"
    assert loop.history[0]["participants"] == ["site0", "site3"]

    everyone = _loop("ifca", n_sites=2)
    for site in everyone.sites:
        site.strategy.setup = lambda view, ctx: {"cluster_id": torch.zeros(1), "extra": torch.zeros(1)}
    with pytest.raises(RunFailed, match="every site's setup reply was refused \\(site0 after round 0: reply has the unexpected 'extra'"):
        everyone.fit(1)

    graph = _loop("pfednet", n_sites=4)
    graph.sites[3].strategy.setup = lambda view, ctx: {}
    with pytest.raises(SiteFailure, match="pfednet's similarity graph in data space needs every site's sketch; sites \\[3\\]"):
        graph.fit(1)


def test_a_site_whose_delivery_reply_cannot_be_read_fails_the_round_with_its_metrics_missing(caplog):
    # Deployed, a delivery reply may be malformed, an error or late (test_deploy_apps): the executor
    # gives that site an evaluation with an error. The site fails the round, its metrics are NaN,
    # the round's mean is over the other sites, and the run goes on.
    import math

    from medfed.federated.site_work import SiteEvaluation

    loop = _loop("fedavg", n_sites=4)
    deliver = loop.sites.deliver

    def deliver_with_a_bad_reply(round_index, payloads, evaluate, timing):
        evaluations = deliver(round_index, payloads, evaluate, timing)
        if round_index == FAULT_ROUND:
            evaluations["site1"] = SiteEvaluation({}, error="no reply within reply-timeout-s = 60 s")
        return evaluations

    loop.sites.deliver = deliver_with_a_bad_reply
    with caplog.at_level(logging.WARNING, logger="medfed"):
        loop.fit(3)
    record = loop.history[FAULT_ROUND - 1]
    assert record["failures"] == [{"round": 2, "site": "site1", "phase": "deliver", "reason": "no reply within reply-timeout-s = 60 s"}]
    assert list(record["metrics"]["site1"]) == ["accuracy"] and math.isnan(record["metrics"]["site1"]["accuracy"])
    others = [record["metrics"][name]["accuracy"] for name in ("site0", "site2", "site3")]
    assert record["mean"]["accuracy"] == pytest.approx(sum(others) / 3)
    assert not loop.history[2]["failures"] and loop.failure_streaks[1] == 0
    assert "round 2: site site1 failed its deliver phase, its metrics of the round are missing" in caplog.text

    stopping = _loop("fedavg", n_sites=4, on_site_failure="stop")
    stopping_deliver = stopping.sites.deliver
    stopping.sites.deliver = lambda *args: {**stopping_deliver(*args), "site1": SiteEvaluation({}, error="late")}
    with pytest.raises(SiteFailure, match="site site1 failed in round 1 \\(deliver phase\\): late"):
        stopping.fit(1)


def test_an_ifca_cluster_index_that_is_not_one_or_names_another_clusters_keys_is_refused():
    # (Index 1 with cluster 0's keys was a KeyError in aggregate; index 7 at setup an IndexError at the delivery;
    # index -1 silently the last cluster.)
    loop = _loop("ifca", n_sites=4)
    loop.setup()
    server, fit = loop.server, RoundContext(1, "fit")
    reply = {"cluster_id": torch.tensor([1.0]), "cluster/0": torch.zeros(3), "cluster_buffers/0": torch.zeros(0), "num_samples": torch.tensor([4.0])}
    assert reply_key_fault(reply, server.reply_keys(fit, 0)) is None
    assert server.reply_fault(fit, 0, reply) == "reply 'cluster_id' = 1 names another cluster than the model it sent"
    assert server.reply_fault(fit, 0, {**reply, "cluster_id": torch.tensor([0.0])}) is None
    for bad in ([7.0], [-1.0], [0.5], [0.0, 1.0]):
        assert server.reply_fault(RoundContext(0, "setup"), 0, {"cluster_id": torch.tensor(bad)}) == (
            "reply 'cluster_id' is not one cluster index from 0 to 1"
        ), bad

    lying = _loop("ifca", n_sites=4)
    site = lying.sites[2]
    reply_of = site.strategy.reply
    site.strategy.reply = lambda view, ctx: {**reply_of(view, ctx), "cluster_id": torch.tensor([5.0])}
    lying.fit(1)
    assert [(f["site"], f["reason"]) for f in lying.history[0]["failures"]] == [("site2", "reply 'cluster_id' is not one cluster index from 0 to 1")]


def test_a_site_excluded_at_setup_stays_excluded_for_its_first_reason_whatever_it_fails_later(caplog):
    from medfed.federated.site_work import SiteEvaluation

    loop = _loop("fedavg", n_sites=4, max_consecutive_failures=2)
    loop.sites[2].strategy.setup = lambda view, ctx: {"gossip": torch.zeros(1)}
    deliver = loop.sites.deliver
    loop.sites.deliver = lambda *args: {**deliver(*args), "site2": SiteEvaluation({}, error="late")} if args[2] else deliver(*args)
    with caplog.at_level(logging.WARNING, logger="medfed"):
        loop.fit(3)
    assert loop.excluded == {"site2": {"round": 0, "reason": "reply has the unexpected 'gossip' (expected no keys)"}}
    assert all(record["excluded"] == [] and [f["site"] for f in record["failures"]] == ["site2"] for record in loop.history)
    assert "after failing" not in caplog.text


@pytest.mark.parametrize("memory_budget", [None, 0], ids=["in memory", "on disk"])
def test_round_start_states_put_a_trained_site_back_from_memory_or_disk(tmp_path, memory_budget):
    loop = _loop("fedavg")
    loop.fit(1)
    site = loop.sites[0]
    expected = {key: value.clone() for key, value in site.module.state_dict().items()}
    expected_optimizer = [value.clone() for value in _optimizer_tensors(site)]
    expected_generator = site.orders.generator.get_state().clone()
    states = RoundStartStates(tmp_path / "scratch", memory_budget=memory_budget)
    states.save(site)
    for _ in range(2):  # train on: the kept state must not follow the site (no shared tensors)
        ctx = RoundContext(2, "fit")
        plan = site.strategy.plan(ctx)[0]
        site.train(site.steps(1, 0.0), plan.slot, plan.part, lambda batch: site.strategy.loss(site.view, ctx, plan, batch))
        assert not all(torch.equal(value, expected[key]) for key, value in site.module.state_dict().items())
        states.restore(site)
        for key, value in site.module.state_dict().items():
            assert torch.equal(value, expected[key]), key
        restored = _optimizer_tensors(site)
        assert len(restored) == len(expected_optimizer) and all(torch.equal(a, b) for a, b in zip(restored, expected_optimizer))
        assert torch.equal(site.orders.generator.get_state(), expected_generator)
    on_disk = sorted(path.name for path in tmp_path.rglob("*.pt"))
    assert on_disk == ([] if memory_budget is None else ["site0.pt"])  # the default budget writes nothing
    states.close()
    assert not list(tmp_path.rglob("*.pt"))


def test_round_start_states_beyond_the_memory_budget_go_to_disk(tmp_path):
    loop = _loop("fedavg")
    loop.fit(1)
    one_site = _state_bytes(loop.sites[0].state_dict())
    states = RoundStartStates(tmp_path, memory_budget=2 * one_site)
    for site in loop.sites[:3]:
        states.save(site)
    assert sorted(states.in_memory) == [0, 1] and states.memory_bytes == 2 * one_site
    assert [path.name for path in tmp_path.rglob("*.pt")] == ["site2.pt"]
    states.save(loop.sites[0])  # the next round's copy replaces the earlier one, within the same budget
    assert sorted(states.in_memory) == [0, 1] and states.memory_bytes == 2 * one_site
    states.close()
    assert not list(tmp_path.rglob("*.pt")) and states.memory_bytes == 0


def _optimizer_tensors(site):
    """The tensors of the optimiser state of the site's evaluated slot (Adam's moments and step counts), in order."""
    optimizer = site.slot(site.evaluated_slot).optimizer
    return [value for state in optimizer.state.values() for value in state.values() if torch.is_tensor(value)]


def _state_bytes(state):
    if torch.is_tensor(state):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(_state_bytes(value) for value in state.values())
    if isinstance(state, (list, tuple)):
        return sum(_state_bytes(value) for value in state)
    return 0
