"""Site.train: optimiser steps (fractional epochs cut from the round's schedule), drawn from fresh seeded passes; model slots."""

import pytest
import torch

from medfed.federated.protocol import TrainingPlan
from medfed.federated.strategies.base import SiteHalf, Strategy
from toy_federation import one_torch_thread  # noqa: F401 (autouse fixture)
from toy_federation import LinearClassifier, build_loop, seeded, two_group_federation


def _site(n_train=96, batch_size=16):
    """A site of a 2-site toy federation; site 0 has n_train samples (B = ceil(n_train / batch_size))."""
    loop = build_loop("local", two_group_federation(n_sites=2, n_train=n_train), seeded(LinearClassifier, 4, 2), batch_size=batch_size)
    return loop.sites[0]


def _recording_loss(site, seen):
    """A step loss that records the sample indices of each batch (inputs identify samples) and counts steps."""
    inputs = site.data.train.tensors[0]

    def step_loss(batch):
        x, _ = batch
        seen.append([int(torch.nonzero((inputs == row).all(dim=1))[0]) for row in x])
        return site.module.training_step(batch, 0)

    return step_loss


def _loss_per_step(site, losses):
    """The model's step loss, each step's value appended to ``losses`` (read at once: a test's own bookkeeping)."""

    def step_loss(batch):
        loss = site.module.training_step(batch, 0)
        losses.append(loss.item())
        return loss

    return step_loss


@pytest.mark.parametrize(
    ("n_train", "epochs", "after", "expected"),
    [
        (96, 1.0, 0.0, 6),  # B = 6
        (96, 2.0, 0.0, 12),
        (112, 0.5, 0.0, 4),  # B = 7: 3.5 rounds up ...
        (112, 0.5, 0.5, 3),  # ... so the second half takes the rest, 7 - 4
        (112, 1 / 3, 0.0, 2),  # 7/3 -> 2
        (112, 1 / 3, 1 / 3, 3),  # 14/3 -> 5, 5 - 2
        (112, 1 / 3, 2 / 3, 2),  # 7 - 5
        (16, 0.25, 0.0, 1),  # B = 1: at least one step
    ],
)
def test_steps_cut_the_rounds_schedule_at_whole_steps(n_train, epochs, after, expected):
    assert _site(n_train).steps(epochs, after) == expected


def test_steps_reject_a_non_positive_number_of_epochs():
    with pytest.raises(ValueError, match="epochs must be > 0"):
        _site().steps(0.0)


def test_train_takes_exactly_the_steps_and_a_half_epoch_is_the_start_of_a_fresh_pass():
    half, full = _site(112), _site(112)  # identical sites: same data, same seeded generator
    seen_half, seen_full = [], []
    half.train(half.steps(0.5), "model", "all", _recording_loss(half, seen_half))
    full.train(full.steps(1.0), "model", "all", _recording_loss(full, seen_full))
    assert len(seen_half) == 4 and len(seen_full) == 7
    assert seen_half == seen_full[:4]  # the first 4 batches of the same permutation
    assert sorted(i for batch in seen_full for i in batch) == list(range(112))  # a whole pass: every sample once


def test_the_next_call_starts_a_new_pass_whose_order_depends_only_on_the_generator():
    site = _site(112)
    seen = []
    site.train(site.steps(0.5), "model", "all", _recording_loss(site, seen))
    state = site.orders.generator.get_state()
    seen_second = []
    site.train(site.steps(0.5, 0.5), "model", "all", _recording_loss(site, seen_second))
    assert len(seen_second) == 3 and seen_second != seen[:3]  # a new permutation, not the rest of the dropped pass
    site.orders.generator.set_state(state)  # as a resumed run restores it from the checkpoint
    seen_again = []
    site.train(site.steps(0.5, 0.5), "model", "all", _recording_loss(site, seen_again))
    assert seen_again == seen_second


def test_whole_epochs_are_complete_passes_one_call_or_several():
    once, twice = _site(112), _site(112)
    seen_once, seen_twice = [], []
    once.train(once.steps(2.0), "model", "all", _recording_loss(once, seen_once))
    twice.train(twice.steps(1.0), "model", "all", _recording_loss(twice, seen_twice))
    twice.train(twice.steps(1.0, 1.0), "model", "all", _recording_loss(twice, seen_twice))
    assert seen_once == seen_twice and len(seen_once) == 14
    assert torch.equal(once.orders.generator.get_state(), twice.orders.generator.get_state())
    assert torch.equal(once.module.get_vector("all"), twice.module.get_vector("all"))
    plain = _site(112)
    for _ in range(2):
        for _ in plain.orders.train_loader:  # what a plain epoch loop draws from the generator
            pass
    assert torch.equal(plain.orders.generator.get_state(), once.orders.generator.get_state())


