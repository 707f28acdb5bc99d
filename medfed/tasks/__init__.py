"""Tasks: how a data set becomes a federation, and which model serves it by default.

A task is the ``data`` config group: ``data.task`` picks one, the remaining
keys are that task's ``Options`` (declared, with the models each task's
samples fit, in the torch-free :mod:`medfed.options.tasks`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from medfed.data.federation import Federation
from medfed.options.tasks import task_spec
from medfed.tasks import brats, clinical, luna16


@dataclass(frozen=True)
class Task:
    """A task: its :class:`~medfed.options.tasks.TaskSpec` (name, ``Options``, models, regions) and how it builds its data."""

    name: str
    Options: type
    build_federation: Callable[..., Federation]
    """``build_federation(options, federation: FederationConfig, seed, progress=True) -> Federation``"""
    build_site: Callable[..., Federation]
    """``build_site(options, federation, seed, site_index, data_root, progress=True) -> Federation`` of one
    site built from its own data alone (a deployed site, :mod:`medfed.deploy`)."""
    default_model: str
    models: tuple[str, ...]
    """The model names whose input the task's samples fit (``default_model`` first)."""
    regions: tuple[str, ...] = ()
    """The ``task.regions`` values the task can label samples for (``build_federation(..., regions=...)``);
    empty: one fixed target, no ``regions`` argument."""


TASKS: dict[str, Task] = {
    module.NAME: Task(
        spec.name, spec.Options, module.build_federation, module.build_site, spec.default_model, spec.models, spec.regions
    )
    for module in (brats, luna16, clinical)
    for spec in (task_spec(module.NAME),)
}


def get_task(name: str) -> Task:
    """The task registered as ``name`` (config key ``data.task``)."""
    return TASKS[task_spec(name).name]
