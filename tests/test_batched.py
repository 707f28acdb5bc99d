"""The batched executor (medfed.federated.batched): its functional optimisers, and every strategy under both executors."""

import copy
import json
import math

import pytest
import torch
from torch import nn

from medfed.cli import main
from medfed.config import TrainerConfig
from medfed.errors import ConfigError
from medfed.federated.stacked_optimizers import adam_step, hyper_parameters, sgd_step
from medfed.federated.sites import executor_for
from medfed.federated.strategies import registered
from medfed.federated.protocol import TrainingPlan
from medfed.federated.strategies.base import SiteHalf, Strategy
from medfed.models.dropout import dropout
from medfed.options.strategies import strategy_spec
from test_classification_end_to_end import TINY_CLINICAL
from toy_federation import one_torch_thread  # noqa: F401 (autouse fixture)
from toy_federation import NEEDS_A_BODY, BatchNormClassifier, BodyHeadClassifier, LinearClassifier, build_loop, seeded, two_group_federation

STRATEGIES = registered()

#: at least this many registered strategies train stacked (issue 21's acceptance)
MIN_BATCHABLE = 15


# ------------------------------------------------------------------------------------------- functional optimisers
def _torch_and_stacked(optimizer_cls, options_per_site, steps_per_site, shape=(3, 4), seed=0):
    """Each site's parameter stepped by torch.optim (its own options and number of steps) and by the stacked step.

    Returns (torch's parameters, torch's optimisers, the stacked parameter, the stacked state).
    """
    generator = torch.Generator().manual_seed(seed)
    sites = len(options_per_site)
    start = torch.randn(sites, *shape, generator=generator)
    grads = torch.randn(max(steps_per_site), sites, *shape, generator=generator)
    params = [nn.Parameter(start[i].clone()) for i in range(sites)]
    optimizers = [optimizer_cls([p], **options) for p, options in zip(params, options_per_site)]
    for i, (p, optimizer) in enumerate(zip(params, optimizers)):
        for t in range(steps_per_site[i]):
            p.grad = grads[t, i] + 0.1 * p.detach()  # a gradient that depends on the parameter, as a loss's does
            optimizer.step()
    # the stacked run: the same sites, fresh optimisers (for the options), the sites that still have steps at each t
    twins = [nn.Parameter(start[i].clone()) for i in range(sites)]
    twin_optimizers = [optimizer_cls([p], **options) for p, options in zip(twins, options_per_site)]
    hyper = hyper_parameters(twin_optimizers, twins, torch.device("cpu"))
    stacked = start.clone()
    if optimizer_cls is torch.optim.Adam:
        step_fn = adam_step
        state = {"step": torch.zeros(sites, dtype=torch.float64), "exp_avg": torch.zeros_like(stacked), "exp_avg_sq": torch.zeros_like(stacked)}
    else:
        step_fn = sgd_step
        state = {"momentum_buffer": torch.zeros_like(stacked), "has_buffer": torch.zeros(sites, dtype=torch.bool)} if "momentum" in hyper else {}
    for t in range(max(steps_per_site)):
        rows = torch.tensor([i for i in range(sites) if t < steps_per_site[i]])
        sub_state = {key: value[rows] for key, value in state.items()}
        grad = grads[t, rows] + 0.1 * stacked[rows]
        new, sub_state = step_fn(stacked[rows], grad, sub_state, {key: value[rows] for key, value in hyper.items()})
        stacked[rows] = new
        for key, value in sub_state.items():
            state[key][rows] = value
    return params, optimizers, stacked, state