def test_a_named_data_order_draws_what_the_sites_own_would_whatever_else_trains_and_round_trips():
    site, alone = _site(112), _site(112)
    seen_own, seen_named, seen_alone = [], [], []
    site.train(site.steps(1.0), "model", "all", _recording_loss(site, seen_own))  # moves the site's own order on
    site.train(site.steps(1.0), "model", "all", _recording_loss(site, seen_named), data_order="personal")
    alone.train(alone.steps(1.0), "model", "all", _recording_loss(alone, seen_alone))
    assert seen_named == seen_alone == seen_own  # each order's first pass, unaffected by the other
    state = site.state_dict()
    later = []
    site.train(site.steps(1.0), "model", "all", _recording_loss(site, later), data_order="personal")
    assert later != seen_named  # the named order went on to a new pass
    site.load_state_dict(state)
    again = []
    site.train(site.steps(1.0), "model", "all", _recording_loss(site, again), data_order="personal")
    assert again == later
    site.load_state_dict(_site(112).state_dict())  # a state taken before the order's first use: it starts afresh
    fresh = []
    site.train(site.steps(1.0), "model", "all", _recording_loss(site, fresh), data_order="personal")
    assert fresh == seen_named


def test_train_returns_the_mean_step_loss():
    site = _site(112)
    losses = []
    assert site.train(site.steps(0.5), "model", "all", _loss_per_step(site, losses)) == pytest.approx(sum(losses) / 4)
    assert len(losses) == 4


def test_training_frees_the_gradients():
    site = _site(112)
    site.train(site.steps(0.5), "model", "all", lambda batch: site.module.training_step(batch, 0))
    assert all(parameter.grad is None for parameter in site.module.parameters())


def test_global_rng_is_seeded_by_site_and_stream_and_leaves_the_outer_generators_alone():
    import random

    import numpy as np

    def draws(site, *stream):
        with site.global_rng(*stream):
            return torch.rand(3).tolist(), np.random.rand(), random.random()

    site, twin = _site(), _site()
    torch.manual_seed(5)
    outer = torch.rand(2)
    torch.manual_seed(5)
    assert draws(site, 2, 0) == draws(twin, 2, 0)  # whatever happened before in the process
    assert torch.equal(torch.rand(2), outer)  # the block drew nothing from the outer torch stream
    assert draws(site, 2, 0) != draws(site, 2, 1) and draws(site, 2, 0) != draws(site, 3, 0)
    other = build_loop("local", two_group_federation(n_sites=2), seeded(LinearClassifier, 4, 2)).sites[1]
    assert draws(site, 2, 0) != draws(other, 2, 0)


class _TwoSlots(Strategy):
    """Trains slot "a" for 3 steps, then slot "b" for 2 epochs of its own; evaluates "b"; exchanges nothing."""

    name = "two_slots"
    slots = ("a", "b")
    evaluated_slot = "b"

    class Site(SiteHalf):
        def plan(self, ctx):
            return (TrainingPlan(slot="a", steps=3), TrainingPlan(slot="b", epochs=2.0))


def test_plans_train_their_own_slot_for_their_own_length_and_the_evaluated_slot_is_evaluated():
    loop = build_loop(_TwoSlots, two_group_federation(n_sites=2, n_train=112), seeded(LinearClassifier, 4, 2), batch_size=16)
    site = loop.sites[0]
    a, b = site.slot("a"), site.slot("b")
    assert a.module is not b.module and a.optimizer is not b.optimizer and site.module is b.module
    steps = {"a": 0, "b": 0}
    for name in steps:
        forward = site.slot(name).module.training_step

        def counting(batch, index, name=name, forward=forward):
            steps[name] += 1
            return forward(batch, index)

        site.slot(name).module.training_step = counting
    start = {name: site.slot(name).module.get_vector("all") for name in steps}
    loop.fit(1)
    assert steps == {"a": 3, "b": 2 * 7}  # B = 7 batches of 16
    assert set(loop.history[0]["train_loss"]["site0"]) == {"fit/a", "fit/b"}
    for name in steps:
        assert not torch.equal(site.slot(name).module.get_vector("all"), start[name])
    state = site.state_dict()
    assert set(state["slots"]) == {"a", "b"} and set(state["slots"]["a"]) == {"module", "optimizer"}
    assert loop.history[0]["metrics"]["site0"] == site.evaluate()  # the round's metrics are slot b's


