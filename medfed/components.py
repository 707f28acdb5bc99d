"""The components a run config names, resolved and validated before any data is read.

:func:`load_config` checks the fixed groups (``federation``, ``trainer``,
``logger``, ``codec``); the groups whose keys depend on a choice are checked
here against the options dataclass of the chosen component:

* ``data`` against the task's ``Options`` (``data.task``),
* ``model`` against the model's ``Options`` (``model.name``, default the
  task's model; a model the task cannot feed is refused),
* ``strategy`` against every named strategy's ``Options`` (``strategy.name``
  and one subgroup per strategy),

and the device is checked against the machine. Everything here is cheap: a
config that fails anywhere fails before a single file is opened, and
:attr:`ResolvedRun.config` is the *full* config, every component default
filled in, which ``--print-config`` prints and ``config.json`` stores (and
which loads back as a config that resolves to itself).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from medfed.config import RunConfig, parse_options, to_plain_dict
from medfed.errors import ConfigError
from medfed.federated.strategies import strategy_from_config, strategy_subgroups
from medfed.models import model_class
from medfed.tasks import Task, get_task


@dataclass(frozen=True)
class ResolvedRun:
    """A validated run: the typed groups, the chosen components and their options.

    Attributes:
        config: the full resolved config as plain containers (every default
            of every component filled in).
        run: the typed fixed groups (``run.data`` etc. are the raw mappings).
        task: the ``data.task`` component.
        data_options: ``task.Options`` instance.
        model_cls: the ``model.name`` class.
        model_options: ``model_cls.Options`` instance.
        strategy_cls: the ``strategy.name`` class.
        strategy_options: ``strategy_cls.Options`` instance.
    """

    config: dict[str, Any]
    run: RunConfig
    task: Task
    data_options: Any
    model_cls: type
    model_options: Any
    strategy_cls: type
    strategy_options: Any

    @property
    def task_inputs(self) -> dict[str, Any]:
        """Keyword arguments of ``task.build_federation`` that the model decides (``target`` where the task offers a choice)."""
        return {"target": self.model_options.target} if self.task.targets else {}


def resolve(cfg: DictConfig) -> ResolvedRun:
    """Validate every component group of ``cfg`` and the device; fill in every default.

    Raises:
        ConfigError: naming the key: an unknown task, model or strategy, an
            unknown or bad option of any of them, a model the task cannot use,
            a device this machine does not have.
    """
    config = to_plain_dict(cfg)
    run: RunConfig = OmegaConf.to_object(cfg)
    task = get_task(_required(config["data"], "task", "data"))
    data_options = parse_options(task.Options, config["data"], "data", ignore=("task",))
    model_name = config["model"].get("name") or task.default_model
    model_cls = model_class(model_name)
    if model_name not in task.models:
        raise ConfigError(
            f"config key 'model.name' = {model_name!r}: the {task.name} task's samples fit {', '.join(task.models)} only"
        )
    model_options = parse_options(model_cls.Options, config["model"], "model", ignore=("name",))
    check_input_size = getattr(model_cls, "check_input_size", None)  # a model whose layers constrain the patch size
    if check_input_size is not None and hasattr(data_options, "patch_size"):
        check_input_size(model_options, data_options.patch_size, "data.patch_size")
    target = getattr(model_options, "target", None)
    if target is not None and target not in task.targets:
        raise ConfigError(f"config key 'model.target' = {target!r}: the {task.name} task labels samples for {', '.join(task.targets) or 'no target choice'}")
    strategy_cls, strategy_options = strategy_from_config(config["strategy"])
    given_strategy_options = strategy_subgroups(config["strategy"])
    check_device(run.trainer.device)
    full = {
        **config,
        "data": {"task": task.name, **dataclasses.asdict(data_options)},
        "model": {"name": model_name, **dataclasses.asdict(model_options)},
        "strategy": {
            "name": strategy_cls.name,
            **{name: dataclasses.asdict(options) for name, options in given_strategy_options.items()},
            strategy_cls.name: dataclasses.asdict(strategy_options),
        },
    }
    return ResolvedRun(full, run, task, data_options, model_cls, model_options, strategy_cls, strategy_options)


def check_device(device: str) -> None:
    """Refuse ``trainer.device`` values this machine cannot run (``cuda``/``gpu`` without CUDA, ``mps`` without MPS)."""
    if device in ("cuda", "gpu") and not torch.cuda.is_available():
        raise ConfigError(
            f"config key 'trainer.device' = {device!r}: this machine has no CUDA GPU that torch "
            f"{torch.__version__} can use; set trainer.device=cpu (or auto)"
        )
    if device == "mps" and not torch.backends.mps.is_available():
        raise ConfigError(f"config key 'trainer.device' = 'mps': Apple MPS is not available here; set trainer.device=cpu (or auto)")


def _required(group: dict[str, Any], key: str, name: str) -> Any:
    if key not in group or group[key] in (None, ""):
        raise ConfigError(f"config key '{name}.{key}' is required")
    return group[key]
