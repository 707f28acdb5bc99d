"""The compiled static-shape stacked step (medfed.federated.stacked): padded batches, the capturable optimiser, every
batchable strategy compiled against the sequential executor."""

import pytest
import torch
from torch import nn

import medfed.federated.stacked as stacked
from medfed.federated.sites import executor_for
from medfed.federated.stacked_optimizers import adam_step, sgd_step
from medfed.federated.strategies import registered
from medfed.models.classification import NoduleClassifier
from medfed.models.padding import can_pad, pad_to, real_samples
from medfed.models.segmentation import UNetSegmenter
from medfed.models.tabular import LogisticRegression
from medfed.options.models import DenseNetOptions, LogisticRegressionOptions, UNetOptions
from test_batched import KeyedDropoutBatchNormClassifier, KeyedDropoutBodyHeadClassifier, KeyedDropoutClassifier, Poisoned, _assert_alike, _assert_close_states, _run
from medfed.options.strategies import strategy_spec
from toy_federation import one_torch_thread  # noqa: F401 (autouse fixture)
from toy_federation import NEEDS_A_BODY, build_loop, seeded, two_group_federation


@pytest.fixture
def traced(monkeypatch):
    """Compiled steps traced by torch.compile with its ``eager`` backend: dynamo captures the same graphs, no code is generated."""
    monkeypatch.setattr(stacked, "COMPILE_BACKEND", "eager")
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


# ------------------------------------------------------------------------------------------- padded batches
def _segmentation_batch(generator, n=5, classes=2, side=16):
    x = torch.randn(n, 4, side, side, generator=generator)
    return x, torch.randint(0, classes, (n, side, side), generator=generator)


