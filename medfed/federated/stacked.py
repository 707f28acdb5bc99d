"""The stacked step as one captured unit: static shapes, a capturable optimiser, compiled with ``torch.compile``.

:func:`medfed.federated.batched.train_group` trains a group of rows (sites, or
the same site in several runs of a grid) with one vmapped step per batch shape
and per subset of rows that still have steps: the shapes change from step to
step, and every change is a new graph to compile. Here every step of a plan
has one shape, so the step is compiled once (and, on CUDA, captured as a CUDA
graph and replayed, ``mode="reduce-overhead"``):

* **padded and masked batches.** Each row's batch is padded to the plan's
  batch size B by repeating its real samples and the step's loss is the mean
  over the real ones (:mod:`medfed.models.padding`): a padded sample changes
  nothing. Rows whose models cannot be padded (a BatchNorm layer mixes a
  batch's samples) keep their batch shapes; a step then runs once per shape
  present, every row in each call.
* **every row, every step.** A row that takes no step at t (its plan is
  shorter, or its batch has the other shape) still runs, on its last batch,
  and its update is thrown away: ``p <- where(active, p', p)`` for its
  parameters, optimiser state (Adam's step count included), buffers and
  auxiliary parameters, its loss not counted. Each row keeps its own number of
  steps.
* **a capturable optimiser.** :func:`masked` wraps
  :func:`~medfed.federated.stacked_optimizers.adam_step` / ``sgd_step``: device tensors
  in, device tensors out (per-row step counts and hyper-parameters), no
  Python branch on a value, every state tensor written in place so it keeps its
  address from replay to replay.

The step (forward, backward, optimiser update of every row, the per-row loss
accumulation) is one function of tensors, :meth:`StaticStep.step`, compiled
as one unit where ``compile`` is set. The functional loss is the template
half's, as in :mod:`medfed.federated.batched`. A :class:`StaticStep` is
kept from round to round by its caller (a new one is a new compilation): it
holds no tensor of a plan, only the layout of the flat parameters it steps.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_map

from medfed.errors import warn
from medfed.federated.compute import batch_samples
from medfed.federated.protocol import Auxiliary
from medfed.models.padding import pad_to, real_samples

Tensors = dict[str, torch.Tensor]
#: torch.compile's backend for the step (the tests trace with ``"eager"``: the same graphs, no code generation)
COMPILE_BACKEND = "inductor"
#: dynamo's recompile limit while compiled steps run: each :class:`StaticStep` is an entry of its own
RECOMPILE_LIMIT = 256
StepFn = Callable[[torch.Tensor, torch.Tensor, Tensors, Tensors], tuple[torch.Tensor, Tensors]]


def masked(step_fn: StepFn) -> Callable[..., tuple[torch.Tensor, Tensors]]:
    """The capturable form of a stacked optimiser step: only the rows ``active`` ``(R,)`` marks step.

    ``masked(adam_step)(param, grad, state, hyper, active)`` is ``adam_step``'s result in the active rows and
    ``param`` and ``state`` unchanged in the others (their step counts included); tensors only, so a CUDA graph
    replays it.
    """

    def step(param: torch.Tensor, grad: torch.Tensor, state: Tensors, hyper: Tensors, active: torch.Tensor) -> tuple[torch.Tensor, Tensors]:
        new, new_state = step_fn(param, grad, state, hyper)
        return _where(active, new, param), {key: _where(active, value, state[key]) for key, value in new_state.items()}

    return step


def _where(active: torch.Tensor, new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """``new`` in the rows ``active`` ``(R,)`` marks, ``old`` in the others (``(R, ...)`` each)."""
    return torch.where(active.reshape(-1, *([1] * (new.ndim - 1))), new, old)


@dataclass(frozen=True)
class Layout:
    """Where one optimiser group's parameters lie in its flat ``(R, D)`` tensor, and its stacked step (static).

    Attributes:
        names: the parameters, in flat order (``"<slot>.<parameter name>"``).
        shapes: each one's shape.
        step_fn: the stacked optimiser step (:func:`~medfed.federated.stacked_optimizers.adam_step` or ``sgd_step``).
    """

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    step_fn: StepFn

    def views(self, flat: torch.Tensor) -> Tensors:
        """Each parameter's ``(R, *shape)`` view of ``flat`` ``(R, D)``."""
        views, start = {}, 0
        for name, shape in zip(self.names, self.shapes):
            size = math.prod(shape)
            views[name] = flat[:, start : start + size].reshape(flat.shape[0], *shape)
            start += size
        return views


