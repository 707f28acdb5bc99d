"""The batched executor's training: one training plan for a group of sites at once, by one vmapped step.

Sites train the same plan of the same strategy on models of the same shape;
one after another (:meth:`~medfed.federated.site.Site.train`) each step is a
small launch-bound loop. Here the group's sites are stacked along a leading
site axis S and each step is one call::

    grads_s, loss_s = vmap(grad_and_value(f))(theta_s, frozen_s, buffers_s, state_s, aux_s, batch_s, key_s)
    f(...) = template_half.loss(template_view, ctx, plan, batch)        through functional_call

``f`` is the *template* half's ``loss`` (the group's first site): the
template's slot modules, held by a :class:`_Slots` wrapper, run with the site's
parameters and buffers swapped in (``torch.func.functional_call``), and the
half's declared ``loss_state`` and auxiliary attributes are set to the site's
slices for the call (and put back after it). Exactly what a site trained alone
does, per site:

* its own parameters, buffers (BatchNorm statistics) and optimiser state,
  stepped by a functional Adam / SGD over the stacked tensors
  (:func:`adam_step`, :func:`sgd_step`: torch.optim's update, per-site step
  counts and hyper-parameters read from each site's own ``param_groups``);
  only ``plan.part`` of the plan's slot and every parameter of ``also_steps``
  are differentiated, and the half's declared auxiliary parameters, stepped
  after the optimisers (:meth:`~medfed.federated.strategies.base.Auxiliary.step`);
* its own batches, drawn from its own loader in the order ``Site.train``
  draws them (:meth:`~medfed.federated.site.Site.batches`), as many steps as its plan gives it: at step t the sites that
  still have steps are grouped by their batch's shape (the last batch of a
  pass may be smaller), each shape one vmapped call; the other sites' tensors
  are not touched;
* its own dropout masks (:mod:`medfed.models.dropout`, keyed per site and step);
* its passes counted as ``Site.train`` counts them.

The losses stay on the device; the group's mean losses are read once, at the
end of the plan (the caller turns a non-finite one into that site's failure).
Everything is read from the sites before the first step and written back
after the last (parameters and buffers copied into the sites' own tensors,
optimiser state so that ``optimizer.state_dict()`` is the one sequential
training gives), so a step that raises leaves the sites' models as they were:
the caller puts their data orders back and trains them one by one.

:func:`group_key` says which sites can train together, or why a site cannot
(its half declares ``batchable``, DP-SGD, an optimiser without a functional twin).

One difference remains by construction: ``torch.func.grad`` gives a trained
parameter the loss does not reach a zero gradient where autograd gives None,
so Adam (momentum, weight decay) would step it here and skip it sequentially.
medfed's strategies train no such parameter; the registry test
(``tests/test_batched.py``) would show one. And "the same to float
tolerance" is per step: a vmapped convolution sums in another order, and Adam
divides a gradient by its own running size, so a gradient that is zero but
for rounding (MONAI's U-Net: a convolution's bias just before an
InstanceNorm, which removes it) is stepped by about the learning rate in
directions that differ between the executors; the models then agree in their
outputs, not bit for bit (one brats_lack0 round: mean IoU 0.2266 / 0.2269).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from medfed.federated.compute import batch_samples
from medfed.federated.site import Site
from medfed.federated.site_view import RoundContext
from medfed.federated.strategies.base import Auxiliary, TrainingPlan
from medfed.federated.strategies.live_parameters import unwrap
from medfed.models.dropout import keyed

#: the optimisers the batched step reproduces, and the ``param_groups`` options they must leave at these values
SUPPORTED_OPTIMIZERS: dict[type, dict[str, Any]] = {
    torch.optim.Adam: {"amsgrad": False, "maximize": False, "decoupled_weight_decay": False},
    torch.optim.SGD: {"maximize": False},
}


# ---------------------------------------------------------------------------------------------------- optimisers
def _per_site(values: torch.Tensor, like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``values`` ``(S,)``, one per site, as ``(S, 1, ..., 1)`` in ``dtype`` (default ``like``'s), broadcastable against ``like`` ``(S, ...)``."""
    return values.to(dtype or like.dtype).reshape(-1, *([1] * (like.ndim - 1)))


