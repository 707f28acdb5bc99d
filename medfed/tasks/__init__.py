"""Tasks: how a data set becomes a federation, and which model serves it by default.

A task is the ``data`` config group: ``data.task`` picks one, the remaining
keys are that task's ``Options``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from medfed.data.federation import Federation
from medfed.errors import ConfigError
from medfed.tasks import brats, clinical, luna16


@dataclass(frozen=True)
class Task:
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
    targets: tuple[str, ...] = ()
    """The ``model.target`` values the task can label samples for (``build_federation(..., target=...)``);
    empty: one fixed target, no ``target`` argument."""


TASKS: dict[str, Task] = {
    module.NAME: Task(
        module.NAME, module.Options, module.build_federation, module.build_site, module.DEFAULT_MODEL, (module.DEFAULT_MODEL,),
        getattr(module, "TARGETS", ()),
    )
    for module in (brats, luna16, clinical)
}


def get_task(name: str) -> Task:
    """The task registered as ``name`` (config key ``data.task``)."""
    if name not in TASKS:
        raise ConfigError(f"config key 'data.task' = {name!r}: expected one of {', '.join(sorted(TASKS))}")
    return TASKS[name]

