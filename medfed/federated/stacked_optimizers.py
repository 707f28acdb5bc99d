"""Functional twins of torch.optim's Adam and SGD over stacked rows, and the trained parameters flattened for them.

The stacked executor (:mod:`medfed.federated.batched`) steps every row's
copy of a parameter at once: :func:`adam_step` and :func:`sgd_step` are
torch.optim's updates over ``(S, *shape)`` tensors, with per-row step counts
and hyper-parameters (rows may come from runs with other learning rates);
:class:`FlatGroup` lays the parameters one optimiser steps alike out as one
``(S, D)`` tensor. Everything is a function of tensors: no host read.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

#: the optimisers the batched step reproduces, and the ``param_groups`` options they must leave at these values
SUPPORTED_OPTIMIZERS: dict[type, dict[str, Any]] = {
    torch.optim.Adam: {"amsgrad": False, "maximize": False, "decoupled_weight_decay": False},
    torch.optim.SGD: {"maximize": False},
}



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


def optimizer_kind(optimizer: torch.optim.Optimizer) -> type | None:
    """The supported optimiser class ``optimizer`` is (Fabric's wrapper subclasses it), or None."""
    return next((cls for cls in SUPPORTED_OPTIMIZERS if isinstance(optimizer, cls)), None)


def _options(optimizer: torch.optim.Optimizer, param: nn.Parameter) -> dict[str, float]:
    """The options of ``param``'s group in ``optimizer``, as :func:`adam_step` / :func:`sgd_step` name them."""
    group = next(group for group in optimizer.param_groups if any(p is param for p in group["params"]))
    if optimizer_kind(optimizer) is torch.optim.Adam:
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


class FlatGroup:
    """Trained parameters that one optimiser steps alike at every site, as one flat ``(S, D)`` tensor and its state.

    Parameters of the same slot, optimiser parameter group and per-site state
    history (Adam's step counts, SGD's momentum buffers present or not) are
    stepped by one call of :func:`adam_step` / :func:`sgd_step` over ``(S, D)``
    instead of one call per parameter; the loss sees them as views of it. The
    group holds the layout and the sites' values at the start (``flat``,
    ``state``, ``hyper``); the stacked step carries the values from there.

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
        self.step_fn = _STEPS[optimizer_kind(optimizers[0])]
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

    def step(
        self, flat: torch.Tensor, state: dict[str, torch.Tensor], hyper: dict[str, torch.Tensor], grads: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """One optimiser step of the rows of ``flat`` ``(S', D)`` (their optimiser ``state`` and options ``hyper``) on their
        gradients ``grads`` (``(S', *shape)`` each): the stepped rows and their state."""
        grad = torch.cat([grads[name].reshape(grads[name].shape[0], -1) for name in self.names], dim=1)
        return self.step_fn(flat, grad, state, hyper)

    @torch.no_grad()
    def write_back(self, site: int, steps: int, flat: torch.Tensor, state: dict[str, torch.Tensor]) -> None:
        """Copy row ``site`` of ``flat`` and ``state`` (it took ``steps`` steps) into that site's own parameters and
        optimiser state, as torch.optim keeps them."""
        optimizer = self.optimizers[site]
        for name, (a, b) in self.bounds.items():
            param = self.owned[name][site]
            param.copy_(flat[site, a:b].reshape(param.shape))
            if not state:
                continue
            if self.step_fn is adam_step:
                values = {
                    # a float32 scalar on the CPU, where torch.optim.Adam keeps it (copied into a capturable one's)
                    "step": torch.tensor(float(self.steps_before[site] + steps), dtype=torch.float32, device="cpu"),
                    "exp_avg": state["exp_avg"][site, a:b].reshape(param.shape),
                    "exp_avg_sq": state["exp_avg_sq"][site, a:b].reshape(param.shape),
                }
            else:
                values = {"momentum_buffer": state["momentum_buffer"][site, a:b].reshape(param.shape)}
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


def flat_groups(trained_names: list[str], optimizers_of: dict[str, list[torch.optim.Optimizer]], owned: dict[str, list[nn.Parameter]]) -> list[FlatGroup]:
    """The trained parameters in :class:`FlatGroup` s: by slot, optimiser parameter group and per-site state history."""
    keyed_names: dict[tuple[Any, ...], list[str]] = {}
    for name in trained_names:
        slot = name.split(".", 1)[0]
        optimizers = optimizers_of[slot]
        params = owned[name]
        group = next(k for k, g in enumerate(optimizers[0].param_groups) if any(p is params[0] for p in g["params"]))
        history = tuple(
            (_step_count(o, p), o.state.get(p, {}).get("momentum_buffer") is not None) for o, p in zip(optimizers, params)
        )
        keyed_names.setdefault((slot, group, history), []).append(name)
    return [FlatGroup(names, owned, optimizers_of[key[0]]) for key, names in keyed_names.items()]
