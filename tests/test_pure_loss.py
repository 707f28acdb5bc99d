"""Every batchable strategy's local loss is a pure function of the slots, the batch and the half's declared state.

For each registered strategy whose site half does not declare itself not
batchable (``SiteHalf.batchable``), on three sites after one round, at the
start of round 2's training phase (their halves then hold the state the
round's message set; every tensor attribute of a half, declared or not, and
every slot's parameters nudged by a site-specific amount so that no two
sites share one: a loss reading an undeclared one then disagrees):

* the per-site gradients of ``loss`` in the trained parameters (the plan's
  part of its slot, every parameter of ``also_steps`` slots) and in the
  half's auxiliary parameters, computed for the three sites at once by
  ``torch.func.vmap(torch.func.grad(...))`` over *one* template half (site
  0's) whose declared ``loss_state`` is set to the stacked per-site state and
  whose slot modules run with the stacked parameters (``functional_call``),
  equal the gradients each site's own half gives (float tolerance);
* calling ``loss`` changes no attribute of the half (no tensor replaced or
  changed in place, no container changed).

Two deliberately broken halves show that the check fails where it must: a
FedProx half that reads its centre without declaring it (vmap then gives
every site the template's centre), and one whose loss counts its calls.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from medfed.federated.strategies import registered
from medfed.federated.protocol import RoundContext, TrainingPlan
from medfed.federated.strategies.base import SiteHalf
from medfed.federated.strategies.fedprox import FedProx, FedProxSite
from medfed.models.base import unwrap
from medfed.options.strategies import strategy_spec
from toy_federation import one_torch_thread  # noqa: F401 (autouse fixture)
from toy_federation import BodyHeadClassifier, build_loop, seeded, two_group_federation

STRATEGIES = registered()

BATCH = 8  # samples of every site's batch (vmap needs one shape)


def _batchable() -> list[str]:
    return sorted(name for name, cls in STRATEGIES.items() if cls.Site.batchable is None)


def _round_two_training_phase(loop) -> tuple[RoundContext, list[int]]:
    """Round 1 done; round 2's phases run up to the first one whose plans train; its context and the sites that train in it."""
    loop.fit(1)
    server = loop.server
    for phase_index, phase in enumerate(loop.strategy.phases):
        ctx = RoundContext(2, phase)
        messages = {site.index: server.message(ctx, site.index) for site in loop.sites}
        for site in loop.sites:
            with site.global_rng(2, phase_index):
                site.strategy.receive(site.view, ctx, messages[site.index])
        training = [site.index for site in loop.sites if site.strategy.plan(ctx)]
        if training:
            return ctx, training
        server.aggregate(ctx, {site.index: site.strategy.reply(site.view, ctx) for site in loop.sites})
    raise AssertionError(f"{loop.strategy.name}: no phase of round 2 trains")


def _nudge(loop, sites: list[int]) -> None:
    """Every floating-point tensor of each half (declared or not) and every slot parameter moved by a site's own small amount."""
    generator = torch.Generator().manual_seed(11)
    for index in sites:
        site = loop.sites[index]
        half = site.strategy
        for name, value in list(vars(half).items()):
            if isinstance(value, torch.Tensor) and value.is_floating_point():
                setattr(half, name, value + 1e-2 * (index + 1) * torch.randn(value.shape, generator=generator, dtype=value.dtype))
        with torch.no_grad():
            for slot in site.slots.values():
                for parameter in slot.module.parameters():
                    parameter.add_(1e-2 * (index + 1) * torch.randn(parameter.shape, generator=generator, dtype=parameter.dtype))


def _batch(site) -> tuple[torch.Tensor, ...]:
    return tuple(t[:BATCH] for t in site.data.train.tensors)


def _trained_names(site, plan: TrainingPlan) -> list[str]:
    """``slots.<slot>.<parameter>`` of what the plan's steps train: its part of its slot, all of ``also_steps``' slots."""
    module = unwrap(site.slot(plan.slot).module)
    module.set_trainable(plan.part)
    try:
        names = [f"slots.{plan.slot}.{name}" for name, p in module.named_parameters() if p.requires_grad]
    finally:
        module.set_trainable("all")
    for other in plan.also_steps:
        names += [f"slots.{other}.{name}" for name, _ in unwrap(site.slot(other).module).named_parameters()]
    return names


def _train_mode(site, plan: TrainingPlan) -> None:
    for slot in (plan.slot, *plan.also_steps):
        site.slot(slot).module.train()


