"""Each strategy's key hyperparameters and a small default search space, for ``compare --tune``: plain data, no torch.

A *space* maps config keys to the values tried, every combination of them
once (a grid search). Every strategy's space holds the local learning rate
(:data:`LEARNING_RATE`) and its own key hyperparameters
(:data:`STRATEGY_SPACES`); :func:`default_space` joins them. A value is a
config value (``0.1``, ``2``, ``"model"``) or a *relative* one, ``"x<f>"``:
``f`` times the run config's own value of that key (``"x3"`` for a config
with ``model.lr: 0.003`` tries 0.009), so one space serves tasks whose
learning rates differ tenfold.

The spaces are small on purpose (3-9 configurations a strategy, 18 for
pFedNet's lam x graph k): around the published or shipped value, a
decade (or a factor 3) either side. ``compare --tune-space KEY=V1,V2,...``
replaces a key's values (``model.lr=x1`` tunes no learning rate); the
strategies whose keys are not named keep these. tests/test_tune.py checks that
every key names an option of its strategy.
"""

from __future__ import annotations

LEARNING_RATE: dict[str, tuple[object, ...]] = {"model.lr": ("x0.3", "x1", "x3")}
"""Every strategy's local learning rate: a third of, the same as and three times the run config's."""

STRATEGY_SPACES: dict[str, dict[str, tuple[object, ...]]] = {
    "fedprox": {"strategy.fedprox.mu": (0.01, 0.1, 1.0)},
    "ditto": {"strategy.ditto.lam": (0.01, 0.1, 1.0)},
    "l2gd": {"strategy.l2gd.mixing": (0.25, 0.5, 0.75)},
    "pfedme": {"strategy.pfedme.lam": (5.0, 15.0)},
    "ifca": {"strategy.ifca.clusters": (2, 3)},
    "fpfc": {"strategy.fpfc.lam": (0.2, 0.4, 0.8)},
    "fedamp": {"strategy.fedamp.lam": (0.001, 0.01, 0.1)},
    "apple": {"strategy.apple.mu": (0.01, 0.1, 1.0)},
    "pgfed": {"strategy.pgfed.mu": (0.01, 0.1, 1.0)},
    "pgfedmo": {"strategy.pgfedmo.mu": (0.01, 0.1, 1.0)},
    "pfednet": {"strategy.pfednet.lam": (0.03, 0.1, 0.3), "strategy.pfednet.knn_k": (1, 2)},
}
"""The strategies' own key hyperparameters (a strategy not named here tunes its learning rate only).

FedAMP's proximal weight is lam / (2 alpha): its lam alone moves it. pFedNet's lam is a fraction of the
fusion threshold (``lam_scale: fusion``), 0.1 the shipped value."""


def default_space(strategy: str) -> dict[str, tuple[object, ...]]:
    """``strategy``'s default search space: its own keys (:data:`STRATEGY_SPACES`), then the learning rate."""
    return {**STRATEGY_SPACES.get(strategy, {}), **LEARNING_RATE}