@pytest.mark.parametrize("regions", ["wt", "brats"])
def test_a_padded_unet_batch_has_the_loss_and_gradients_of_the_real_samples(regions):
    generator = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    model = UNetSegmenter(4, 2 if regions == "wt" else 3, UNetOptions(channels=[4, 8], strides=[2], num_res_units=0), regions=regions)
    x, labels = _segmentation_batch(generator)
    y = labels if regions == "wt" else torch.stack([labels, labels, 1 - labels], dim=1).to(torch.uint8)
    unpadded = model.training_step((x, y), 0)
    (expected,) = torch.autograd.grad(unpadded, [model.unet.model[0].conv.weight])
    padded = (pad_to(x, 8), pad_to(y, 8))
    with real_samples(torch.arange(8) < 5):
        loss = model.training_step(padded, 0)
    (gradient,) = torch.autograd.grad(loss, [model.unet.model[0].conv.weight])
    torch.testing.assert_close(loss, unpadded, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(gradient, expected, rtol=1e-5, atol=1e-7)
    assert can_pad(model)
    with real_samples(torch.ones(8, dtype=torch.bool)):  # counting the padded copies as real changes the loss
        assert not torch.isclose(model.training_step(padded, 0), unpadded)


def test_a_padded_sample_gets_no_gradient_in_the_classifier_and_batchnorm_models_are_never_padded():
    torch.manual_seed(0)
    model = LogisticRegression(3, 2, LogisticRegressionOptions(class_weight="balanced"))
    model.class_weights = (0.75, 1.5)
    x = torch.randn(4, 3, requires_grad=True)
    y = torch.tensor([0, 1, 1, 0])
    with real_samples(torch.tensor([True, True, False, False])):
        loss = model.training_step((x, y), 0)
    (gradient,) = torch.autograd.grad(loss, [x])
    assert torch.all(gradient[2:] == 0) and torch.all(gradient[:2] != 0)
    torch.testing.assert_close(loss, model.training_step((x[:2], y[:2]), 0))
    assert can_pad(model)
    assert not can_pad(NoduleClassifier(1, 2, DenseNetOptions()))  # its BatchNorm would see the padded samples


def test_padding_repeats_real_samples():
    x = torch.arange(3.0)
    assert pad_to(x, 7).tolist() == [0.0, 1.0, 2.0, 0.0, 1.0, 2.0, 0.0]
    assert pad_to(x, 3) is x


# ------------------------------------------------------------------------------------------- the capturable optimiser
@pytest.mark.parametrize("step_fn", [adam_step, sgd_step])
def test_a_masked_step_leaves_the_inactive_rows_as_they_were(step_fn):
    generator = torch.Generator().manual_seed(1)
    param, grad = torch.randn(3, 5, generator=generator), torch.randn(3, 5, generator=generator)
    hyper = {"lr": torch.full((3,), 0.1, dtype=torch.float64)}
    if step_fn is adam_step:
        hyper |= {"beta1": torch.full((3,), 0.9, dtype=torch.float64), "beta2": torch.full((3,), 0.999, dtype=torch.float64), "eps": torch.full((3,), 1e-8, dtype=torch.float64)}
        state = {"step": torch.tensor([0.0, 4.0, 2.0], dtype=torch.float64), "exp_avg": torch.randn(3, 5, generator=generator), "exp_avg_sq": torch.rand(3, 5, generator=generator)}
    else:
        hyper |= {"dampening": torch.zeros(3, dtype=torch.float64), "nesterov": torch.zeros(3, dtype=torch.float64), "momentum": torch.full((3,), 0.9, dtype=torch.float64)}
        state = {"momentum_buffer": torch.randn(3, 5, generator=generator), "has_buffer": torch.tensor([False, True, True])}
    active = torch.tensor([True, False, True])
    new, new_state = stacked.masked(step_fn)(param, grad, state, hyper, active)
    full, full_state = step_fn(param, grad, state, hyper)
    for rows, (a, b) in (([0, 2], (new, full)), ([1], (new, param))):
        assert torch.equal(a[rows], b[rows])
    for key in state:
        assert torch.equal(new_state[key][[0, 2]], full_state[key][[0, 2]]) and torch.equal(new_state[key][1], state[key][1]), key


# ------------------------------------------------------------------------------------------- the compiled step
def _compiled_run(name, rounds=2, model=None, strategy=None):
    """``rounds`` rounds of ``name`` on the four ragged toy sites of test_batched (44..68 samples, batch 16), compiled."""
    model = model or (KeyedDropoutBodyHeadClassifier if name in NEEDS_A_BODY else KeyedDropoutClassifier)
    loop = build_loop(strategy or name, two_group_federation(n_sites=4, n_train=44), seeded(model, 4, 2), strategy_spec(name).smoke)
    loop.sites.executor = executor_for("batched", torch.device("cpu"), dp_sgd=False, compile=True)
    loop.fit(rounds)
    return loop


def _compiled_steps(loop):
    return [step for _, step in loop.sites.executor.compiled.values()]


BATCHABLE = sorted(name for name, strategy in registered().items() if strategy.Site.batchable is None)


@pytest.mark.parametrize("name", ["fedprox", "apfl"])  # a proximal loss state; a functional_call inside the stacked one
def test_the_compiled_step_trains_ragged_sites_as_the_sequential_executor(name, traced):
    compiled, sequential = _compiled_run(name), _run(name, "sequential")
    assert compiled.sites.executor.sequential_plans == {}
    steps = _compiled_steps(compiled)
    assert steps and all(step.pads and step.not_compiled is None for step in steps)  # padded, compiled: else nothing is shown
    _assert_alike(sequential, compiled)


@pytest.mark.slow
@pytest.mark.parametrize("name", BATCHABLE)
def test_every_batchable_strategy_compiled_trains_as_the_sequential_executor(name, traced):
    compiled, sequential = _compiled_run(name), _run(name, "sequential")
    assert compiled.sites.executor.sequential_plans == {}
    assert all(step.not_compiled is None for step in _compiled_steps(compiled))
    _assert_alike(sequential, compiled)


def test_one_graph_serves_every_round(traced):
    torch._dynamo.utils.counters.clear()
    loop = _compiled_run("fedprox", rounds=3)
    assert len(_compiled_steps(loop)) == 1
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1  # padded: one shape; no recompilation from round to round


def test_batchnorm_models_run_one_call_per_batch_shape_with_their_statistics_per_site(traced):
    compiled = _compiled_run("fedbn", model=KeyedDropoutBatchNormClassifier)
    sequential = build_loop("fedbn", two_group_federation(n_sites=4, n_train=44), seeded(KeyedDropoutBatchNormClassifier, 4, 2))
    sequential.fit(2)
    (step,) = _compiled_steps(compiled)
    assert not step.pads and step.not_compiled is None
    for a, b in zip(sequential.sites, compiled.sites):
        _assert_close_states(a.module.state_dict(), b.module.state_dict(), f"{a.name}/module")
        _assert_close_states(a.slot("model").optimizer.state_dict(), b.slot("model").optimizer.state_dict(), f"{a.name}/optimizer")
        assert int(b.module.state_dict()["norm.num_batches_tracked"]) == 2 * a.batches_per_epoch


def test_a_site_whose_compiled_loss_is_not_finite_fails_alone(traced):
    compiled = _compiled_run("fedavg", rounds=1, strategy=Poisoned)
    (failure,) = compiled.history[0]["failures"]
    assert failure["site"] == "site2" and "FloatingPointError" in failure["reason"]
    sequential = build_loop(Poisoned, two_group_federation(n_sites=4, n_train=44), seeded(KeyedDropoutClassifier, 4, 2))
    sequential.fit(1)
    for a, b in zip(sequential.sites, compiled.sites):
        _assert_close_states(a.module.state_dict(), b.module.state_dict(), f"{a.name}/module")


@pytest.mark.slow
def test_the_inductor_compiled_step_trains_as_the_sequential_executor():
    torch._dynamo.reset()
    compiled, sequential = _compiled_run("ditto"), _run("ditto", "sequential")
    assert all(step.not_compiled is None for step in _compiled_steps(compiled))
    _assert_alike(sequential, compiled)
    torch._dynamo.reset()


def test_a_step_that_cannot_be_compiled_runs_eagerly_alike(monkeypatch, caplog):
    def refusing(function, **options):
        def compiled(*args):
            raise RuntimeError("a graph break inside the vmap")  # as torch.compile fails: before any tensor changed
        return compiled

    monkeypatch.setattr(stacked.torch, "compile", refusing)
    compiled = _compiled_run("fedavg")
    (step,) = _compiled_steps(compiled)
    assert step.not_compiled == "RuntimeError: a graph break inside the vmap" and compiled.sites.executor.sequential_plans == {}
    assert sum("could not be compiled" in record.getMessage() for record in caplog.records) == 1  # said once
    _assert_alike(_run("fedavg", "sequential"), compiled)


def test_the_unet_step_is_captured_whole_without_a_graph_break(traced):
    from torch.utils.data import TensorDataset

    from medfed.data.federation import Federation, SiteData
    from medfed.models.segmentation import UNetSegmenter
    from medfed.options.models import UNetOptions

    generator = torch.Generator().manual_seed(0)

    def split(n):
        return TensorDataset(torch.randn(n, 4, 16, 16, generator=generator), torch.randint(0, 2, (n, 16, 16), generator=generator))

    federation = Federation("brats", [SiteData(f"site{i}", split(n), split(4)) for i, n in enumerate((12, 10))], (4, 16, 16), 2, "GENERATED", generated=True)
    model = seeded(UNetSegmenter, 4, 2, UNetOptions(channels=[4, 8], strides=[2], num_res_units=1))
    torch._dynamo.utils.counters.clear()
    loop = build_loop("fedprox", federation, model, batch_size=4)  # 3 steps of 4, and 2 of 4 then 2: a ragged last batch
    loop.sites.executor = executor_for("batched", torch.device("cpu"), dp_sgd=False, compile=True)
    loop.fit(1)
    assert dict(torch._dynamo.utils.counters["graph_break"]) == {}  # e.g. MONAI's DiceLoss: Tensor.tolist() inside the vmap
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    (step,) = _compiled_steps(loop)
    assert step.pads and step.not_compiled is None
