"""The batched executor: the rows of a training plan that can train together, stacked, one vmapped step at a time.

Rows (:class:`~medfed.federated.executor.Row`) of the same plan of the same
strategy on models of the same shape are stacked along a leading axis S, and
each step of the rule (:mod:`medfed.federated.step`) is one call of
:class:`StackedStep`, a function of tensors only (:class:`StackedState`)::

    grads_s, loss_s = vmap(grad_and_value(f))(theta_s, frozen_s, buffers_s, state_s, aux_s, batch_s, key_s)
    f(...) = template_half.loss(template_view, ctx, plan, batch)        through functional_call

``f`` is the first row's half's ``loss``, its slot modules (:class:`Slots`)
run with the row's parameters and buffers swapped in and the half's declared
``loss_state`` and auxiliary attributes set to the row's slices for the
call (:mod:`medfed.federated.stacked_step`); nothing in it tells two sites of one federation from the same site in
two runs. Per row, exactly what it does trained alone: its own parameters,
buffers and optimiser state (functional Adam / SGD,
:mod:`medfed.federated.stacked_optimizers`, per-row step counts and
hyper-parameters), only ``plan.part`` of its slot and all of ``also_steps``
differentiated, its auxiliary parameters stepped after the optimisers; its
own batches in ``Site.train``'s order (at step t the rows that still have
steps grouped by batch shape, each shape one step of those rows, the others
untouched), its own dropout keys, its passes counted. The losses are read
once, at the plan's end (a non-finite mean fails that row's site). Under
``trainer.compile`` the steps are instead the static-shape step of
:mod:`medfed.federated.stacked`, compiled once and kept from plan to plan:
every row in every call, ragged last batches padded and masked, the rows
without a step at t running on and throwing their update away.
Everything is read from the sites before the first step and written back
after the last (``optimizer.state_dict()`` as sequential training leaves
it), so a step that raises leaves the models as they were: the rows' data
orders are put back and they train one at a time. :func:`group_key` says
which rows can train together, or why one cannot.

Two differences remain by construction: ``torch.func.grad`` gives a trained
parameter the loss does not reach a zero gradient where autograd gives None,
so Adam would step it here and skip it sequentially (medfed's strategies
train no such parameter; ``tests/test_batched.py`` would show one); and a
vmapped convolution sums in another order, so a gradient that is zero but
for rounding (MONAI's U-Net: a convolution's bias before an InstanceNorm) is
stepped by about the learning rate in directions that differ between the
executors: the models agree in their outputs, not bit for bit (one
brats_lack0 round: mean IoU 0.2266 / 0.2269).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from medfed.errors import warn
from medfed.federated.compute import batch_samples
from medfed.federated.executor import Outcome, Row, SequentialExecutor, restore_position, saved_position
from medfed.federated.protocol import RoundContext, TrainingPlan
from medfed.federated.site import Site
from medfed.federated.stacked import Layout, StaticStep, calls
from medfed.federated.stacked_optimizers import SUPPORTED_OPTIMIZERS, FlatGroup, flat_groups, optimizer_kind
from medfed.federated.stacked_step import Slots, StackedState, StackedStep, batch_signature, functional_loss, stack_batches
from medfed.federated.step import step
from medfed.models.base import unwrap
from medfed.models.padding import can_pad


class BatchedExecutor(SequentialExecutor):
    """Rows of equal :func:`group_key` trained together (:func:`train_group`), the others one at a time (module
    docstring); which plans train one row at a time, and why, is said once per run and recorded."""

    name = "batched"

    def __init__(self, compile: bool = False) -> None:
        #: why plans trained one row at a time, ``{"<phase>/<plan label>": reason}``
        self.sequential_plans: dict[str, str] = {}
        #: with ``compile`` (``trainer.compile``): the compiled static-shape steps, kept from plan to plan
        self.compiled: dict[Any, tuple[Slots, StaticStep]] | None = {} if compile else None

    def train(self, rows: list[Row]) -> list[Outcome]:
        outcomes: list[Outcome] = [None] * len(rows)
        groups: dict[Any, list[int]] = {}
        alone: list[int] = []
        for i, row in enumerate(rows):
            try:
                key = group_key(row.site, row.ctx, row.plan)
            except Exception as error:
                outcomes[i] = f"{type(error).__name__}: {error}"
                continue
            if isinstance(key, str):
                self._note(row, key)
                alone.append(i)
            elif row.site.slot(row.plan.slot).module.parameter_split.size(row.plan.part) == 0:
                alone.append(i)  # nothing to train (Site.train says so)
            else:
                groups.setdefault(key, []).append(i)
        for members in groups.values():
            if len(members) == 1:
                alone.extend(members)
                continue
            for i, outcome in zip(members, self._together([rows[i] for i in members]), strict=True):
                outcomes[i] = outcome
        for i, outcome in zip(alone, super().train([rows[i] for i in alone]), strict=True):
            outcomes[i] = outcome
        return outcomes

    def _together(self, rows: list[Row]) -> list[Outcome]:
        """Rows of one group, stacked; where the stacked step raises, one at a time (a row's fault fails it alone)."""
        saved = [saved_position(row.site) for row in rows]
        try:
            means = train_group(rows, self.compiled)
        except Exception as error:
            self._note(rows[0], f"the stacked step raised ({type(error).__name__}: {error})")
            for row, before in zip(rows, saved, strict=True):
                restore_position(row.site, before)
            return super().train(rows)
        return [
            mean
            if bad is None
            else f"FloatingPointError: {row.site.name}: training loss became {mean} at step {bad} of {row.steps} (learning rate too high?)"
            for row, (mean, bad) in zip(rows, means, strict=True)
        ]

    def _note(self, row: Row, reason: str) -> None:
        """Record, and say once per run, why ``row``'s plan trains one row at a time under the batched executor."""
        plan = f"{row.ctx.phase}/{row.plan.label}"
        if plan not in self.sequential_plans:
            self.sequential_plans[plan] = reason
            warn(f"trainer.executor=batched: plan {plan} trains one site at a time: {reason}")

    def record(self) -> dict[str, object]:
        return {"name": self.name, "sequential_plans": dict(self.sequential_plans)}


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
        kind = optimizer_kind(optimizer)
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



def train_group(rows: list[Row], compiled: dict[Any, tuple[Slots, StaticStep]] | None = None) -> list[tuple[float, int | None]]:
    """Train the rows (equal :func:`group_key`) stacked, ``rows[i].steps`` steps of row i, by the step rule.

    Args:
        rows: the group, its first row's site the template whose half's loss and slot modules run every step.
        compiled: train by the compiled static-shape step (:mod:`medfed.federated.stacked`), kept in this cache
            from plan to plan (a new one is a new compilation); None: the eager step, one call per batch shape
            and subset of rows.

    Returns:
        Each row's mean loss over its steps (possibly non-finite: the caller's to refuse) and its first step whose
        loss was not finite (None: every one was finite).

    Raises:
        Whatever a step raises, before anything of the sites' models changed (their data orders have moved).
    """
    sites, plan, steps = [row.site for row in rows], rows[0].plan, [row.steps for row in rows]
    device = sites[0].fabric.device
    with _stacked(rows) as (ops, state, write_back):
        ops.compute = rows[0].compute
        totals = torch.zeros(len(rows), dtype=torch.float32 if device.type == "mps" else torch.float64, device=device)  # summed as Site.train sums
        first_bad = torch.zeros(len(rows), dtype=totals.dtype, device=device)  # each row's first step of a non-finite loss (0: none)
        streams = [site.batches(row.steps, plan.data_order) for site, row in zip(sites, rows)]
        keys = torch.nn.utils.rnn.pad_sequence([row.keys.to(device) for row in rows], batch_first=True)  # (S, max steps)
        if compiled is not None:
            _train_static(_static_step(rows, ops.groups, compiled), rows, state, streams, keys, totals, first_bad)
        else:
            state = _train_eager(ops, rows, state, streams, keys, totals, first_bad)
        for stream in streams:
            next(stream, None)  # run out: a whole last pass ends as Site.train's loop ends it (DataOrders.batches)
        write_back(state)
    read = torch.cat([totals / torch.tensor(steps, dtype=totals.dtype, device=device), first_bad]).tolist()  # the plan's one host read
    return [(mean, int(step) or None) for mean, step in zip(read[:len(rows)], read[len(rows):])]


def _train_eager(
    ops: StackedStep, rows: list[Row], state: StackedState, streams: list[Iterator[Any]], keys: torch.Tensor, totals: torch.Tensor, first_bad: torch.Tensor
) -> StackedState:
    """The rows' steps by the eager stacked step, one call per batch shape and subset of rows that steps; the final state."""
    sites, steps, device = [row.site for row in rows], [row.steps for row in rows], totals.device
    subsets: dict[tuple[int, ...], torch.Tensor] = {}  # the row index tensor of each subset of rows that stepped alone
    for t in range(max(steps)):
        by_shape: dict[tuple[Any, ...], list[tuple[int, Any]]] = {}
        for i in (i for i in range(len(rows)) if t < steps[i]):
            batch = next(streams[i])
            by_shape.setdefault(batch_signature(batch), []).append((i, batch))
        for members in by_shape.values():
            chosen = tuple(i for i, _ in members)
            ops.counted = [sites[i] for i in chosen]
            batch = stack_batches([b for _, b in members])
            if len(members) == len(rows):  # every row: the tensors themselves
                loss, state = step(ops, state, batch, keys[:, t])
                totals += loss.detach().to(totals.dtype)
                continue
            if chosen not in subsets:  # made once per plan and subset: a copy from the host waits for the device
                subsets[chosen] = torch.tensor(chosen, device=device)
            index = subsets[chosen]
            loss, stepped = step(ops, state.rows(index), batch, keys[index, t])
            state.put(index, stepped)
            totals.index_add_(0, index, loss.detach().to(totals.dtype))
        _note_first_bad(first_bad, totals, t)
    return state


@contextmanager
def _stacked(rows: list[Row]) -> Iterator[tuple[StackedStep, StackedState, Any]]:
    """The rows' step and stacked state, the trained parameters' flags and modes set as ``Site.train`` sets them, and
    the function that writes a final state back into the sites; the flags are put back after the block."""
    sites, ctx, plan = [row.site for row in rows], rows[0].ctx, rows[0].plan
    half = sites[0].strategy
    auxiliary = half.auxiliary(ctx, plan)
    state_names = [name for name in half.loss_state if name not in auxiliary and isinstance(getattr(half, name, None), torch.Tensor)]
    modules = [{name: unwrap(slot.module) for name, slot in site.slots.items()} for site in sites]
    stepped = (plan.slot, *plan.also_steps)
    for own in modules:  # what is trained: the plan's part of its slot (its trainable flags), all of also_steps
        own[plan.slot].set_trainable(plan.part)
        for slot in stepped:
            own[slot].train()
    trained = [f"{slot}.{name}" for slot in stepped for name, p in modules[0][slot].named_parameters() if p.requires_grad]
    parameters = [{f"{slot}.{name}": p for slot, module in own.items() for name, p in module.named_parameters()} for own in modules]
    buffers = [{f"{slot}.{name}": b for slot, module in own.items() for name, b in module.named_buffers()} for own in modules]
    optimizers = {slot: [site.slot(slot).optimizer for site in sites] for slot in stepped}
    groups = flat_groups(trained, optimizers, {name: [p[name] for p in parameters] for name in trained})
    stack = lambda tensors, name: torch.stack([t[name].detach() for t in tensors])  # noqa: E731
    state = StackedState(
        [group.flat for group in groups], [group.state for group in groups], [group.hyper for group in groups],
        {name: stack(parameters, name) for name in parameters[0] if name not in trained},
        {name: stack(buffers, name) for name in buffers[0]},
        {name: torch.stack([getattr(site.strategy, name) for site in sites]) for name in state_names},
        {name: torch.stack([getattr(site.strategy, name).detach() for site in sites]) for name in auxiliary},
    )

    @torch.no_grad()
    def write_back(final: StackedState) -> None:
        """Every site gets its own back: parameters, optimiser state, buffers, auxiliary tensors; gradients freed."""
        for i, (site, row) in enumerate(zip(sites, rows)):
            for group, flat, optimizer in zip(groups, final.flat, final.optimizer, strict=True):
                group.write_back(i, row.steps, flat, optimizer)
            for name, value in final.buffers.items():
                buffers[i][name].copy_(value[i])
            for name, value in final.auxiliary.items():
                setattr(site.strategy, name, value[i].clone())
            for slot in stepped:
                site.slot(slot).optimizer.zero_grad(set_to_none=True)

    for site in sites:
        site.plan_key = rows[0].compute
    try:
        yield StackedStep(sites[0], ctx, plan, groups, auxiliary), state, write_back
    finally:
        for site, own in zip(sites, modules):
            site.plan_key = None
            own[plan.slot].set_trainable("all")


def _static_step(rows: list[Row], groups: list[FlatGroup], compiled: dict[Any, tuple[Slots, StaticStep]]) -> StaticStep:
    """The compiled static-shape step of the rows' group and parameter layout, made at its first plan and kept (the
    template's wrapper told each plan's context and plan)."""
    template, ctx, plan = rows[0].site, rows[0].ctx, rows[0].plan
    pads = all(can_pad(unwrap(slot.module)) for slot in template.slots.values())
    layouts = tuple(Layout(tuple(g.names), tuple(g.shapes[name] for name in g.names), g.step_fn) for g in groups)
    key = (tuple(id(row.site) for row in rows), group_key(template, ctx, plan), pads, layouts)
    if key not in compiled:
        wrapper = Slots(template, ctx, plan)
        compiled[key] = wrapper, StaticStep(functional_loss(wrapper, template), template.strategy.auxiliary(ctx, plan), layouts, pads,
                                             template.batch_size, True, template.fabric.device)
    wrapper, step = compiled[key]
    wrapper.ctx, wrapper.plan = ctx, plan
    return step


def _train_static(
    stacked: StaticStep, rows: list[Row], state: StackedState, streams: list[Iterator[Any]], keys: torch.Tensor, totals: torch.Tensor, first_bad: torch.Tensor
) -> None:
    """The rows' steps by the static-shape step: every row in every call, one call a step (or one per batch shape,
    where the models cannot be padded: :mod:`medfed.federated.stacked`)."""
    count, plan = len(rows), rows[0].plan
    last: list[Any] = [None] * count  # each row's latest batch (padded), what it runs on while it takes no step
    masks: list[torch.Tensor | None] = [None] * count
    for t in range(max(row.steps for row in rows)):
        drawn: list[Any] = [None] * count
        for i in (i for i in range(count) if t < rows[i].steps):
            batch = next(streams[i])
            rows[i].site.passes.add(rows[i].compute, plan.data_pass * batch_samples(batch))
            last[i], masks[i] = stacked.padded(batch) if stacked.pads else (batch, None)
            drawn[i] = last[i]
        for members, active in calls(drawn, last, stacked.pads, batch_signature):
            mask = torch.stack(masks) if stacked.pads else None
            stacked.run(state, stack_batches(members), mask, stacked.active(tuple(active)), keys[:, t], totals)
        _note_first_bad(first_bad, totals, t)


def _note_first_bad(first_bad: torch.Tensor, totals: torch.Tensor, t: int) -> None:
    """Mark step ``t + 1`` in ``first_bad`` (S,) for the rows whose summed loss ``totals`` (S,) turned non-finite
    there (a sum stays non-finite; 0: not yet), on the device."""
    first_bad.copy_(torch.where((first_bad == 0) & ~torch.isfinite(totals), t + 1, first_bad))