def test_stacked_adam_is_torch_adam_per_site():
    options = [
        {"lr": 0.01},
        {"lr": 0.1, "betas": (0.8, 0.99), "eps": 1e-6},
        {"lr": 0.05, "weight_decay": 0.1},
    ]
    steps = [7, 4, 6]  # each site its own number of steps: its own step count in the bias corrections
    params, optimizers, stacked, state = _torch_and_stacked(torch.optim.Adam, options, steps)
    for i, (p, optimizer) in enumerate(zip(params, optimizers)):
        torch.testing.assert_close(stacked[i], p.detach(), rtol=1e-5, atol=1e-6)
        own = optimizer.state[p]
        assert float(own["step"]) == steps[i] == float(state["step"][i])
        torch.testing.assert_close(state["exp_avg"][i], own["exp_avg"], rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(state["exp_avg_sq"][i], own["exp_avg_sq"], rtol=1e-5, atol=1e-9)
    assert not torch.allclose(stacked[0], stacked[1])  # the sites did not all take one site's options


def test_stacked_sgd_is_torch_sgd_per_site():
    options = [
        {"lr": 0.1, "momentum": 0.9},
        {"lr": 0.05, "momentum": 0.5, "dampening": 0.3, "weight_decay": 0.01},
        {"lr": 0.02, "momentum": 0.9, "nesterov": True},
    ]
    steps = [5, 3, 4]
    params, optimizers, stacked, state = _torch_and_stacked(torch.optim.SGD, options, steps)
    for i, (p, optimizer) in enumerate(zip(params, optimizers)):
        torch.testing.assert_close(stacked[i], p.detach(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(state["momentum_buffer"][i], optimizer.state[p]["momentum_buffer"], rtol=1e-5, atol=1e-6)


def test_stacked_plain_sgd_keeps_no_state():
    params, optimizers, stacked, state = _torch_and_stacked(torch.optim.SGD, [{"lr": 0.1}, {"lr": 0.3}], [2, 3])
    assert state == {} and all(not optimizer.state for optimizer in optimizers)
    for i, p in enumerate(params):
        torch.testing.assert_close(stacked[i], p.detach(), rtol=1e-6, atol=1e-7)


def test_executor_auto_is_batched_on_cuda_only_and_never_with_dp(caplog):
    assert executor_for("auto", torch.device("cpu"), False).name == "sequential"
    assert executor_for("auto", torch.device("cuda"), False).name == "batched"
    assert executor_for("batched", torch.device("cpu"), False).name == "batched"
    assert executor_for("sequential", torch.device("cuda"), False).name == "sequential"
    assert not caplog.records
    assert executor_for("batched", torch.device("cpu"), True).name == "sequential"
    (note,) = caplog.records  # one line saying why
    assert "DP-SGD" in note.getMessage() and "sequentially" in note.getMessage()


# ------------------------------------------------------------------------------------------- every strategy
class KeyedDropoutClassifier(LinearClassifier):
    """Softmax regression with medfed's keyed dropout (p = 0.5) on its inputs, trained by Adam with weight decay."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(dropout(x, 0.5, self.training))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=0.05, weight_decay=1e-3)


class KeyedDropoutBodyHeadClassifier(BodyHeadClassifier):
    """A body under a head (FedBABU), keyed dropout on the features, Adam with weight decay."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(dropout(self.features(x), 0.5, self.training))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=0.05, weight_decay=1e-3)


def _run(name: str, executor: str, rounds: int = 2, participation: float = 1.0):
    """``rounds`` rounds of ``name`` on four toy sites of 44, 52, 60, 68 samples (batch 16: 3 to 5 steps, last batches
    of 12 or 4), dropout on, under ``executor``."""
    model = KeyedDropoutBodyHeadClassifier if name in NEEDS_A_BODY else KeyedDropoutClassifier
    federation = two_group_federation(n_sites=4, n_train=44)
    loop = build_loop(name, federation, seeded(model, 4, 2), strategy_spec(name).smoke, participation=participation)
    loop.sites.executor = executor_for(executor, torch.device("cpu"), dp_sgd=False)
    loop.fit(rounds)
    return loop


def _assert_close_states(a, b, where):
    """Two nested states (dicts, lists, tensors, numbers) equal up to float tolerance."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.shape == b.shape and a.dtype == b.dtype, where
        if a.is_floating_point():
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=lambda m: f"{where}: {m}")
        else:
            assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert set(a) == set(b), f"{where}: keys {sorted(a)} != {sorted(b)}"
        for key in a:
            _assert_close_states(a[key], b[key], f"{where}/{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_close_states(x, y, f"{where}[{i}]")
    elif isinstance(a, float):
        assert math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-5) or (math.isnan(a) and math.isnan(b)), f"{where}: {a} != {b}"
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def test_enough_strategies_are_batchable():
    batchable = sorted(name for name, strategy in STRATEGIES.items() if strategy.Site.batchable is None)
    assert len(batchable) >= MIN_BATCHABLE, batchable


def _assert_alike(sequential, stacked):
    """Two runs' sites hold the same models, optimiser states, half states and data orders; their records agree."""
    for a, b in zip(sequential.sites, stacked.sites):
        for slot in a.slots:
            _assert_close_states(a.slot(slot).module.state_dict(), b.slot(slot).module.state_dict(), f"{a.name}/{slot}/module")
            _assert_close_states(a.slot(slot).optimizer.state_dict(), b.slot(slot).optimizer.state_dict(), f"{a.name}/{slot}/optimizer")
        _assert_close_states(a.strategy.state_dict(), b.strategy.state_dict(), f"{a.name}/strategy")
        assert a.orders.generator.get_state().equal(b.orders.generator.get_state())  # the same batches were drawn
    for record_a, record_b in zip(sequential.history, stacked.history):
        for key in ("participants", "metrics", "train_loss", "adapt_loss", "compute", "failures"):
            _assert_close_states(copy.deepcopy(record_a[key]), copy.deepcopy(record_b[key]), f"round {record_a['round']}/{key}")


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_both_executors_train_every_site_alike(name):
    reason = STRATEGIES[name].Site.batchable
    if reason is not None:
        assert isinstance(reason, str) and reason.strip(), f"{name}: batchable must say why not"
        pytest.skip(f"{name} is not batchable: {reason}")
    sequential, stacked = _run(name, "sequential"), _run(name, "batched")
    assert stacked.sites.executor.sequential_plans == {}, "every plan trained stacked"  # else the equality proves nothing
    _assert_alike(sequential, stacked)


@pytest.mark.parametrize("name", ["fedavg", "ditto", "pfednet"])
def test_sites_that_skip_rounds_train_alike(name):
    sequential, stacked = _run(name, "sequential", rounds=3, participation=0.5), _run(name, "batched", rounds=3, participation=0.5)
    assert stacked.sites.executor.sequential_plans == {}
    assert len({tuple(record["participants"]) for record in stacked.history}) > 1  # the stacked groups changed
    _assert_alike(sequential, stacked)


class KeyedDropoutBatchNormClassifier(BatchNormClassifier):
    """A hidden layer with BatchNorm (running statistics: per-site buffers), keyed dropout, SGD with momentum."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.output(dropout(torch.relu(self.norm(self.hidden(x))), 0.5, self.training))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


@pytest.mark.parametrize("name", ["fedbn", "fedavg"])
def test_batchnorm_statistics_and_momentum_stay_per_site(name):
    runs = {}
    for executor in ("sequential", "batched"):
        loop = build_loop(name, two_group_federation(n_sites=4, n_train=44), seeded(KeyedDropoutBatchNormClassifier, 4, 2))
        loop.sites.executor = executor_for(executor, torch.device("cpu"), dp_sgd=False)
        loop.fit(2)
        runs[executor] = loop
    assert runs["batched"].sites.executor.sequential_plans == {}
    means = []
    for a, b in zip(runs["sequential"].sites, runs["batched"].sites):
        _assert_close_states(a.module.state_dict(), b.module.state_dict(), f"{a.name}/module")
        _assert_close_states(a.slot("model").optimizer.state_dict(), b.slot("model").optimizer.state_dict(), f"{a.name}/optimizer")
        assert int(b.module.state_dict()["norm.num_batches_tracked"]) == 2 * a.batches_per_epoch  # each site its own steps
        means.append(b.module.state_dict()["norm.running_mean"])
    if name == "fedbn":  # the statistics stay each site's own (FedAvg averages them)
        assert not torch.allclose(means[0], means[-1])


class PoisonedSite(STRATEGIES["fedavg"].Site):
    """FedAvg's site half whose loss is scaled by a declared per-site tensor: NaN at site 2 (its loss becomes NaN)."""

    loss_state = ("scale",)

    def receive(self, site, ctx, payload):
        super().receive(site, ctx, payload)
        self.scale = torch.tensor(math.nan if self.index == 2 else 1.0 + self.index)

    def loss(self, site, ctx, plan, batch):
        return self.scale * super().loss(site, ctx, plan, batch)


class Poisoned(STRATEGIES["fedavg"]):
    Site = PoisonedSite


def test_a_site_whose_stacked_loss_is_not_finite_fails_alone():
    runs = {}
    for executor in ("sequential", "batched"):
        loop = build_loop(Poisoned, two_group_federation(n_sites=4, n_train=44), seeded(KeyedDropoutClassifier, 4, 2))
        loop.sites.executor = executor_for(executor, torch.device("cpu"), dp_sgd=False)
        loop.fit(1)
        runs[executor] = loop
    assert runs["batched"].sites.executor.sequential_plans == {}
    for loop in runs.values():
        (failure,) = loop.history[0]["failures"]
        assert failure["site"] == "site2" and "FloatingPointError" in failure["reason"]
        assert set(loop.history[0]["train_loss"]) == {"site0", "site1", "site3"}
    for a, b in zip(runs["sequential"].sites, runs["batched"].sites):  # the others trained alike, the scale theirs
        _assert_close_states(a.module.state_dict(), b.module.state_dict(), f"{a.name}/module")
    _assert_close_states(runs["sequential"].history[0]["train_loss"], runs["batched"].history[0]["train_loss"], "train_loss")


class RandomLossSite(STRATEGIES["fedavg"].Site):
    """FedAvg's site half whose loss draws from torch's global generator (not batchable: vmap refuses the draw)."""

    def loss(self, site, ctx, plan, batch):
        return super().loss(site, ctx, plan, batch) * (1.0 + 0.1 * torch.rand(()))


class RandomLoss(STRATEGIES["fedavg"]):
    Site = RandomLossSite


def test_a_stacked_step_that_raises_trains_its_sites_one_by_one_alike():
    runs = {}
    for executor in ("sequential", "batched"):
        loop = build_loop(RandomLoss, two_group_federation(n_sites=4, n_train=44), seeded(KeyedDropoutClassifier, 4, 2))
        loop.sites.executor = executor_for(executor, torch.device("cpu"), dp_sgd=False)
        loop.fit(2)
        runs[executor] = loop
    (reason,) = runs["batched"].sites.executor.sequential_plans.values()
    assert "stacked step raised" in reason and "random" in reason
    assert runs["batched"].sites.record()["sequential_plans"] == runs["batched"].sites.executor.sequential_plans
    for a, b in zip(runs["sequential"].sites, runs["batched"].sites):  # the fallback drew what sequential draws
        assert torch.equal(a.module.get_vector("all"), b.module.get_vector("all"))
        _assert_close_states(a.slot("model").optimizer.state_dict(), b.slot("model").optimizer.state_dict(), a.name)
    assert runs["sequential"].history[-1]["metrics"] == runs["batched"].history[-1]["metrics"]


def test_the_executor_option_is_checked_with_the_trainer_options():
    assert TrainerConfig().executor == "auto"
    for executor in ("auto", "sequential", "batched"):
        assert TrainerConfig(executor=executor).executor == executor
    with pytest.raises(ConfigError, match="trainer.executor.*'vmap'.*auto, sequential, batched"):
        TrainerConfig(executor="vmap")


class TwoModelSite(SiteHalf):
    """Trains the ``model`` slot on the logits of ``model(x) + extra(x) / 2``, ``extra`` stepped by its own optimiser."""

    def plan(self, ctx):
        return (TrainingPlan(slot="model", also_steps=("extra",)),)

    def loss(self, site, ctx, plan, batch):
        x, y = batch
        return nn.functional.cross_entropy(site.module("model")(x) + 0.5 * site.module("extra")(x), y)


class TwoModels(Strategy):
    name = "two_models"
    slots = ("model", "extra")
    Site = TwoModelSite


def test_also_steps_slots_are_stepped_by_their_own_optimisers_alike():
    runs = {}
    for executor in ("sequential", "batched"):
        loop = build_loop(TwoModels, two_group_federation(n_sites=4, n_train=44), seeded(KeyedDropoutClassifier, 4, 2))
        loop.sites.executor = executor_for(executor, torch.device("cpu"), dp_sgd=False)
        loop.fit(2)
        runs[executor] = loop
    assert runs["batched"].sites.executor.sequential_plans == {}
    for a, b in zip(runs["sequential"].sites, runs["batched"].sites):
        for slot in ("model", "extra"):
            _assert_close_states(a.slot(slot).module.state_dict(), b.slot(slot).module.state_dict(), f"{a.name}/{slot}")
            _assert_close_states(a.slot(slot).optimizer.state_dict(), b.slot(slot).optimizer.state_dict(), f"{a.name}/{slot}/optimizer")
        assert float(b.slot("extra").optimizer.state_dict()["state"][0]["step"]) == 2 * a.batches_per_epoch


def test_a_cli_run_records_its_executor_and_both_give_its_numbers(tmp_path):
    results = {}
    for executor in ("sequential", "batched"):
        config = tmp_path / f"{executor}.yaml"
        config.write_text(TINY_CLINICAL.format(data=tmp_path / "data", output=tmp_path / executor))
        assert main(["fit", "--config", str(config), "--quiet", "strategy.name=fedprox", f"trainer.executor={executor}"]) == 0
        results[executor] = json.loads((tmp_path / executor / "results.json").read_text())
    assert results["sequential"]["executor"] == {"name": "sequential"}
    assert results["batched"]["executor"] == {"name": "batched", "sequential_plans": {}}
    assert results["batched"]["config"]["trainer"]["executor"] == "batched"
    for a, b in zip(results["sequential"]["history"], results["batched"]["history"]):
        _assert_close_states(a["metrics"], b["metrics"], f"round {a['round']} metrics")
        _assert_close_states(a["train_loss"], b["train_loss"], f"round {a['round']} train_loss")
        assert a["compute"] == b["compute"]
        assert set(a["timing"]) == set(b["timing"])


def test_stacked_evaluation_gives_each_site_its_own_metrics_over_ragged_test_splits():
    from torch.utils.data import TensorDataset

    from medfed.data.federation import Federation, SiteData
    from medfed.federated.stacked_evaluation import evaluate_group
    from medfed.models.segmentation import UNetSegmenter
    from medfed.options.models import UNetOptions

    generator = torch.Generator().manual_seed(0)

    def split(n):
        return TensorDataset(torch.randn(n, 4, 16, 16, generator=generator), torch.randint(0, 2, (n, 16, 16), generator=generator))

    federation = Federation("brats", [SiteData(f"site{i}", split(8), split(n)) for i, n in enumerate((5, 9, 13))], (4, 16, 16), 2, "GENERATED", generated=True)
    loop = build_loop("local", federation, seeded(UNetSegmenter, 4, 2, UNetOptions(channels=[4, 8], strides=[2], num_res_units=1)), batch_size=2)
    loop.fit(1)  # every site its own model (local training)
    counted = []
    stacked = evaluate_group(list(loop.sites), lambda site, batch: counted.append((site.name, len(batch[0]))))
    assert sorted(counted) == sorted([("site0", 5), ("site1", 8), ("site1", 1), ("site2", 8), ("site2", 5)])  # eval batch 2 x 4
    for site, metrics in zip(loop.sites, stacked):
        alone = site.evaluate()
        assert metrics.keys() == alone.keys()
        for name, value in alone.items():
            assert math.isclose(metrics[name], value, rel_tol=1e-6, abs_tol=1e-7), (site.name, name)
    assert stacked[0] != stacked[1]  # each its own model and split


def test_a_loss_that_becomes_nan_at_step_3_names_the_step_under_the_batched_executor_too():
    # (issue 32, item 8: the batched executor's message named the round, not the step, as the sequential one does)
    from medfed.errors import SiteFailure

    loop = build_loop("fedavg", two_group_federation(n_sites=2, n_train=96), seeded(LinearClassifier, 4, 2), on_site_failure="stop")
    loop.sites.executor = executor_for("batched", torch.device("cpu"), dp_sgd=False)
    half = loop.sites[0].strategy  # the template whose loss the stacked step runs
    calls = {}

    def loss(view, ctx, plan, batch, honest=half.loss):
        calls[ctx.round] = calls.get(ctx.round, 0) + 1
        value = honest(view, ctx, plan, batch)
        return value * float("nan") if ctx.round == 2 and calls[ctx.round] >= 3 else value

    half.loss = loss
    loop.fit(1)
    steps = loop.sites[0].batches_per_epoch
    with pytest.raises(
        SiteFailure,
        match=rf"^site site0 failed in round 2 \(fit phase\): FloatingPointError: site0: training loss became nan at step 3 of {steps} ",
    ):
        loop.fit(2)
    assert loop.sites.executor.sequential_plans == {}  # the stacked step trained it
