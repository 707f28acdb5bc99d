"""Federated algorithms, one module each, registered by their config name.

:data:`STRATEGIES` is the registry: the ``strategy.name`` choices, the
config comments and the registry-driven tests all derive from it. A new
algorithm is one module plus one entry in :data:`REGISTERED` and its line in
:data:`medfed.components.STRATEGY_CATALOG` (which ``python -m medfed
strategies`` and the README's list print without importing torch; a test
checks that the two agree), and its options dataclass in
:data:`medfed.options.strategies.STRATEGY_OPTIONS`.

The ``strategy`` config group names the algorithm and may hold options for
any registered algorithm under its own name, so switching ``strategy.name``
on the command line never invalidates a config::

    strategy:
      name: pfednet
      pfednet: {lam: 1.0, p: 2}
      fedamp: {sigma: 1.0}

Every subgroup is validated (typos are caught even in the unused ones); the
chosen algorithm gets its subgroup, or its defaults. The options are declared
in the torch-free :mod:`medfed.options.strategies` (one dataclass per
algorithm, set as its ``Options``), so a config is checked before torch is imported.
"""

from __future__ import annotations

from typing import Any

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
from medfed.options.strategies import parse_strategy_group

#: every algorithm, in the order they are listed
REGISTERED: tuple[type[Strategy], ...] = (
    Local, FedAvg, FedBN, FedProx, FedPer, FedRep, FedRoD, FedBABU, Ditto, APFL, L2GD, PFedMe, SuPerFed, IFCA, FPFC,
    FedAMP, APPLE, PGFed, PGFedMo, PFedNet, Pooled,
)
STRATEGIES: dict[str, type[Strategy]] = {cls.name: cls for cls in REGISTERED}


def strategy_from_config(group: dict[str, Any]) -> tuple[type[Strategy], Any]:
    """The chosen strategy class and its validated options, from the ``strategy`` config group (:func:`~medfed.options.strategies.parse_strategy_group`)."""
    name, options, _ = parse_strategy_group(group)
    return STRATEGIES[name], options