def adam_step(
    param: torch.Tensor, grad: torch.Tensor, state: dict[str, torch.Tensor], hyper: dict[str, list[float]]
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One ``torch.optim.Adam`` step (L2 weight decay, no amsgrad) of S sites' copies of one parameter.

    Args:
        param, grad: ``(S, *shape)``.
        state: ``exp_avg``, ``exp_avg_sq`` ``(S, *shape)`` (zeros where a site has no state yet) and ``step``
            ``(S,)`` float64, the steps each site's copy has taken.
        hyper: ``lr``, ``beta1``, ``beta2``, ``eps`` and, where any site's is not 0, ``weight_decay``: ``(S,)``
            float64 tensors, one value per site.

    Returns:
        The stepped parameter and state::

            t <- t + 1;  g <- g + wd p;  m <- m + (1 - b1)(g - m);  v <- b2 v + (1 - b2) g^2
            p <- p - lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
    """
    if "weight_decay" in hyper:
        grad = grad + _per_site(hyper["weight_decay"], param) * param
    step = state["step"] + 1
    exp_avg = state["exp_avg"].lerp(grad, _per_site(1 - hyper["beta1"], param))  # 1 - b in float64, as torch computes it
    exp_avg_sq = state["exp_avg_sq"] * _per_site(hyper["beta2"], param) + _per_site(1 - hyper["beta2"], param) * grad * grad
    t = step.reshape(-1, *([1] * (param.ndim - 1)))
    bias1 = 1 - _per_site(hyper["beta1"], t, torch.float64) ** t
    bias2_sqrt = (1 - _per_site(hyper["beta2"], t, torch.float64) ** t).sqrt()
    step_size = (_per_site(hyper["lr"], t, torch.float64) / bias1).to(param.dtype)
    denom = exp_avg_sq.sqrt() / bias2_sqrt.to(param.dtype) + _per_site(hyper["eps"], param)
    return param - step_size * (exp_avg / denom), {"step": step, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}


def sgd_step(
    param: torch.Tensor, grad: torch.Tensor, state: dict[str, torch.Tensor], hyper: dict[str, list[float]]
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One ``torch.optim.SGD`` step (momentum, dampening, Nesterov, L2 weight decay) of S sites' copies of one parameter.

    Args:
        param, grad: ``(S, *shape)``.
        state: with momentum, ``momentum_buffer`` ``(S, *shape)`` and ``has_buffer`` ``(S,)`` bool (a site's
            first step starts its buffer at the gradient, as torch does); empty without.
        hyper: ``lr``, ``dampening``, ``nesterov`` (1.0 or 0.0) and, where any site's is not 0, ``momentum`` and
            ``weight_decay``: ``(S,)`` float64 tensors, one value per site.

    Returns:
        The stepped parameter and state::

            g <- g + wd p;  b <- g (first step) or mu b + (1 - dampening) g;  d = g + mu b (Nesterov) or b
            p <- p - lr d
    """
    if "weight_decay" in hyper:
        grad = grad + _per_site(hyper["weight_decay"], param) * param
    if "momentum" in hyper:
        momentum = _per_site(hyper["momentum"], param)
        has = state["has_buffer"].reshape(-1, *([1] * (param.ndim - 1)))
        buffer = torch.where(has, momentum * state["momentum_buffer"] + _per_site(1 - hyper["dampening"], param) * grad, grad)
        nesterov = _per_site(hyper["nesterov"], param)
        grad = torch.where(nesterov > 0, grad + momentum * buffer, buffer)
        state = {"momentum_buffer": buffer, "has_buffer": torch.ones_like(state["has_buffer"])}
    return param - _per_site(hyper["lr"], param) * grad, state


_STEPS: dict[type, Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]] = {torch.optim.Adam: adam_step, torch.optim.SGD: sgd_step}


def _kind(optimizer: torch.optim.Optimizer) -> type | None:
    """The supported optimiser class ``optimizer`` is (Fabric's wrapper subclasses it), or None."""
    return next((cls for cls in SUPPORTED_OPTIMIZERS if isinstance(optimizer, cls)), None)


def _options(optimizer: torch.optim.Optimizer, param: nn.Parameter) -> dict[str, float]:
    """The options of ``param``'s group in ``optimizer``, as :func:`adam_step` / :func:`sgd_step` name them."""
    group = next(group for group in optimizer.param_groups if any(p is param for p in group["params"]))
    if _kind(optimizer) is torch.optim.Adam:
        beta1, beta2 = group["betas"]
        return {"lr": group["lr"], "beta1": beta1, "beta2": beta2, "eps": group["eps"], "weight_decay": group["weight_decay"]}
    return {key: float(group[key]) for key in ("lr", "momentum", "dampening", "weight_decay", "nesterov")}


