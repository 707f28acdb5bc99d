"""pFedNet's server side on hand-made replies: averaging, the network-lasso limits, the
relative penalty, the graph in its three spaces, delivery; and its phases' local steps."""

from pathlib import Path

import pytest
import torch
from torch.utils.data import TensorDataset

from medfed.config import ConfigError
from medfed.errors import DataError
from medfed.federated.strategies.solvers.fusion import between_site_spread
from medfed.federated.protocol import RoundContext
from medfed.federated.strategies.pfednet import PFedNet
from medfed.models.split import ParameterSplit
from toy_federation import one_torch_thread  # noqa: F401 (autouse fixture)
from toy_federation import LinearClassifier, build_loop, seeded, two_group_federation

D1, D2, N = 6, 5, 4
SPLIT = ParameterSplit(shared=("a",), personal=("b",), numels={"a": D1, "b": D2})


def _strategy(lam, p="2", knn_k=1, **options):
    strategy = PFedNet(PFedNet.Options(lam=lam, p=p, knn_k=knn_k, **options), SPLIT, N, seed=0).server
    # two groups of sites with distinct sketches: {0, 1} and {2, 3} lie 1 apart, sites within
    # a group 0.5 apart
    sketches = {i: {"sketch": torch.tensor([float(i >= 2), float(i >= 2), 0.5 * (i % 2)])} for i in range(N)}
    initial = {"shared": torch.zeros(D1), "personal": torch.zeros(D2), "all": torch.zeros(D1 + D2)}
    strategy.setup(RoundContext(0, "setup"), initial, sketches)
    return strategy


def _personal_replies(seed=0):
    generator = torch.Generator().manual_seed(seed)
    return {i: {"personal": torch.randn(D2, generator=generator)} for i in range(N)}


def test_graph_links_sites_with_similar_sketches():
    assert _strategy(1.0).graph.edges == [(0, 1), (2, 3)]


def test_shared_phase_is_the_sample_weighted_average():
    strategy = _strategy(1.0)
    replies = {i: {"shared": torch.full((D1,), float(i)), "num_samples": torch.tensor([float(i + 1)])} for i in range(N)}
    strategy.aggregate(RoundContext(1, "shared"), replies)
    # (1*0 + 2*1 + 3*2 + 4*3) / 10 = 2.0
    assert torch.allclose(strategy.shared, torch.full((D1,), 2.0))


def test_lambda_zero_keeps_every_sites_trained_personal_part():
    strategy = _strategy(0.0)
    replies = _personal_replies()
    strategy.aggregate(RoundContext(1, "personal"), dict(replies))
    for i in range(N):
        assert torch.equal(strategy.personal[:, i], replies[i]["personal"])


@pytest.mark.parametrize("p", ["1", "2", "inf"])
@pytest.mark.parametrize("lam, lam_scale", [(1.0, "fusion"), (1e4, "absolute")])
def test_lambda_at_the_fusion_threshold_fuses_connected_sites_to_their_mean(p, lam, lam_scale):
    strategy = _strategy(lam, p=p, lam_scale=lam_scale)
    replies = _personal_replies()
    strategy.aggregate(RoundContext(1, "personal"), dict(replies))
    for group in ([0, 1], [2, 3]):
        mean = torch.stack([replies[i]["personal"] for i in group]).mean(0)
        for i in group:
            assert torch.allclose(strategy.personal[:, i], mean, atol=1e-4)
    assert not torch.allclose(strategy.personal[:, 0], strategy.personal[:, 2], atol=1e-2)


def test_a_skipping_site_keeps_its_column_as_the_proximal_centre():
    strategy = _strategy(0.0)
    before = strategy.personal[:, 3].clone()
    replies = _personal_replies()
    del replies[3]
    strategy.aggregate(RoundContext(1, "personal"), dict(replies))
    assert torch.equal(strategy.personal[:, 3], before)