@pytest.mark.parametrize("plan", [dict(share=0.0), dict(epochs=-1.0), dict(steps=0), dict(epochs=1.0, steps=2)])
def test_an_impossible_training_plan_is_refused(plan):
    with pytest.raises(ValueError, match="training plan"):
        TrainingPlan(**plan)


def test_a_plan_counts_steps_epochs_or_a_share_of_the_trainers_epochs():
    assert TrainingPlan(steps=5).epochs_of(2.0) is None
    assert TrainingPlan(epochs=0.5).epochs_of(2.0) == 0.5
    assert TrainingPlan(share=0.25).epochs_of(2.0) == 0.5
    assert TrainingPlan().epochs_of(3.0) == 3.0



def _dataloader_route(site):
    """``site`` put on the DataLoader route (as a split that is not device-resident trains): the samples' own loaders."""
    site.orders.resident = None
    site.orders.train_loader = site.orders._shuffled_loader(site.orders.generator)
    site.orders.named = {}
    return site


def test_device_resident_batches_are_the_dataloaders_batches_in_the_same_order():
    resident, loaded = _site(104), _dataloader_route(_site(104))  # B = 7, the last batch of a pass holds 8 samples
    assert resident.orders.resident is not None and loaded.orders.resident is None
    batches = {id(resident): [], id(loaded): []}

    def recording(site):
        def step_loss(batch):
            batches[id(site)].append([tensor.clone() for tensor in batch])
            return site.module.training_step(batch, 0)

        return step_loss

    for site in (resident, loaded):  # half a pass, the rest of the round, two whole passes, a named data order
        site.train(site.steps(0.5), "model", "all", recording(site))
        site.train(site.steps(0.5, 0.5), "model", "all", recording(site))
        site.train(site.steps(2.0), "model", "all", recording(site))
        site.train(site.steps(1.0), "model", "all", recording(site), data_order="personal")
    assert len(batches[id(resident)]) == 4 + 3 + 14 + 7
    assert [len(batch[1]) for batch in batches[id(resident)][-7:]] == [16] * 6 + [8]
    for got, expected in zip(batches[id(resident)], batches[id(loaded)], strict=True):
        assert len(got) == len(expected) == 2
        assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(got, expected))
    assert torch.equal(resident.orders.generator.get_state(), loaded.orders.generator.get_state())
    assert torch.equal(resident.orders.named["personal"][0].get_state(), loaded.orders.named["personal"][0].get_state())
    assert torch.equal(resident.module.get_vector("all"), loaded.module.get_vector("all"))


def test_a_split_with_its_own_sampler_keeps_its_dataloader():
    from torch.utils.data import TensorDataset

    from medfed.federated.data_order import resident_tensors

    class Crops(TensorDataset):  # what random crops look like to the site: tensors, and a sampler of their own
        def sampler(self, generator):
            raise AssertionError("not drawn here")

    x, y = torch.randn(8, 3), torch.zeros(8, dtype=torch.long)
    assert resident_tensors(Crops(x, y), torch.device("cpu")) is None
    kept = resident_tensors(TensorDataset(x, y), torch.device("cpu"))
    assert kept[0] is x and kept[1] is y  # on the CPU the split is used as it is: no copy


class _HostReads:
    """Counts the host reads of floating-point and boolean tensors (``item``, ``tolist``, ``bool``, ``float``) while on."""

    METHODS = ("item", "tolist", "__bool__", "__float__")

    def __init__(self, monkeypatch):
        self.count = 0
        for name in self.METHODS:
            original = getattr(torch.Tensor, name)

            def counted(tensor, *args, original=original):
                if tensor.is_floating_point() or tensor.dtype == torch.bool:
                    self.count += 1
                return original(tensor, *args)

            monkeypatch.setattr(torch.Tensor, name, counted)


def test_a_plan_reads_its_losses_from_the_device_once_not_at_every_step(monkeypatch):
    site = _site(112)
    reads = _HostReads(monkeypatch)
    mean = site.train(site.steps(2.0), "model", "all", lambda batch: site.module.training_step(batch, 0))
    assert reads.count == 1  # 14 steps, one read (the sampler's int64 permutations are host tensors, not counted)
    monkeypatch.undo()
    twin = _site(112)
    losses = []
    twin.train(twin.steps(2.0), "model", "all", _loss_per_step(twin, losses))
    total = 0.0
    for loss in losses:  # the running float64 sum a per-step loss.item() gave
        total += loss
    assert mean == total / 14


