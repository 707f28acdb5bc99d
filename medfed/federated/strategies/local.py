"""Local training: every site trains its own model alone; nothing is exchanged."""

from __future__ import annotations

from medfed.federated.strategies.base import Strategy


class Local(Strategy):
    """The lower reference: no federation (the base halves' defaults)."""

    client_dp_refusal = "nothing leaves a site"
    secure_aggregation_refusal = "nothing leaves a site"
    robust_aggregation_refusal = "nothing leaves a site"