def _snapshot(value: Any) -> Any:
    """What a later :func:`_unchanged` compares: tensors by identity and content, containers by their items."""
    if isinstance(value, torch.Tensor):
        return ("tensor", value, value.detach().clone())
    if isinstance(value, dict):
        return ("dict", {key: _snapshot(item) for key, item in value.items()})
    if isinstance(value, (list, tuple)):
        return ("sequence", type(value), [_snapshot(item) for item in value])
    return ("object", value)


def _unchanged(snapshot: Any, value: Any) -> bool:
    kind = snapshot[0]
    if kind == "tensor":
        return value is snapshot[1] and torch.equal(value.detach(), snapshot[2])
    if kind == "dict":
        return isinstance(value, dict) and set(value) == set(snapshot[1]) and all(_unchanged(s, value[k]) for k, s in snapshot[1].items())
    if kind == "sequence":
        return type(value) is snapshot[1] and len(value) == len(snapshot[2]) and all(_unchanged(s, v) for s, v in zip(snapshot[2], value))
    return value is snapshot[1] or value == snapshot[1]


def _site_gradients(site, ctx: RoundContext, plan: TrainingPlan) -> dict[str, torch.Tensor]:
    """The site's own loss differentiated in what the plan trains (auxiliaries as the executor makes them: leaves)."""
    half = site.strategy
    auxiliary = half.auxiliary(ctx, plan)
    saved = {name: getattr(half, name) for name in auxiliary}
    for name in auxiliary:
        setattr(half, name, saved[name].detach().requires_grad_(True))
    try:
        _train_mode(site, plan)
        wrapper_names = _trained_names(site, plan)
        lookup = {f"slots.{slot}.{name}": p for slot, s in site.slots.items() for name, p in unwrap(s.module).named_parameters()}
        inputs = [lookup[name] for name in wrapper_names] + [getattr(half, name) for name in auxiliary]
        before = {name: _snapshot(value) for name, value in vars(half).items()}
        loss = half.loss(site.view, ctx, plan, _batch(site))
        changed = sorted(set(vars(half)) ^ set(before) | {name for name, s in before.items() if name in vars(half) and not _unchanged(s, vars(half)[name])})
        assert not changed, f"{type(half).__name__}.loss changed the half's attributes {changed}"
        gradients = torch.autograd.grad(loss, inputs, allow_unused=True, materialize_grads=True)
    finally:
        for name, value in saved.items():
            setattr(half, name, value)
    return dict(zip(wrapper_names + list(auxiliary), gradients, strict=True))


class _Slots(nn.Module):
    """A template site's slot modules under one module (``slots.<slot>.<name>``); its forward is the half's loss."""

    def __init__(self, site, ctx: RoundContext, plan: TrainingPlan) -> None:
        super().__init__()
        self.slots = nn.ModuleDict({name: unwrap(slot.module) for name, slot in site.slots.items()})
        self.site, self.ctx, self.plan = site, ctx, plan

    def forward(self, batch: Any) -> torch.Tensor:
        return self.site.strategy.loss(self.site.view, self.ctx, self.plan, batch)


