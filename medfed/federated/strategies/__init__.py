"""Federated algorithms, one module each, registered by their config name.

The ``strategy`` config group names the algorithm and may hold options for
any registered algorithm under its own name, so switching ``strategy.name``
on the command line never invalidates a config::

    strategy:
      name: pfednet
      pfednet: {lam: 1.0, p: 2}
      fedamp: {sigma: 1.0}

Every subgroup is validated (typos are caught even in the unused ones); the
chosen algorithm gets its subgroup, or its defaults.
"""

from __future__ import annotations

from typing import Any

from medfed.config import parse_options
from medfed.errors import ConfigError
from medfed.federated.strategies.apple import APPLE
from medfed.federated.strategies.base import Strategy
from medfed.federated.strategies.fedamp import FedAMP
from medfed.federated.strategies.fedavg import FedAvg
from medfed.federated.strategies.fedbn import FedBN
from medfed.federated.strategies.local import Local
from medfed.federated.strategies.pfednet import PFedNet
from medfed.federated.strategies.pgfed import PGFed, PGFedMo

STRATEGIES: dict[str, type[Strategy]] = {
    cls.name: cls for cls in (Local, FedAvg, FedBN, PFedNet, FedAMP, APPLE, PGFed, PGFedMo)
}


def strategy_from_config(group: dict[str, Any]) -> tuple[type[Strategy], Any]:
    """The chosen strategy class and its validated options, from the ``strategy`` config group."""
    name = group.get("name")
    if name not in STRATEGIES:
        raise ConfigError(f"config key 'strategy.name' = {name!r}: expected one of {', '.join(sorted(STRATEGIES))}")
    options = strategy_subgroups(group)
    chosen = STRATEGIES[name]
    return chosen, options.get(name, chosen.Options())


def strategy_subgroups(group: dict[str, Any]) -> dict[str, Any]:
    """Every options subgroup the ``strategy`` group holds, validated: ``{strategy name: its Options}``."""
    options = {}
    for key, values in group.items():
        if key == "name":
            continue
        if key not in STRATEGIES:
            raise ConfigError(
                f"unknown config key 'strategy.{key}' (expected 'name' or a strategy's options: {', '.join(sorted(STRATEGIES))})"
            )
        options[key] = parse_options(STRATEGIES[key].Options, values or {}, f"strategy.{key}")
    return options