class StaticStep:
    """A plan's step over R stacked rows, every step the same shapes (module docstring); compiled with ``compile``.

    :meth:`step` is a pure function of tensors (it writes to none of its inputs, so a CUDA graph of it replays
    with no input to keep at a fixed address); :meth:`run` calls it, compiled where asked, and copies what it
    returns into the plan's tensors.

    Args:
        loss: ``loss(theta, frozen, buffers, state, aux, batch, key) -> scalar``, one row's loss (the template
            half's, through ``functional_call``); vmapped over the rows.
        auxiliary: the half's auxiliary parameters and their rules (stepped after the optimisers).
        layouts: the trained parameters' optimiser groups (:class:`Layout`), as the plan's flat tensors hold them.
        pads: pad ragged batches (every model the loss runs can be padded: :func:`~medfed.models.padding.can_pad`).
        batch_size: B, the plan's batch size.
        compile: compile :meth:`step` (``torch.compile``; on CUDA with CUDA graphs, ``mode="reduce-overhead"``).
    """

    def __init__(
        self,
        loss: Callable[..., torch.Tensor],
        auxiliary: dict[str, Auxiliary],
        layouts: tuple[Layout, ...],
        pads: bool,
        batch_size: int,
        compile: bool,
        device: torch.device,
    ) -> None:
        self.loss = loss
        self.auxiliary = auxiliary
        self.layouts = layouts
        self.pads = pads
        self.batch_size = batch_size
        self.device = device
        gradient = torch.func.grad_and_value(self._row_loss, argnums=(0, 4))
        self._gradient = torch.func.vmap(gradient, in_dims=(0, 0, 0, 0, 0, 0, 0, 0 if pads else None), randomness="error")
        self._compiled = None
        if compile:  # on CUDA, captured as a CUDA graph and replayed
            graphs = {"mode": "reduce-overhead"} if device.type == "cuda" and COMPILE_BACKEND == "inductor" else {}
            self._compiled = torch.compile(self.step, backend=COMPILE_BACKEND, dynamic=False, **graphs)
            # one compiled entry per StaticStep (its guards hold the instance): room for a grid's groups
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
        #: why the step runs eagerly although asked to compile (None: it compiled, or was not asked to)
        self.not_compiled: str | None = None
        self._masks: dict[int, torch.Tensor] = {}
        self._active: dict[tuple[bool, ...], torch.Tensor] = {}

    def _row_loss(self, theta: Tensors, frozen: Tensors, buffers: Tensors, state: Tensors, aux: Tensors, batch: Any, key: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        if mask is None:
            return self.loss(theta, frozen, buffers, state, aux, batch, key)
        with real_samples(mask):
            return self.loss(theta, frozen, buffers, state, aux, batch, key)

    def step(
        self,
        flats: list[torch.Tensor],
        states: list[Tensors],
        hypers: list[Tensors],
        frozen: Tensors,
        buffers: Tensors,
        state: Tensors,
        aux: Tensors,
        batch: Any,
        mask: torch.Tensor | None,
        active: torch.Tensor,
        keys: torch.Tensor,
    ) -> tuple[list[torch.Tensor], list[Tensors], Tensors, Tensors, torch.Tensor]:
        """One step of every row ``active`` marks: the new flat parameters and optimiser states (one per layout),
        buffers and auxiliary parameters, and each row's loss (0 in the inactive rows).

        Args:
            flats, states, hypers: per layout, ``(R, D)`` parameters, their optimiser state and options.
            batch: ``(R, B, ...)`` leaves, one batch a row (an inactive row's is any batch of the shape).
            mask: ``(R, B)`` bool, the real samples (None: every sample is real).
            active: ``(R,)`` bool, the rows that take this step.
            keys: ``(R,)`` int64, each row's dropout key of the step.
        """
        moved = {name: value.clone() for name, value in buffers.items()}  # the step's own copies for BatchNorm to move
        theta = {name: view for layout, flat in zip(self.layouts, flats) for name, view in layout.views(flat).items()}
        (grads, aux_grads), loss = self._gradient(theta, frozen, moved, state, aux, batch, keys, mask)
        new_flats, new_states = [], []
        for layout, flat, optimiser_state, hyper in zip(self.layouts, flats, states, hypers):
            grad = torch.cat([grads[name].reshape(grads[name].shape[0], -1) for name in layout.names], dim=1)
            new, new_state = masked(layout.step_fn)(flat.detach(), grad, optimiser_state, hyper, active)
            new_flats.append(new)
            new_states.append(new_state)
        new_aux = {  # after the optimisers, as Site.train steps them
            name: _where(active, torch.func.vmap(rule.step)(aux[name], aux_grads[name]), aux[name]) for name, rule in self.auxiliary.items()
        }
        new_buffers = {name: _where(active, moved[name], value) for name, value in buffers.items()}
        return new_flats, new_states, new_buffers, new_aux, torch.where(active, loss.detach().to(torch.float64), torch.zeros_like(loss, dtype=torch.float64))

    def run(self, state: Any, batch: Any, mask: torch.Tensor | None, active: torch.Tensor, keys: torch.Tensor, totals: torch.Tensor) -> None:
        """:meth:`step` (compiled where asked) on a plan's stacked tensors, its results copied into them.

        ``state``: the plan's :class:`~medfed.federated.stacked_step.StackedState` (its ``flat``, ``optimizer`` and
        ``hyper`` in :attr:`layouts` order); ``totals`` ``(R,)`` += each active row's loss. A step torch.compile
        cannot capture (a graph break it cannot trace through) runs eagerly from then on, said once (:attr:`not_compiled`).
        """
        arguments = (state.flat, state.optimizer, state.hyper, state.frozen, state.buffers, state.loss_state, state.auxiliary, batch, mask, active, keys)
        if self._compiled is None:
            out = self.step(*arguments)
        else:
            if self.device.type == "cuda":  # the last replay's outputs were copied out: its graph's memory may be reused
                torch.compiler.cudagraph_mark_step_begin()
            try:
                out = self._compiled(*arguments)
            except Exception as error:  # the eager step raises again if the loss itself is at fault
                self._compiled = None
                self.not_compiled = f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}"
                warn(f"trainer.compile: a stacked step could not be compiled ({self.not_compiled}); it runs eagerly")
                out = self.step(*arguments)
        new_flats, new_states, new_buffers, new_aux, losses = out
        with torch.no_grad():
            for flat, optimiser_state, new_flat, new_state in zip(state.flat, state.optimizer, new_flats, new_states):
                flat.copy_(new_flat)
                for key, value in new_state.items():
                    optimiser_state[key].copy_(value)
            for name, value in new_buffers.items():
                state.buffers[name].copy_(value)
            for name, value in new_aux.items():
                state.auxiliary[name].copy_(value)
            totals.add_(losses.to(totals.dtype))

    # ------------------------------------------------------------------------------------------- batches
    def mask(self, real: int) -> torch.Tensor:
        """``(B,)`` bool: the first ``real`` samples of a padded batch are real (made once per count, on the device)."""
        if real not in self._masks:
            self._masks[real] = torch.arange(self.batch_size, device=self.device) < real
        return self._masks[real]

    def active(self, rows: tuple[bool, ...]) -> torch.Tensor:
        """``(R,)`` bool on the device, made once per pattern (a copy from the host waits for the device)."""
        if rows not in self._active:
            self._active[rows] = torch.tensor(rows, device=self.device)
        return self._active[rows]

    def padded(self, batch: Any) -> tuple[Any, torch.Tensor]:
        """``batch`` (tensors ``(b, ...)``, in any structure) padded to B, and its ``(B,)`` real-sample mask."""
        return tree_map(lambda tensor: pad_to(tensor, self.batch_size), batch), self.mask(batch_samples(batch))


def calls(batches: list[Any | None], last: list[Any], pads: bool, signature: Callable[[Any], Any]) -> list[tuple[list[Any], list[bool]]]:
    """The stacked calls of one step: ``[(one batch per row, which rows take the step)]``.

    ``batches[i]`` is row i's batch at this step (None: it takes none); ``last[i]`` its latest batch (what an
    inactive row runs on). With ``pads`` one call (the batches padded by the caller); else one call per batch
    shape present, each row that has another shape (or no step) running the shape's first batch, inactive.
    """
    if pads:
        return [([batch if batch is not None else last[i] for i, batch in enumerate(batches)], [batch is not None for batch in batches])]
    shapes: dict[Any, list[int]] = {}
    for i, batch in enumerate(batches):
        if batch is not None:
            shapes.setdefault(signature(batch), []).append(i)
    out = []
    for members in shapes.values():
        filler = batches[members[0]]
        rows = [batches[i] if i in members else (last[i] if last[i] is not None and signature(last[i]) == signature(filler) else filler) for i in range(len(batches))]
        out.append((rows, [i in members for i in range(len(batches))]))
    return out

