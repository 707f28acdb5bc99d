"""Federated algorithms, one module each, registered by their config name."""

from __future__ import annotations

from medfed.errors import ConfigError
from medfed.federated.strategies.base import Strategy
from medfed.federated.strategies.fedavg import FedAvg
from medfed.federated.strategies.local import Local
from medfed.federated.strategies.pfednet import PFedNet

STRATEGIES: dict[str, type[Strategy]] = {cls.name: cls for cls in (Local, FedAvg, PFedNet)}


def strategy_class(name: str) -> type[Strategy]:
    """The strategy registered as ``name`` (config key ``strategy.name``)."""
    if name not in STRATEGIES:
        raise ConfigError(f"config key 'strategy.name' = {name!r}: expected one of {', '.join(sorted(STRATEGIES))}")
    return STRATEGIES[name]