def _stacked(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack([t.detach() for t in tensors])


def _batched_gradients(loop, sites: list[int], ctx: RoundContext, plan: TrainingPlan) -> list[dict[str, torch.Tensor]]:
    """The sites' gradients from one vmapped call of the template (first) site's loss over their stacked slots and state."""
    template = loop.sites[sites[0]]
    half = template.strategy
    wrapper = _Slots(template, ctx, plan)
    trained_names = _trained_names(template, plan)
    auxiliary = list(half.auxiliary(ctx, plan))
    declared = [name for name in half.loss_state if name not in auxiliary and getattr(half, name) is not None]
    for index in sites:
        other = loop.sites[index].strategy
        assert all((getattr(other, name) is None) == (name not in declared) for name in half.loss_state if name not in auxiliary)
        _train_mode(loop.sites[index], plan)

    def per_site(name_source):  # stacked {name: (S, ...)} over the sites
        return {name: _stacked([name_source(loop.sites[i], name) for i in sites]) for name in names_of[name_source]}

    def parameter(site, name):
        return dict(nn.ModuleDict({k: unwrap(s.module) for k, s in site.slots.items()}).named_parameters(prefix="slots"))[name]

    def buffer(site, name):
        return dict(nn.ModuleDict({k: unwrap(s.module) for k, s in site.slots.items()}).named_buffers(prefix="slots"))[name]

    def state(site, name):
        return getattr(site.strategy, name)

    all_parameters = [name for name, _ in wrapper.named_parameters()]
    names_of = {
        parameter: all_parameters,
        buffer: [name for name, _ in wrapper.named_buffers()],
        state: declared + auxiliary,
    }
    parameters, buffers, states = per_site(parameter), per_site(buffer), per_site(state)
    trained = {name: parameters[name] for name in trained_names}
    frozen = {name: parameters[name] for name in all_parameters if name not in trained}
    aux = {name: states.pop(name) for name in auxiliary}
    batch = tuple(torch.stack(parts) for parts in zip(*(_batch(loop.sites[i]) for i in sites)))

    def loss(trained, frozen, buffers, state, aux, batch):
        for name, value in {**state, **aux}.items():
            setattr(half, name, value)
        return torch.func.functional_call(wrapper, {**trained, **frozen, **buffers}, (batch,))

    saved = {name: getattr(half, name) for name in half.loss_state}
    try:
        gradient_trained, gradient_aux = torch.func.vmap(torch.func.grad(loss, argnums=(0, 4)))(trained, frozen, buffers, states, aux, batch)
    finally:
        for name, value in saved.items():
            setattr(half, name, value)
    return [{**{n: g[k] for n, g in gradient_trained.items()}, **{n: g[k] for n, g in gradient_aux.items()}} for k in range(len(sites))]


def check_pure_loss(loop) -> None:
    """Round 2's training plans: vmapped gradients over the template half = each site's own (see the module docstring)."""
    ctx, sites = _round_two_training_phase(loop)
    _nudge(loop, sites)
    plans = loop.sites[sites[0]].strategy.plan(ctx)
    for plan in plans:
        expected = [_site_gradients(loop.sites[i], ctx, plan) for i in sites]
        batched = _batched_gradients(loop, sites, ctx, plan)
        for index, want, got in zip(sites, expected, batched, strict=True):
            assert set(got) == set(want)
            for name in want:
                torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-6, msg=lambda m: f"site {index}, plan {plan.label}, {name}: {m}")


def _loop(strategy, options=None):
    return build_loop(strategy, two_group_federation(n_sites=3, n_train=24), seeded(BodyHeadClassifier, 4, 2), options, batch_size=8)


@pytest.mark.parametrize("name", _batchable())
def test_the_loss_is_a_function_of_declared_state(name):
    check_pure_loss(_loop(name, strategy_spec(name).smoke))


def test_the_declared_state_differs_between_sites_where_a_strategy_declares_any():
    # the nudge makes the check sensitive to every declared tensor; this checks the runs reach state worth stacking
    loop = _loop("apple", strategy_spec("apple").smoke)
    ctx, sites = _round_two_training_phase(loop)
    halves = [loop.sites[i].strategy for i in sites]
    for name in ("own", "dr", "cores"):
        assert not torch.equal(getattr(halves[0], name), getattr(halves[1], name)), name


class _UndeclaredCentreSite(FedProxSite):
    loss_state = ()  # reads self.centre all the same


class _UndeclaredCentre(FedProx):
    name = "undeclared_centre"
    Site = _UndeclaredCentreSite


class _CountingSite(FedProxSite):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.calls = 0

    def loss(self, site, ctx, plan, batch) -> torch.Tensor:
        self.calls += 1
        return super().loss(site, ctx, plan, batch)


class _Counting(FedProx):
    name = "counting"
    Site = _CountingSite


def test_the_check_fails_for_a_loss_reading_undeclared_state():
    with pytest.raises(AssertionError, match="slots.model"):  # vmap gave every site the template's centre
        check_pure_loss(_loop(_UndeclaredCentre, {"mu": 0.5}))


def test_the_check_fails_for_a_loss_that_changes_the_half():
    with pytest.raises(AssertionError, match="calls"):
        check_pure_loss(_loop(_Counting, {"mu": 0.5}))


@pytest.mark.parametrize("name", sorted(set(STRATEGIES) - set(_batchable())))
def test_a_strategy_that_is_not_batchable_says_why_in_one_line(name):
    reason = STRATEGIES[name].Site.batchable
    assert isinstance(reason, str) and reason.strip() and "\n" not in reason


def test_the_auxiliary_step_is_projected_gradient_descent():
    from medfed.federated.protocol import Auxiliary

    value, gradient = torch.tensor([0.2, 0.9, 0.5]), torch.tensor([1.0, -1.0, 0.5])
    torch.testing.assert_close(Auxiliary(0.5).step(value, gradient), torch.tensor([-0.3, 1.4, 0.25]))
    torch.testing.assert_close(Auxiliary(0.5, lambda a: a.clamp(0.0, 1.0)).step(value, gradient), torch.tensor([0.0, 1.0, 0.25]))
    assert SiteHalf.batchable is None and SiteHalf.loss_state == ()