def test_a_loss_that_becomes_nan_at_step_3_fails_the_site_naming_the_site_the_round_and_the_step():
    from medfed.errors import SiteFailure

    loop = build_loop("fedavg", two_group_federation(n_sites=2, n_train=96), seeded(LinearClassifier, 4, 2), on_site_failure="stop")
    half = loop.sites[1].strategy
    calls = {}

    def loss(view, ctx, plan, batch, honest=half.loss):
        calls[ctx.round] = calls.get(ctx.round, 0) + 1
        value = honest(view, ctx, plan, batch)
        return value * float("nan") if ctx.round == 2 and calls[ctx.round] >= 3 else value

    half.loss = loss
    loop.fit(1)
    steps = loop.sites[1].batches_per_epoch
    with pytest.raises(
        SiteFailure,
        match=rf"^site site1 failed in round 2 \(fit phase\): FloatingPointError: site1: training loss became nan at step 3 of {steps} ",
    ):
        loop.fit(2)
    assert calls[2] == steps  # the plan ran to its end: its losses were read once, after its last step


def _assembled_site(model, *, precision="32", compile=False, n_train=112):
    """Site 0 of a 2-site toy FedAvg federation built as a run builds it (RunAssembly, make_fabric) in ``precision``/``compile``."""
    from medfed.assembly import RunAssembly, make_fabric
    from medfed.config import TrainerConfig
    from medfed.federated.strategies import strategy_from_config

    federation = two_group_federation(n_sites=2, n_train=n_train)
    strategy_cls, options = strategy_from_config({"name": "fedavg"})
    strategy = strategy_cls(options, model.parameter_split, 2, 0)
    assembly = RunAssembly(model, strategy, {"name": "dense"}, {"name": "dense"}, 16, 0, compile=compile)
    fabric = make_fabric(TrainerConfig(precision=precision, compile=compile), loggers=[], callbacks=[])
    return assembly.site(fabric, 0, federation.sites[0])


def test_every_precision_the_config_accepts_has_a_fabric_precision():
    from medfed.assembly import FABRIC_PRECISION
    from medfed.config import PRECISIONS

    assert set(FABRIC_PRECISION) == set(PRECISIONS)


def test_bf16_mixed_trains_under_bfloat16_autocast_on_the_cpu_close_to_float32():
    runs = {}
    for precision in ("32", "bf16-mixed"):
        site = _assembled_site(seeded(LinearClassifier, 4, 2), precision=precision)
        dtypes = []  # of the linear layer's output in each training step
        site.module.linear.register_forward_hook(lambda layer, inputs, output, dtypes=dtypes: dtypes.append(output.dtype))
        step_loss = lambda batch, site=site: site.module.training_step(batch, 0)  # noqa: E731 (as the strategies call it)
        runs[precision] = (site.train(site.steps(1.0), "model", "all", step_loss), dtypes, site)
    (full, full_dtypes, full_site), (mixed, mixed_dtypes, mixed_site) = runs["32"], runs["bf16-mixed"]
    assert set(full_dtypes) == {torch.float32} and set(mixed_dtypes) == {torch.bfloat16}
    assert mixed != full and mixed == pytest.approx(full, rel=2e-2)  # bfloat16 has 8 significant bits
    assert all(p.dtype == torch.float32 for p in mixed_site.module.parameters())  # float32 parameters and optimiser
    assert mixed_site.evaluate()["accuracy"] == pytest.approx(full_site.evaluate()["accuracy"], abs=0.05)


@pytest.mark.slow  # the compilation: 15-45 s on two busy cores
def test_compile_gives_the_eager_first_step_loss():
    eager = _assembled_site(seeded(LinearClassifier, 4, 2))
    compiled = _assembled_site(seeded(LinearClassifier, 4, 2), compile=True)
    assert compiled.module.module._compiled_call_impl is not None and eager.module.module._compiled_call_impl is None
    assert list(compiled.module.state_dict()) == list(eager.module.state_dict())  # checkpoints keep their keys
    losses = [site.train(1, "model", "all", lambda batch, site=site: site.module.training_step(batch, 0)) for site in (eager, compiled)]
    assert losses[1] == pytest.approx(losses[0], rel=1e-6, abs=1e-7)
    assert torch.allclose(compiled.module.get_vector("all"), eager.module.get_vector("all"), rtol=1e-6, atol=1e-7)
