"""Every registered strategy under partial participation, and through a checkpoint and resume."""

import json
import logging

import pytest
import torch

from medfed.checkpoint import read_checkpoint, save_checkpoint
from medfed.data.pooling import POOL_SITE
from medfed.federated.strategies import registered
from medfed.federated.protocol import DeclaredState, RoundContext
from medfed.models.split import PARTS, ROLES
from medfed.options.strategies import strategy_spec
from toy_federation import one_torch_thread  # noqa: F401 (autouse fixture)
from toy_federation import DropoutClassifier, LinearClassifier, build_loop, seeded, two_group_federation, with_a_body

STRATEGIES = registered()


def _loop(name, participation, model=LinearClassifier):
    model = with_a_body(name, model)
    return build_loop(name, two_group_federation(n_sites=4), seeded(model, 4, 2), strategy_spec(name).smoke, participation=participation)


def _trains(loop, site):
    """Whether a participant trains: every one does, except, under pooled data, the sites that gave theirs to the pool."""
    return not loop.strategy.pools_data or site.index == POOL_SITE


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_sites_that_skip_a_round(name):
    loop = _loop(name, participation=0.5)
    before = None
    for round_index in range(1, 4):
        loop.fit(round_index)
        record = loop.history[-1]
        taking_part = {loop.site_names[i] for i in loop.participants(round_index)}
        training = {loop.site_names[i] for i in loop.participants(round_index) if _trains(loop, loop.sites[i])}
        assert len(taking_part) == 2 and set(record["train_loss"]) == training
        vectors = {site.index: site.module.get_vector("all") for site in loop.sites}
        for site in loop.sites:
            uploaded = record["bytes"][site.name]["up"]
            delivered = loop.server.deliver(RoundContext(round_index, "deliver"), site.index)
            if site.name not in taking_part:
                assert uploaded == 0
                if not delivered and before is not None:  # nothing replaces its evaluated model
                    assert torch.equal(vectors[site.index], before[site.index])
            else:
                assert (uploaded == 0) == (name == "local" or site.name not in training)
            for part, vector in delivered.items():  # a delivered part of the model is some slot's part after the round
                if part in (*PARTS, *ROLES):
                    assert any(torch.equal(slot.module.get_vector(part), vector) for slot in site.slots.values()), part
            assert 0.0 <= record["metrics"][site.name]["accuracy"] <= 1.0
        before = vectors
    assert len({tuple(sorted(loop.participants(r)[:2])) for r in range(1, 4)}) > 1


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_state_round_trips_through_a_checkpoint(name, tmp_path):
    # With dropout, whose masks come from torch's global generator, which the
    # earlier runs in this process have moved on: each site's work is seeded
    # from (seed, site, round, phase), so a second run, and a resumed one, draw the same.
    uninterrupted = _loop(name, participation=0.75, model=DropoutClassifier)
    uninterrupted.fit(4)

    first = _loop(name, participation=0.75, model=DropoutClassifier)
    first.fit(2)
    path = save_checkpoint(tmp_path, {**first.state_dict(), "config": {}}, keep=1)
    resumed = _loop(name, participation=0.75, model=DropoutClassifier)
    resumed.load_state_dict(read_checkpoint(path))  # weights_only: every strategy's state is plain data
    resumed.fit(4)

    for key in ("participants", "metrics", "train_loss", "bytes", "server"):  # (APPLE's untrained "select" loss is NaN)
        twice = [r[key] for r in first.history], [r[key] for r in uninterrupted.history[:2]]
        assert json.dumps(twice[0]) == json.dumps(twice[1]), key
        assert json.dumps([r[key] for r in resumed.history]) == json.dumps([r[key] for r in uninterrupted.history]), key
    for a, b in zip(resumed.sites, uninterrupted.sites):
        assert torch.equal(a.module.get_vector("all"), b.module.get_vector("all"))


def test_a_resume_with_another_thread_count_warns(caplog):
    loop = _loop("fedavg", participation=1.0)
    loop.fit(1)
    state = loop.state_dict()
    assert state["num_threads"] == torch.get_num_threads() == 1  # (the autouse fixture's one thread)
    with caplog.at_level(logging.WARNING, logger="medfed"):
        _loop("fedavg", participation=1.0).load_state_dict(state)
        assert not caplog.records
        _loop("fedavg", participation=1.0).load_state_dict({**state, "num_threads": 16})
    assert [r.getMessage() for r in caplog.records] == [
        "resuming with 1 torch threads, the checkpoint was written with 16: the results may differ slightly "
        "from an uninterrupted run (set trainer.num_threads to fix the count)"
    ]


