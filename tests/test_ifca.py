"""IFCA: seeded initial cluster models, the cluster estimate, per-cluster averaging, planted clusters, the k = 1 limit."""

import pytest
import torch

from medfed.errors import ConfigError
from medfed.federated.link import Link
from medfed.federated.strategies import strategy_from_config
from medfed.federated.protocol import RoundContext
from medfed.federated.strategies.ifca import IFCA, cluster_initialisations
from toy_federation import one_torch_thread  # noqa: F401 (autouse fixture)
from toy_federation import BatchNormClassifier, DropoutClassifier, LinearClassifier, build_loop, seeded, two_group_federation


def _segments(model):
    """{parameter name: slice of the "all" vector}."""
    split, offset, slices = model.parameter_split, 0, {}
    for name in split.names("all"):
        slices[name] = slice(offset, offset + split.numels[name])
        offset += split.numels[name]
    return slices


def test_initial_cluster_models_perturb_each_tensor_by_its_own_spread():
    model = seeded(BatchNormClassifier, 64, 8, hidden=32)
    prototype = model.get_vector("all")
    models = cluster_initialisations(prototype, model.parameter_split, 3, seed=5, scale=0.5)
    assert models.shape == (3, prototype.numel()) and models.dtype == prototype.dtype
    assert torch.equal(models[0], prototype)
    assert torch.equal(models, cluster_initialisations(prototype, model.parameter_split, 3, seed=5, scale=0.5))  # reproducible
    assert not torch.equal(models[1:], cluster_initialisations(prototype, model.parameter_split, 3, seed=6, scale=0.5)[1:])
    for name, where in _segments(model).items():
        tensor = prototype[where].double()
        noise = (models[1:, where].double() - tensor) / (0.5 * tensor.std(unbiased=False))
        if name == "norm.weight":  # ones: a constant tensor is not perturbed
            assert torch.equal(models[1:, where], models[0:1, where].expand(2, -1))
        elif tensor.numel() >= 256:  # hidden.weight (2048), output.weight (256): standard normal noise
            assert abs(float(noise.mean())) < 0.1 and abs(float(noise.std()) - 1.0) < 0.1, name
    assert not torch.allclose(models[1], models[2])
    same = cluster_initialisations(prototype, model.parameter_split, 3, seed=5, scale=0.0)
    assert torch.equal(same, prototype.expand(3, -1))


def test_the_link_codes_a_seeded_cluster_model_against_itself():
    # Both ends know the initial cluster models, so under a lossy codec sending one costs nothing and is exact.
    model = seeded(LinearClassifier, 300, 2)
    strategy_cls, options = strategy_from_config({"name": "ifca", "ifca": {"clusters": 2}})
    strategy = strategy_cls(options, model.parameter_split, 3, seed=0)
    initial = strategy.initial_values({part: model.get_vector(part) for part in ("shared", "personal", "all", "buffers")})
    assert torch.equal(initial["cluster/0"], initial["all"]) and not torch.equal(initial["cluster/1"], initial["all"])
    lossy = Link({"name": "dense"}, {"name": "stc", "sparsity": 0.01}, strategy.coded_keys, initial, torch.device("cpu"))
    received = lossy.send("down", {"cluster/1": initial["cluster/1"]})
    assert torch.equal(received["cluster/1"], initial["cluster/1"])
    without = {key: value for key, value in initial.items() if not key.startswith("cluster/")}  # coded against "all"
    against_the_prototype = Link({"name": "dense"}, {"name": "stc", "sparsity": 0.01}, strategy.coded_keys, without, torch.device("cpu"))
    assert not torch.equal(against_the_prototype.send("down", {"cluster/1": initial["cluster/1"]})["cluster/1"], initial["cluster/1"])