def test_delivery_sends_the_shared_part_only_to_sites_that_lack_it():
    strategy = _strategy(0.5)
    strategy.aggregate(RoundContext(1, "shared"), {0: {"shared": torch.ones(D1), "num_samples": torch.tensor([1.0])}})
    strategy.message(RoundContext(1, "personal"), 0)  # site 0 receives x_{t+1} in the personal phase
    strategy.aggregate(RoundContext(1, "personal"), {0: {"personal": torch.ones(D2)}})
    assert set(strategy.deliver(RoundContext(1, "deliver"), 0)) == {"personal"}
    assert set(strategy.deliver(RoundContext(1, "deliver"), 1)) == {"personal", "shared"}
    assert torch.equal(strategy.deliver(RoundContext(1, "deliver"), 1)["shared"], torch.ones(D1))


def test_server_state_round_trips():
    strategy = _strategy(0.5)
    strategy.aggregate(RoundContext(1, "personal"), _personal_replies())
    copy = PFedNet(PFedNet.Options(lam=0.5, knn_k=1), SPLIT, N, seed=0).server
    copy.load_state_dict(strategy.state_dict())
    replies = _personal_replies(seed=1)
    strategy.aggregate(RoundContext(1, "personal"), dict(replies))
    copy.aggregate(RoundContext(1, "personal"), dict(replies))
    assert torch.equal(copy.personal, strategy.personal)


def _spread_removed(strategy, replies):
    strategy.aggregate(RoundContext(1, "personal"), dict(replies))
    return strategy.metrics()["spread_removed"]


@pytest.mark.parametrize("p", ["1", "2", "inf"])
def test_spread_removed_grows_with_lambda_from_nothing_to_everything(p):
    replies = _personal_replies()
    removed = [_spread_removed(_strategy(lam, p=p, knn_k=2), replies) for lam in (0.0, 0.1, 0.3, 0.6, 1.0, 3.0)]
    assert removed[0] == 0.0
    # Fused up to ADMM's stopping rule (default tolerances): at lam = 1 the graph has a cycle, so the
    # exact fusion shortcut does not apply; the over-relaxed solver stops with 2e-5 of the spread
    # left (primal residual 2e-6, W = 0), the unrelaxed one stopped with 4e-6.
    assert removed[-2] == pytest.approx(1.0, abs=1e-4) and removed[-1] == pytest.approx(1.0, abs=1e-4)
    assert all(a < b for a, b in zip(removed[:4], removed[1:5])), removed


def test_spread_removed_is_measured_against_the_centre():
    strategy = _strategy(0.4, knn_k=2)
    replies = _personal_replies()
    centre = torch.stack([replies[i]["personal"] for i in range(N)], dim=1)
    strategy.aggregate(RoundContext(1, "personal"), dict(replies))
    components = [list(range(N))]
    expected = 1 - between_site_spread(strategy.personal, components) / between_site_spread(centre, components)
    assert strategy.metrics()["spread_removed"] == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("scale", [1e-3, 1.0, 1e3])
def test_relative_lambda_is_free_of_the_models_scale_and_of_eta(scale):
    replies = _personal_replies()
    scaled = {i: {"personal": scale * r["personal"]} for i, r in replies.items()}
    tight = dict(admm_abs_tol=0.0, admm_rel_tol=1e-10, admm_max_iter=20_000)  # scale-free stopping rule
    reference = _strategy(0.4, knn_k=2, server_lr=0.01, **tight)
    reference.aggregate(RoundContext(1, "personal"), dict(replies))
    other = _strategy(0.4, knn_k=2, server_lr=7.0, **tight)
    other.aggregate(RoundContext(1, "personal"), dict(scaled))
    assert torch.allclose(other.personal / scale, reference.personal, atol=1e-6)
    assert other.metrics()["spread_removed"] == pytest.approx(reference.metrics()["spread_removed"], abs=1e-5)