def test_a_phase_codes_its_messages_before_and_after_all_local_training():
    # Sites would train at the same time: the loop sends every participant's
    # message, then trains them one by one, then sends every reply (so the
    # codecs run back to back, away from PyTorch's spinning worker threads).
    loop = _loop("pfednet", participation=0.75)
    events = []
    for site, link in zip(loop.sites, loop.links):
        def send(direction, payload, site=site, link_send=link.send):
            events.append((direction, site.index))
            return link_send(direction, payload)

        def train(*args, site=site, site_train=site.train, **kwargs):
            events.append(("train", site.index))
            return site_train(*args, **kwargs)

        link.send, site.train = send, train
    loop.fit(1)  # setup, round 0's delivery, then round 1 (events from here on)
    events.clear()
    loop.fit(2)
    taking_part = loop.participants(2)
    one_phase = [("down", i) for i in taking_part] + [("train", i) for i in taking_part] + [("up", i) for i in taking_part]
    delivery = [("down", site.index) for site in loop.sites]
    assert len(taking_part) == 3
    assert events == one_phase * len(loop.strategy.phases) + delivery


def test_a_resumed_state_has_its_floats_on_the_runs_device_and_its_counters_and_generator_states_on_the_cpu():
    from medfed.checkpoint import state_on_device

    state = {
        "models": torch.zeros(3, 4),
        "pair": (torch.ones(2, dtype=torch.float64), [torch.zeros(1)]),
        "downloads": torch.zeros(3, dtype=torch.int64),
        "generator": torch.Generator().get_state(),
        "round": 2,
    }
    moved = state_on_device(state, torch.device("meta"))  # a device other than the checkpoint's CPU, on any machine
    assert moved["models"].device.type == "meta" and moved["models"].shape == (3, 4)
    assert moved["pair"][0].device.type == "meta" and moved["pair"][0].dtype == torch.float64
    assert isinstance(moved["pair"], tuple) and moved["pair"][1][0].device.type == "meta"
    assert moved["downloads"] is state["downloads"] and moved["generator"] is state["generator"] and moved["round"] == 2


def _identical(a, b, where="state"):
    """``a`` and ``b`` are the same plain data: same container types and keys, tensors equal in dtype, shape and every bit."""
    assert type(a) is type(b), f"{where}: {type(a).__name__} vs {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert list(a) == list(b), f"{where}: keys {list(a)} vs {list(b)}"
        for key in a:
            _identical(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for index, (x, y) in enumerate(zip(a, b)):
            _identical(x, y, f"{where}[{index}]")
    else:
        assert a == b or (a != a and b != b), f"{where}: {a!r} vs {b!r}"  # (NaN equals NaN here)


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_every_half_states_its_declared_fields_and_loads_them_back_bit_for_bit(name, tmp_path):
    loop = _loop(name, participation=0.75)
    loop.fit(2)
    halves = [loop.server, *(site.strategy for site in loop.sites)]
    for half in halves:
        if type(half).state_dict is DeclaredState.state_dict:  # (not an override)
            assert list(half.state_dict()) == list(half.state_fields), type(half).__name__
    path = save_checkpoint(tmp_path, {**loop.state_dict(), "config": {}}, keep=1)
    resumed = _loop(name, participation=0.75)
    resumed.load_state_dict(read_checkpoint(path))
    _identical(resumed.server.state_dict(), loop.server.state_dict(), "server")
    for a, b in zip(resumed.sites, loop.sites):
        _identical(a.strategy.state_dict(), b.strategy.state_dict(), a.name)


def test_a_declared_state_refuses_other_fields_and_shares_no_container_with_the_half():
    from medfed.federated.strategies.base import ServerHalf

    class Half(ServerHalf):
        state_fields = ("model", "history")

    half = Half(None, None, 2, 0)
    half.model, half.history = torch.arange(3.0), [{"loss": 1.0}]
    state = half.state_dict()
    assert list(state) == ["model", "history"] and state["model"] is half.model
    half.history[0]["loss"] = 2.0
    assert state["history"] == [{"loss": 1.0}]  # a later change of the half's containers does not reach the state
    restored = Half(None, None, 2, 0)
    restored.load_state_dict(state)
    state["history"].append({"loss": 3.0})
    assert restored.history == [{"loss": 1.0}] and torch.equal(restored.model, torch.arange(3.0))
    with pytest.raises(ValueError, match=r"Half: the state holds \['model'\], the half checkpoints \['history', 'model'\]"):
        Half(None, None, 2, 0).load_state_dict({"model": torch.zeros(3)})
