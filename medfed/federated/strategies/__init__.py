"""Federated algorithms, one module each, each registered by one line in :data:`medfed.options.strategies.STRATEGY_SPECS`.

The framework never imports this folder: it writes against
:mod:`medfed.federated.protocol` and loads a strategy's class from its
registration line (:meth:`~medfed.options.strategies.StrategySpec.load`).
:func:`registered` loads them all (for the registry-driven tests, the
benchmarks and the generated privacy table).

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

from medfed.federated.strategies.base import Strategy
from medfed.options.strategies import STRATEGY_SPECS, parse_strategy_group, strategy_spec


def registered() -> dict[str, type[Strategy]]:
    """Every registered strategy's class by name, in the registry's order (imports every one of them)."""
    return {spec.name: spec.load() for spec in STRATEGY_SPECS}


def strategy_from_config(group: dict[str, Any]) -> tuple[type[Strategy], Any]:
    """The chosen strategy class and its validated options, from the ``strategy`` config group (:func:`~medfed.options.strategies.parse_strategy_group`)."""
    name, options, _ = parse_strategy_group(group)
    return strategy_spec(name).load(), options