def test_a_small_lam_fuses_each_tight_group_and_the_log_counts_the_parts_left():
    """The audit's reading: lam = 0.1 of the fusion threshold makes the parts identical within each group of
    similar sites while spread_removed stays small; distinct_personal says so."""
    generator = torch.Generator().manual_seed(0)
    centres = torch.randn(2, D2, generator=generator) * 5.0
    replies = {i: {"personal": centres[i // 2] + 0.01 * torch.randn(D2, generator=generator)} for i in range(N)}
    strategy = _strategy(0.1, knn_k=2)  # a connected graph: the groups are linked, the threshold set by their distance
    strategy.aggregate(RoundContext(1, "personal"), dict(replies))
    metrics = strategy.metrics()
    assert metrics["distinct_personal"] == 2.0
    assert metrics["spread_removed"] < 0.2
    between = torch.linalg.vector_norm(strategy.personal[:, 0] - strategy.personal[:, 2])
    assert metrics["personal_distance_min"] < 1e-4 and metrics["personal_distance_max"] == pytest.approx(float(between), rel=1e-3)
    independent = _strategy(0.0, knn_k=2)
    independent.aggregate(RoundContext(1, "personal"), dict(replies))
    assert independent.metrics()["distinct_personal"] == 4.0


def test_graph_is_logged_edge_by_edge():
    metrics = _strategy(0.5).metrics()
    assert metrics["graph_edges"] == 2.0
    assert metrics["graph/w_0_1"] > 0 and metrics["graph/w_2_3"] > 0
    assert metrics["graph/w_0_2"] == metrics["graph/w_1_3"] == 0.0
    assert len([k for k in metrics if k.startswith("graph/w_")]) == N * (N - 1) // 2


def test_model_space_graph_is_built_from_trained_personal_parts_and_refreshed():
    strategy = _strategy(0.0, graph_space="model", graph_refresh_rounds=2)
    assert strategy.graph is None
    # sites {0, 2} and {1, 3} hold nearly the same personal parts
    base = torch.randn(D2, 2, generator=torch.Generator().manual_seed(3))
    replies = {i: {"personal": base[:, i % 2] + 0.01 * i} for i in range(N)}
    strategy.aggregate(RoundContext(1, "personal"), dict(replies))
    assert strategy.graph.edges == [(0, 2), (1, 3)] and [at for at, _ in strategy.graph_history] == [1]
    swapped = {i: {"personal": base[:, int(i >= 2)] + 0.01 * i} for i in range(N)}
    strategy.aggregate(RoundContext(1, "personal"), dict(swapped))  # round 2: not yet due
    assert strategy.graph.edges == [(0, 2), (1, 3)]
    strategy.aggregate(RoundContext(1, "personal"), dict(swapped))  # round 3: refreshed
    assert strategy.graph.edges == [(0, 1), (2, 3)] and [at for at, _ in strategy.graph_history] == [1, 3]
    figure = strategy.figures()["similarity_graph"]
    assert [axis.get_title() for axis in figure.axes] == [
        "built in round 1, used in rounds 1-2: 2 edges", "built in round 3, used from round 3 on: 2 edges",
    ]  # each graph serves the fusion of the round it is built in, then each round until the next
    restored = PFedNet(strategy.options, SPLIT, N, seed=0).server
    restored.load_state_dict(strategy.state_dict())
    assert [(at, g.edges) for at, g in restored.graph_history] == [(1, [(0, 2), (1, 3)]), (3, [(0, 1), (2, 3)])]
    assert restored.graph.edges == [(0, 1), (2, 3)]


class _Site:
    def __init__(self, dataset, name="site0", num_classes=2):
        self.data = type("Data", (), {"train": dataset})()
        self.name = name
        self._module = type("Module", (), {"num_classes": num_classes})()

    def module(self, slot):
        return self._module


def _images(n, seed, channel_scale=1.0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, 4, 4, generator=generator) * channel_scale
    y = (torch.rand(n, 4, 4, generator=generator) > 0.7).long()
    return TensorDataset(x, y)


def test_sites_send_the_sketch_of_their_space():
    site = _Site(_images(20, 0))
    data = PFedNet(PFedNet.Options(graph_space="data", kernel_features=64), SPLIT, N, seed=0).site_half(0).setup(site, RoundContext(0, "setup"))
    feature = PFedNet(PFedNet.Options(graph_space="feature"), SPLIT, N, seed=0).site_half(0).setup(site, RoundContext(0, "setup"))
    model = PFedNet(PFedNet.Options(graph_space="model"), SPLIT, N, seed=0).site_half(0).setup(site, RoundContext(0, "setup"))
    assert data["sketch"].shape == (64,) and feature["sketch"].shape == (6,) and model == {}


def test_no_sketch_from_too_few_samples():
    site = _Site(_images(5, 0), name="site3")
    with pytest.raises(DataError, match="site3: only 5 training samples.*min_sketch_samples = 16"):
        PFedNet(PFedNet.Options(), SPLIT, N, seed=0).site_half(0).setup(site, RoundContext(0, "setup"))


@pytest.mark.parametrize(
    "key, value", [("graph_space", "pixels"), ("knn_rule", "any"), ("edge_weights", "cosine"), ("lam_scale", "relative")]
)
def test_unknown_choices_are_refused_by_name(key, value):
    with pytest.raises(ConfigError, match=f"'{key}'"):
        PFedNet.Options(**{key: value})


@pytest.mark.parametrize("full_epoch_per_phase", [False, True])
def test_phases_share_a_rounds_local_steps_unless_each_gets_a_full_epoch(full_epoch_per_phase):
    # site s has 48 + 8 s training samples: with batches of 16, site 1 has B = 4 batches, site 3 B = 5 and site 5 B = 6
    federation = two_group_federation(n_sites=6)
    loop = build_loop(
        "pfednet", federation, seeded(LinearClassifier, 4, 2), {"schedule": "alternating", "full_epoch_per_phase": full_epoch_per_phase}, batch_size=16
    )
    steps = {}
    for site in loop.sites:
        site_loss = site.strategy.loss

        def counting_loss(site, ctx, plan, batch, site_loss=site_loss):
            steps[(site.index, plan.part)] = steps.get((site.index, plan.part), 0) + 1
            return site_loss(site, ctx, plan, batch)

        site.strategy.loss = counting_loss
    loop.fit(1)
    for site in loop.sites:
        batches = site.batches_per_epoch
        if full_epoch_per_phase:
            assert steps[(site.index, "shared")] == steps[(site.index, "personal")] == batches
        else:  # half each, the first half rounded up: together one epoch, as a FedAvg round
            assert steps[(site.index, "shared")] == (batches + 1) // 2
            assert steps[(site.index, "shared")] + steps[(site.index, "personal")] == batches
    assert {loop.sites[3].batches_per_epoch, loop.sites[5].batches_per_epoch} == {5, 6}


def _site_models(loop):
    return [torch.cat([p.detach().reshape(-1) for p in site.module.parameters()]) for site in loop.sites]


def test_joint_schedule_trains_the_whole_model_for_the_budget_in_one_phase():
    federation = two_group_federation(n_sites=3, n_train=37)
    loop = build_loop("pfednet", federation, seeded(LinearClassifier, 4, 2), {"schedule": "joint"}, batch_size=8, local_epochs=2)
    assert loop.strategy.phases == ("joint",) and PFedNet.phases == ("shared", "personal")
    loop.fit(2)
    for record in loop.history:
        for site in loop.sites:  # one plan over the whole model: two whole passes, nothing else trained
            assert record["compute"][site.name] == {"train/joint/model": 2.0, "evaluation": 48 / site.n_train}


def test_joint_schedule_at_lambda_zero_is_fedper_and_alternating_is_not():
    """With lam = 0 the network lasso is the identity: joint pFedNet trains, averages and keeps what FedPer does;
    with lam > 0 the first round's shared part is still FedPer's (the lasso acts on z only) and the personal parts move."""
    def run(strategy, options=None):
        loop = build_loop(strategy, two_group_federation(n_sites=4), seeded(LinearClassifier, 4, 2), options, batch_size=16)
        loop.fit(3 if options is None or options.get("lam", 0.1) == 0 else 1)
        return loop

    fedper = _site_models(run("fedper"))
    joint = _site_models(run("pfednet", {"schedule": "joint", "lam": 0.0, "graph_space": "model"}))
    alternating = _site_models(run("pfednet", {"schedule": "alternating", "lam": 0.0, "graph_space": "model"}))
    for a, b in zip(joint, fedper):
        assert torch.allclose(a, b, atol=1e-6)
    assert not all(torch.allclose(a, b, atol=1e-3) for a, b in zip(alternating, fedper))

    fedper_one = build_loop("fedper", two_group_federation(n_sites=4), seeded(LinearClassifier, 4, 2), batch_size=16)
    fedper_one.fit(1)
    fused = run("pfednet", {"schedule": "joint", "lam": 1.0, "graph_space": "model", "knn_k": 3})
    weight, bias = slice(0, 8), slice(8, 10)  # LinearClassifier(4, 2): the weight is shared, the bias personal
    for a, b in zip(_site_models(fused), _site_models(fedper_one)):
        assert torch.allclose(a[weight], b[weight], atol=1e-6)
    biases = [model[bias] for model in _site_models(fused)]
    assert all(torch.allclose(b, biases[0], atol=1e-4) for b in biases)  # lam = 1 on a connected graph: z fused to its mean
    assert not all(torch.allclose(a[bias], b[bias], atol=1e-3) for a, b in zip(_site_models(fused), _site_models(fedper_one)))


def test_the_schedule_is_joint_at_the_equal_budget_and_alternating_in_the_published_protocol():
    assert (PFedNet.Options().schedule, PFedNet.Options().full_epoch_per_phase) == ("joint", False)
    published = PFedNet.Options(preset="published")
    assert (published.schedule, published.full_epoch_per_phase) == ("alternating", True)
    assert PFedNet.Options(full_epoch_per_phase=True).schedule == "alternating"  # a full epoch per phase needs phases
    assert (PFedNet.Options(schedule="alternating").full_epoch_per_phase, PFedNet.Options(schedule="joint", preset="published").schedule) == (
        False, "joint",
    )


def test_joint_schedule_refuses_a_full_epoch_per_phase():
    with pytest.raises(ConfigError, match="'full_epoch_per_phase'"):
        PFedNet.Options(schedule="joint", full_epoch_per_phase=True)
    assert PFedNet.Options(schedule="joint", preset="published").full_epoch_per_phase is False
    with pytest.raises(ConfigError, match="'schedule'"):
        PFedNet.Options(schedule="both")


def test_personal_parts_whose_differences_overflow_end_the_run_in_one_line_not_in_the_solver():
    # (issue 32, item 8: model.lr=1e30 ended in the solver's "lam: expected a finite number" ValueError traceback)
    from medfed.errors import RunFailed

    strategy = _strategy(0.5)
    replies = {i: {"personal": torch.full((D2,), 3e38 * (-1) ** i)} for i in range(N)}  # finite, as the link lets through
    with pytest.raises(RunFailed, match=r"^pfednet's server step after 1 personal steps: the sites' personal parts differ beyond "
                                        r"what torch\.float32 holds \(fusion threshold inf, so lam_t = inf\): their training "
                                        r"diverged; lower model\.lr$"):
        strategy.aggregate(RoundContext(1, "personal"), replies)


def test_a_learning_rate_of_1e30_is_refused_with_the_config(tmp_path, capsys):
    from medfed.cli import main

    config = Path(__file__).resolve().parents[1] / "configs" / "clinical_delta1.yaml"
    assert main(["fit", "--config", str(config), "--quiet", "model.lr=1e30", f"output_dir={tmp_path / 'run'}"]) == 2
    assert capsys.readouterr().err == "medfed: error: config key 'model.lr' = 1e+30: expected a learning rate > 0 and at most 10\n"