def test_the_server_averages_each_cluster_by_sample_count_and_keeps_a_cluster_no_one_chose():
    model = seeded(LinearClassifier, 2, 2)  # d = 6
    strategy = IFCA(IFCA.Options(clusters=3), model.parameter_split, n_sites=4, seed=0)
    initial = strategy.initial_values({part: model.get_vector(part) for part in ("shared", "personal", "all", "buffers")})
    server = strategy.server
    server.setup(RoundContext(0, "setup"), initial, {i: {"cluster_id": torch.tensor([float(i % 2)])} for i in range(4)})
    assert server.assignment == [0, 1, 0, 1]
    untouched = server.models[2].clone()

    def reply(cluster, value, n):
        return {"cluster_id": torch.tensor([float(cluster)]), f"cluster/{cluster}": torch.full((6,), value),
                f"cluster_buffers/{cluster}": torch.zeros(0), "num_samples": torch.tensor([float(n)])}

    # site 3 skips the round; sites 0 and 2 move to / stay in cluster 1, site 1 stays in 0 ... by their own choice
    server.aggregate(RoundContext(1, "fit"), {0: reply(1, 1.0, 10), 1: reply(0, 4.0, 30), 2: reply(1, 3.0, 30)})
    torch.testing.assert_close(server.models[1], torch.full((6,), (10 * 1.0 + 30 * 3.0) / 40))
    torch.testing.assert_close(server.models[0], torch.full((6,), 4.0))
    assert torch.equal(server.models[2], untouched)  # no member: kept
    assert server.assignment == [1, 0, 1, 1]  # site 3 keeps its last choice
    assert server.metrics() == {"cluster_size/0": 1.0, "cluster_size/1": 3.0, "cluster_size/2": 0.0, "reassigned": 3.0}
    assert torch.equal(server.deliver(RoundContext(1, "deliver"), 3)["all"], server.models[1]) and torch.equal(server.deliver(RoundContext(1, "deliver"), 1)["all"], server.models[0])
    message = server.message(RoundContext(1, "fit"), 2)
    assert set(message) == {f"{key}/{j}" for key in ("cluster", "cluster_buffers") for j in range(3)}


def test_each_site_picks_the_cluster_model_with_the_lowest_loss_on_its_training_data():
    loop = build_loop("ifca", two_group_federation(n_sites=4), seeded(LinearClassifier, 4, 2), {"clusters": 3})
    loop.fit(1)
    sent = loop.server.message(RoundContext(1, "fit"), 0)
    loop.fit(2)
    for site in loop.sites:
        x, y = site.data.train.tensors
        probe = seeded(LinearClassifier, 4, 2)
        losses = []
        for j in range(3):
            probe.set_vector("all", sent[f"cluster/{j}"])
            with torch.no_grad():
                losses.append(float(torch.nn.functional.cross_entropy(probe(x), y)))
        assert loop.server.assignment[site.index] == min(range(3), key=losses.__getitem__), (site.name, losses)
    assert len(set(loop.server.assignment)) > 1  # the sites do not all agree: the choice depends on the data


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_ifca_recovers_two_planted_clusters(seed):
    federation = two_group_federation(n_sites=6, seed=seed)
    loop = build_loop("ifca", federation, seeded(LinearClassifier, 4, 2, seed=seed), seed=seed)
    loop.fit(8)
    planted = [site.info["group"] for site in federation.sites]
    chosen = loop.server.assignment
    assert planted == [0, 0, 0, 1, 1, 1] and chosen in (planted, [1 - g for g in planted]), chosen
    for site in loop.sites:  # evaluated with its cluster's model, which fits its group's rule
        assert torch.equal(site.module.get_vector("all"), loop.server.models[chosen[site.index]])
        assert loop.history[-1]["metrics"][site.name]["accuracy"] > 0.85
    fedavg = build_loop("fedavg", federation, seeded(LinearClassifier, 4, 2, seed=seed), seed=seed)
    fedavg.fit(8)
    assert loop.history[-1]["mean"]["accuracy"] > fedavg.history[-1]["mean"]["accuracy"] + 0.2


@pytest.mark.parametrize("model_cls", [BatchNormClassifier, DropoutClassifier])
def test_one_cluster_is_fedavg(model_cls):
    # One cluster: everyone picks it, trains it from the delivered model and the server averages as FedAvg does
    # (parameters and float buffers, sample-weighted); the cluster estimate draws from no generator.
    runs = {}
    for name, options in (("ifca", {"clusters": 1}), ("fedavg", None)):
        loop = build_loop(name, two_group_federation(n_sites=4), seeded(model_cls, 4, 2), options, participation=0.5)
        loop.fit(3)
        runs[name] = loop
    for a, b in zip(runs["ifca"].sites, runs["fedavg"].sites):
        for part in ("all", "buffers"):
            assert torch.equal(a.module.get_vector(part), b.module.get_vector(part)), (a.name, part)
    for a, b in zip(runs["ifca"].history, runs["fedavg"].history):
        assert a["metrics"] == b["metrics"] and a["train_loss"] == b["train_loss"]


def test_options_are_checked():
    for options, key in (({"clusters": 0}, "clusters"), ({"init_scale": -1.0}, "init_scale")):
        with pytest.raises(ConfigError, match=f"strategy.ifca.{key}"):
            strategy_from_config({"name": "ifca", "ifca": options})
