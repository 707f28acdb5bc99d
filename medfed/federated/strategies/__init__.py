"""Federated algorithms, one module each, registered by their config name.

:data:`STRATEGIES` is the registry: the ``strategy.name`` choices, the
config comments and the registry-driven tests all derive from it. A new
algorithm is one module plus one entry in :data:`REGISTERED` and its line in
:data:`medfed.components.STRATEGY_CATALOG` (which ``python -m medfed
strategies`` and the README's list print without importing torch; a test
checks that the two agree).

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

from medfed.config import did_you_mean, parse_options
from medfed.errors import ConfigError
from medfed.federated.strategies.apfl import APFL
from medfed.federated.strategies.apple import APPLE
from medfed.federated.strategies.base import Strategy
from medfed.federated.strategies.ditto import Ditto
from medfed.federated.strategies.fedamp import FedAMP
from medfed.federated.strategies.fedavg import FedAvg
from medfed.federated.strategies.fedbabu import FedBABU
from medfed.federated.strategies.fedbn import FedBN
from medfed.federated.strategies.fedper import FedPer
from medfed.federated.strategies.fedprox import FedProx
from medfed.federated.strategies.fedrep import FedRep
from medfed.federated.strategies.fedrod import FedRoD
from medfed.federated.strategies.fpfc import FPFC
from medfed.federated.strategies.ifca import IFCA
from medfed.federated.strategies.l2gd import L2GD
from medfed.federated.strategies.local import Local
from medfed.federated.strategies.pfedme import PFedMe
from medfed.federated.strategies.pfednet import PFedNet
from medfed.federated.strategies.pgfed import PGFed, PGFedMo
from medfed.federated.strategies.pooled import Pooled
from medfed.federated.strategies.superfed import SuPerFed

#: every algorithm, in the order they are listed
REGISTERED: tuple[type[Strategy], ...] = (
    Local, FedAvg, FedBN, FedProx, FedPer, FedRep, FedRoD, FedBABU, Ditto, APFL, L2GD, PFedMe, SuPerFed, IFCA, FPFC,
    FedAMP, APPLE, PGFed, PGFedMo, PFedNet, Pooled,
)
STRATEGIES: dict[str, type[Strategy]] = {cls.name: cls for cls in REGISTERED}


def strategy_from_config(group: dict[str, Any]) -> tuple[type[Strategy], Any]:
    """The chosen strategy class and its validated options, from the ``strategy`` config group."""
    name = group.get("name")
    if name not in STRATEGIES:
        close = did_you_mean(name, sorted(STRATEGIES)) if isinstance(name, str) else ""
        raise ConfigError(f"config key 'strategy.name' = {name!r}: expected one of {', '.join(sorted(STRATEGIES))}{close}")
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
                f"unknown config key 'strategy.{key}'{did_you_mean(key, ['name', *sorted(STRATEGIES)], 'strategy.')} "
                f"(expected 'name' or a strategy's options: {', '.join(sorted(STRATEGIES))})"
            )
        options[key] = parse_options(STRATEGIES[key].Options, values or {}, f"strategy.{key}")
    return options
