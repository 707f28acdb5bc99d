"""Patch evaluation stacked over sites: the sites' test batches through one vmapped forward (the batched executor's).

:func:`evaluate_group` gives each site of a group (equal :func:`evaluation_key`)
the metrics :meth:`~medfed.federated.site.Site.evaluate` would give it alone,
its k-th test batch run beside the other sites' k-th batches as one
``vmap(functional_call(test_outputs))`` with each site's parameters and buffers.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from medfed.federated.site import Site
from medfed.federated.stacked_step import batch_signature
from medfed.models.base import unwrap


class TestOutputs(nn.Module):
    """A model's :meth:`~medfed.models.base.FederatedModule.test_outputs` as ``forward``, for ``functional_call``."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module.test_outputs(x)


def evaluation_key(site: Site) -> tuple[Any, ...]:
    """What sites evaluated together share: the evaluated module's type, tensor shapes, modes and per-site constants."""
    return (*unwrap(site.module).shape_key(), site.test_loader.batch_size)


def evaluate_group(sites: list[Site], count: Callable[[Site, Any], None]) -> list[dict[str, float]]:
    """Each site's metrics over its whole test split, the group's forward passes stacked (equal :func:`evaluation_key`).

    The k-th test batches of the sites that have one (grouped by shape: a split's last batch may be smaller) run as
    one vmapped ``test_outputs`` with each site's parameters and buffers, in the run's precision; each site's metrics
    take its own outputs (:meth:`~medfed.models.base.FederatedModule.update_test_metrics`), as
    :meth:`~medfed.federated.site.Site.evaluate` gives them. ``count(site, batch)`` counts each batch's passes.
    """
    template = sites[0]
    modules = [unwrap(site.module) for site in sites]
    for module in modules:
        module.eval()
    wrapper = TestOutputs(modules[0])
    tensors = [{f"module.{name}": t for name, t in itertools.chain(m.named_parameters(), m.named_buffers())} for m in modules]
    stacked = {name: torch.stack([t[name].detach() for t in tensors]) for name in tensors[0]}

    def outputs(state: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(wrapper, state, (x,), strict=True)

    forward = torch.func.vmap(outputs)
    iterators = {i: iter(site.test_loader) for i, site in enumerate(sites)}
    everyone = torch.arange(len(sites), device=template.fabric.device)
    with torch.no_grad():
        while iterators:
            by_shape: dict[tuple[Any, ...], list[tuple[int, Any]]] = {}
            for i in list(iterators):
                batch = next(iterators[i], None)
                if batch is None:
                    del iterators[i]
                    continue
                batch = template.fabric.to_device(batch)
                by_shape.setdefault(batch_signature(batch), []).append((i, batch))
            for members in by_shape.values():
                rows = everyone if len(members) == len(sites) else everyone[[i for i, _ in members]]
                with template.fabric.autocast():
                    out = forward({name: value[rows] for name, value in stacked.items()}, torch.stack([batch[0] for _, batch in members]))
                for j, (i, batch) in enumerate(members):
                    modules[i].update_test_metrics(out[j], batch[1])
                    count(sites[i], batch)
    return [module.test_results() for module in modules]