def hyper_parameters(optimizers: list[torch.optim.Optimizer], params: list[nn.Parameter], device: torch.device) -> dict[str, torch.Tensor]:
    """Each site's options of its copy of one parameter, ``{name: (S,) float64}`` as the step functions take them
    (``weight_decay`` and ``momentum`` left out where every site's is 0, as torch.optim skips them)."""
    options = [_options(optimizer, param) for optimizer, param in zip(optimizers, params)]
    return {
        key: torch.tensor([float(o[key]) for o in options], dtype=torch.float64, device=device)
        for key in options[0]
        if key not in ("weight_decay", "momentum") or any(o[key] for o in options)
    }


class _FlatGroup:
    """Trained parameters that one optimiser steps alike at every site, as one flat ``(S, D)`` tensor and its state.

    Parameters of the same slot, optimiser parameter group and per-site state
    history (Adam's step counts, SGD's momentum buffers present or not) are
    stepped by one call of :func:`adam_step` / :func:`sgd_step` over ``(S, D)``
    instead of one call per parameter; the loss sees them as views of it.

    Args:
        names: the parameters, ``"<slot>.<parameter name>"``.
        owned: each name's parameter at each site.
        optimizers: each site's optimiser of the slot.
    """

    def __init__(self, names: list[str], owned: dict[str, list[nn.Parameter]], optimizers: list[torch.optim.Optimizer]) -> None:
        self.names = names
        self.owned = owned
        self.optimizers = optimizers
        first = owned[names[0]]
        device = first[0].device
        self.shapes = {name: tuple(owned[name][0].shape) for name in names}
        sizes = [owned[name][0].numel() for name in names]
        self.bounds = dict(zip(names, itertools.pairwise([0, *itertools.accumulate(sizes)])))
        self.flat = torch.cat([torch.stack([p.detach() for p in owned[name]]).reshape(len(first), -1) for name in names], dim=1)
        self.hyper = hyper_parameters(optimizers, first, device)
        self.step_fn = _STEPS[_kind(optimizers[0])]
        self.steps_before = [_step_count(optimizer, param) for optimizer, param in zip(optimizers, first)]
        self.state = self._stacked_state()

    def _stacked_state(self) -> dict[str, torch.Tensor]:
        """The sites' optimiser state, flat and stacked as the step functions take it (zeros where there is none)."""
        device = self.flat.device
        states = {name: [optimizer.state.get(p, {}) for optimizer, p in zip(self.optimizers, self.owned[name])] for name in self.names}

        def flat(key: str) -> torch.Tensor:
            return torch.cat(
                [torch.stack([s.get(key) if s.get(key) is not None else torch.zeros_like(p) for s, p in zip(states[name], self.owned[name])]).reshape(len(self.optimizers), -1) for name in self.names],
                dim=1,
            )

        if self.step_fn is adam_step:
            return {"step": torch.tensor(self.steps_before, dtype=torch.float64, device=device), "exp_avg": flat("exp_avg"), "exp_avg_sq": flat("exp_avg_sq")}
        if "momentum" not in self.hyper:
            return {}
        has = [states[self.names[0]][i].get("momentum_buffer") is not None for i in range(len(self.optimizers))]
        return {"momentum_buffer": flat("momentum_buffer"), "has_buffer": torch.tensor(has, device=device)}

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Each parameter's ``(S', *shape)`` view of the rows ``flat`` ``(S', D)``."""
        return {name: flat[:, a:b].reshape(flat.shape[0], *self.shapes[name]) for name, (a, b) in self.bounds.items()}

    def step(self, rows: torch.Tensor | None, grads: dict[str, torch.Tensor]) -> None:
        """One optimiser step of the sites ``rows`` (None: every site) on their gradients ``grads`` (``(S', *shape)`` each)."""
        grad = torch.cat([grads[name].reshape(grads[name].shape[0], -1) for name in self.names], dim=1)
        if rows is None:
            self.flat, self.state = self.step_fn(self.flat, grad, self.state, self.hyper)
            return
        state = {key: value[rows] for key, value in self.state.items()}
        new, state = self.step_fn(self.flat[rows], grad, state, {key: value[rows] for key, value in self.hyper.items()})
        self.flat[rows] = new
        for key, value in state.items():
            self.state[key][rows] = value

    @torch.no_grad()
    def write_back(self, site: int, steps: int) -> None:
        """Copy site ``site``'s parameters and optimiser state (it took ``steps`` steps) into its own, as torch.optim keeps them."""
        optimizer = self.optimizers[site]
        for name, (a, b) in self.bounds.items():
            param = self.owned[name][site]
            param.copy_(self.flat[site, a:b].reshape(param.shape))
            if not self.state:
                continue
            if self.step_fn is adam_step:
                values = {
                    # a float32 scalar on the CPU, where torch.optim.Adam keeps it (copied into a capturable one's)
                    "step": torch.tensor(float(self.steps_before[site] + steps), dtype=torch.float32, device="cpu"),
                    "exp_avg": self.state["exp_avg"][site, a:b].reshape(param.shape),
                    "exp_avg_sq": self.state["exp_avg_sq"][site, a:b].reshape(param.shape),
                }
            else:
                values = {"momentum_buffer": self.state["momentum_buffer"][site, a:b].reshape(param.shape)}
            own = optimizer.state[param]
            for key, value in values.items():
                if own.get(key) is not None:
                    own[key].copy_(value)
                else:
                    own[key] = value.clone()


def _step_count(optimizer: torch.optim.Optimizer, param: nn.Parameter) -> float:
    """The steps ``optimizer`` has taken of ``param`` (Adam's ``step``; 0 without state)."""
    step = optimizer.state.get(param, {}).get("step")
    return 0.0 if step is None else float(step)


def _flat_groups(trained_names: list[str], sites: list[Site], owned: dict[str, list[nn.Parameter]]) -> list[_FlatGroup]:
    """The trained parameters in :class:`_FlatGroup` s: by slot, optimiser parameter group and per-site state history."""
    keyed_names: dict[tuple[Any, ...], list[str]] = {}
    for name in trained_names:
        slot = name.split(".", 1)[0]
        optimizers = [site.slot(slot).optimizer for site in sites]
        params = owned[name]
        group = next(k for k, g in enumerate(optimizers[0].param_groups) if any(p is params[0] for p in g["params"]))
        history = tuple(
            (_step_count(o, p), o.state.get(p, {}).get("momentum_buffer") is not None) for o, p in zip(optimizers, params)
        )
        keyed_names.setdefault((slot, group, history), []).append(name)
    return [_FlatGroup(names, owned, [site.slot(key[0]).optimizer for site in sites]) for key, names in keyed_names.items()]


# ---------------------------------------------------------------------------------------------------- grouping
def group_key(site: Site, ctx: RoundContext, plan: TrainingPlan) -> tuple[Any, ...] | str:
    """What sites training ``plan`` together must share (a hashable key), or why ``site`` cannot train in a group.

    Sites with equal keys run the same strategy half, plan, slots (module types, parameter shapes, train/eval
    modes, the modules' per-site constants), optimiser types and auxiliary step sizes, and hold their loss state in
    tensors of the same shapes (or None alike).
    """
    half = site.strategy
    if half.batchable is not None:
        return f"{type(half).__name__}: {half.batchable}"
    if site.privacy is not None:
        return "DP-SGD clips and noises each site's per-sample gradients one site at a time"
    if plan.passes_per_step > 1 or not plan.data_pass:
        return f"plan {plan.label!r}: its steps are the half's own (SiteView.step)"
    slots = []
    for name, slot in sorted(site.slots.items()):
        module = unwrap(slot.module)
        optimizer = slot.optimizer
        kind = _kind(optimizer)
        required = SUPPORTED_OPTIMIZERS.get(kind)
        if required is None or any(group.get(key, value) != value for group in optimizer.param_groups for key, value in required.items()):
            return f"slot {name!r}: {type(optimizer).__name__} with {optimizer.defaults} has no functional twin here"
        shapes = tuple((key, tuple(t.shape), t.dtype) for key, t in itertools.chain(module.named_parameters(), module.named_buffers()))
        modes = tuple(m.training for m in module.modules())
        slots.append((name, type(module), shapes, modes, module.site_constants(), kind, len(optimizer.param_groups)))
    auxiliary = tuple(sorted((name, a.learning_rate, a.project is None) for name, a in half.auxiliary(ctx, plan).items()))
    state = []
    for name in half.loss_state:
        value = getattr(half, name, None)
        if value is not None and not isinstance(value, torch.Tensor):
            return f"{type(half).__name__}: its loss state {name!r} is a {type(value).__name__}, not a tensor (or None)"
        state.append((name, None if value is None else (tuple(value.shape), value.dtype, value.device)))
    return (type(half), plan, tuple(slots), auxiliary, tuple(state))


# ---------------------------------------------------------------------------------------------------- the step
class _Slots(nn.Module):
    """The template site's slot modules under one root, so one ``functional_call`` swaps every slot's tensors.

    ``forward(batch)`` is the template half's loss of one step of ``plan``.
    """

    def __init__(self, site: Site, ctx: RoundContext, plan: TrainingPlan) -> None:
        super().__init__()
        self.slots = nn.ModuleDict({name: unwrap(slot.module) for name, slot in site.slots.items()})
        self._loss = lambda batch: site.strategy.loss(site.view, ctx, plan, batch)

    def forward(self, batch: Any) -> torch.Tensor:
        return self._loss(batch)


@contextmanager
def _attributes(obj: Any, values: dict[str, Any]) -> Iterator[None]:
    """Inside the block, ``obj``'s attributes ``values`` names hold those values; after it, what they held before."""
    saved = {name: getattr(obj, name) for name in values}
    try:
        for name, value in values.items():
            setattr(obj, name, value)
        yield
    finally:
        for name, value in saved.items():
            setattr(obj, name, value)


def _signature(batch: Any) -> tuple[Any, ...]:
    """What batches stacked together must share: the structure, and each tensor's shape and dtype."""
    leaves, spec = tree_flatten(batch)
    return (str(spec), *((tuple(leaf.shape), leaf.dtype) for leaf in leaves))


def _stack_batches(batches: list[Any]) -> Any:
    """Device batches of one signature stacked leaf by leaf, ``(S, *leaf shape)``."""
    flat = [tree_flatten(batch) for batch in batches]
    spec = flat[0][1]
    return tree_unflatten([torch.stack(leaves) for leaves in zip(*(leaves for leaves, _ in flat))], spec)


def train_group(
    sites: list[Site],
    ctx: RoundContext,
    plan: TrainingPlan,
    steps: list[int],
    keys: list[torch.Tensor],
    compute: str | None,
) -> list[tuple[float, int | None]]:
    """Train ``plan`` at every one of ``sites`` (equal :func:`group_key`), ``steps[i]`` steps at site i, stacked.

    Args:
        sites: the group, its first site the template whose half's loss and slot modules run every step.
        ctx: the round context of the plan.
        plan: the plan (the same at every site but for its length).
        steps: each site's optimiser steps (>= 1).
        keys: each site's dropout keys, ``(steps[i],)`` int64 (:func:`medfed.models.dropout.step_keys`).
        compute: the key the steps' passes are counted under (None: not counted).

    Returns:
        Each site's mean loss over its steps (possibly non-finite: the caller's to refuse) and the first step whose
        loss was not finite (None: every one was).

    Raises:
        Whatever a step raises, before anything of the sites' models changed (their data orders have moved).
    """
    template = sites[0]
    device = template.fabric.device
    count = len(sites)
    half = template.strategy
    auxiliary: dict[str, Auxiliary] = half.auxiliary(ctx, plan)
    state_names = [name for name in half.loss_state if name not in auxiliary and isinstance(getattr(half, name, None), torch.Tensor)]

    # what is trained: the plan's part of its slot (its trainable flags, as Site.train sets them), all of also_steps
    modules = [{name: unwrap(slot.module) for name, slot in site.slots.items()} for site in sites]
    stepped = (plan.slot, *plan.also_steps)
    for own in modules:
        own[plan.slot].set_trainable(plan.part)
        for slot in stepped:
            own[slot].train()
    trained_names = [f"{slot}.{name}" for slot in stepped for name, p in modules[0][slot].named_parameters() if p.requires_grad]
    parameters = [{f"{slot}.{name}": p for slot, module in own.items() for name, p in module.named_parameters()} for own in modules]
    buffers = [{f"{slot}.{name}": b for slot, module in own.items() for name, b in module.named_buffers()} for own in modules]
    groups = _flat_groups(trained_names, sites, {name: [p[name] for p in parameters] for name in trained_names})
    stack = lambda tensors, name: torch.stack([t[name].detach() for t in tensors])  # noqa: E731
    frozen = {name: stack(parameters, name) for name in parameters[0] if name not in trained_names}
    stacked_buffers = {name: stack(buffers, name) for name in buffers[0]}
    loss_state = {name: torch.stack([getattr(site.strategy, name) for site in sites]) for name in state_names}
    aux = {name: torch.stack([getattr(site.strategy, name).detach() for site in sites]) for name in auxiliary}

    wrapper = _Slots(template, ctx, plan)

    def site_loss(theta, fixed, buffer, state, extra, batch, key):
        with _attributes(half, {**state, **extra}), keyed(key), template.fabric.autocast():  # the forward in the run's precision
            return torch.func.functional_call(wrapper, {**fixed, **buffer, **theta}, (batch,), strict=True)

    prefixed = lambda tensors: {f"slots.{name}": t for name, t in tensors.items()}  # noqa: E731
    step = torch.func.vmap(torch.func.grad_and_value(site_loss, argnums=(0, 4)), randomness="error")
    totals = torch.zeros(count, dtype=torch.float32 if device.type == "mps" else torch.float64, device=device)  # summed as Site.train sums
    first_bad = torch.zeros(count, dtype=totals.dtype, device=device)  # each site's first step whose loss was not finite (0: none)
    streams = [site.batches(n, plan.data_order) for site, n in zip(sites, steps)]
    key_matrix = torch.nn.utils.rnn.pad_sequence([k.to(device) for k in keys], batch_first=True)  # (S, max steps)
    everyone = torch.arange(count, device=device)
    row_tensors: dict[tuple[int, ...], torch.Tensor] = {}  # the rows of each subset of the sites that stepped alone
    for site in sites:
        site.plan_key = compute
    try:
        for t in range(max(steps)):
            by_shape: dict[tuple[Any, ...], list[tuple[int, Any]]] = {}
            for i in (i for i in range(count) if t < steps[i]):
                batch = next(streams[i])
                if compute is not None:
                    sites[i].passes.add(compute, plan.data_pass * batch_samples(batch))
                by_shape.setdefault(_signature(batch), []).append((i, batch))
            for members in by_shape.values():
                # the sites of one batch shape: all of them (the tensors themselves), or some (their rows, put back after)
                members_rows = tuple(i for i, _ in members)
                if len(members) == count:
                    rows = None
                elif members_rows in row_tensors:
                    rows = row_tensors[members_rows]
                else:  # made once per plan and subset: a copy from the host waits for the device
                    rows = row_tensors[members_rows] = torch.tensor(members_rows, device=device)
                take = (lambda d: d) if rows is None else (lambda d: {name: v[rows] for name, v in d.items()})  # noqa: E731
                theta = {name: view for group in groups for name, view in group.views(group.flat if rows is None else group.flat[rows]).items()}
                buffer, extra = take(stacked_buffers), take(aux)
                (grads, aux_grads), loss = step(
                    prefixed(theta), prefixed(take(frozen)), prefixed(buffer), take(loss_state), extra,
                    _stack_batches([b for _, b in members]), key_matrix[slice(None) if rows is None else rows, t],
                )
                totals.index_add_(0, everyone if rows is None else rows, loss.detach().to(totals.dtype))
                for group in groups:
                    group.step(rows, {name: grads[f"slots.{name}"] for name in group.names})
                for name, rule in auxiliary.items():  # after the optimisers, as Site.train steps them
                    new = torch.func.vmap(rule.step)(extra[name], aux_grads[name])
                    if rows is None:
                        aux[name] = new
                    else:
                        aux[name][rows] = new
                if rows is not None:
                    for name, value in buffer.items():  # BatchNorm statistics the step updated in the rows' copies
                        stacked_buffers[name][rows] = value
            first_bad = torch.where((first_bad == 0) & ~torch.isfinite(totals), t + 1, first_bad)  # a sum stays non-finite
        for stream in streams:
            next(stream, None)  # run out: a whole last pass ends as Site.train's loop ends it (Site.batches)
    finally:
        for site, own in zip(sites, modules):
            site.plan_key = None
            own[plan.slot].set_trainable("all")
    with torch.no_grad():  # every site gets its own back: parameters, optimiser state, buffers, auxiliary tensors
        for i, site in enumerate(sites):
            for group in groups:
                group.write_back(i, steps[i])
            for name, value in stacked_buffers.items():
                buffers[i][name].copy_(value[i])
            for name, value in aux.items():
                setattr(site.strategy, name, value[i].clone())
            for slot in stepped:
                site.slot(slot).optimizer.zero_grad(set_to_none=True)
    read = torch.cat([totals / torch.tensor(steps, dtype=totals.dtype, device=device), first_bad]).tolist()  # the plan's one host read
    return [(mean, int(step) or None) for mean, step in zip(read[:count], read[count:])]
