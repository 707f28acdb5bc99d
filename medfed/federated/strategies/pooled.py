"""Pooled training: the centralised reference, one model trained on every site's training data together.

NOT a federated method: the reference row FLamby reports ("Pooled"; du
Terrail et al., NeurIPS 2022 Datasets and Benchmarks), the model a
hospital consortium would get by putting its training data in one place.
The strategy declares ``pools_data``, and the run (:meth:`medfed.assembly.RunAssembly.sites`)
gives site ``POOL_SITE`` (:mod:`medfed.data.pooling`) the union of all the
sites' training splits; that is the only place the rule "data never leave a
site" is broken, and results.json and the printed table say so.

Each round the pool site trains its one model on the union for
``trainer.local_epochs`` passes (its own data order generator, its own
optimiser state kept across rounds: exactly a centralised training run of
``rounds x local_epochs`` epochs) and replies the model with its
floating-point buffers; the server hands that model to every site through
the normal delivery, and every site is evaluated with it on its own test
split. The other sites train nothing and send nothing. The server is
FedAvg's over the one reply that carries a model (the sample-weighted
average of one model is that model, bit for bit).

A round in which the pool site does not take part (``federation.participation``
< 1) or fails trains nothing: the sites keep the last model.
"""

from __future__ import annotations

from medfed.data.pooling import POOL_SITE
from medfed.federated.protocol import Payload, RoundContext, SiteView, TrainingPlan
from medfed.federated.strategies.base import Strategy
from medfed.federated.strategies.fedavg import FedAvg, FedAvgServer, FedAvgSite


class PooledServer(FedAvgServer):
    """Keeps the pool site's last model and delivers it to every site."""

    def aggregate(self, ctx: RoundContext, replies: dict[int, Payload]) -> None:
        trained = {index: reply for index, reply in replies.items() if reply}
        if trained:
            super().aggregate(ctx, trained)

    def reply_keys(self, ctx: RoundContext, site_index: int) -> tuple[frozenset[str], ...]:
        """FedAvg's reply from the pool site, an empty one from every other site."""
        return super().reply_keys(ctx, site_index) if site_index == POOL_SITE else (frozenset(),)


class PooledSite(FedAvgSite):
    """The pool site trains on the union and replies its model; every other site only loads the delivery."""

    @property
    def holds_pool(self) -> bool:
        return self.index == POOL_SITE

    def plan(self, ctx: RoundContext) -> tuple[TrainingPlan, ...]:
        return (TrainingPlan(),) if self.holds_pool else ()

    def reply(self, site: SiteView, ctx: RoundContext) -> Payload:
        return super().reply(site, ctx) if self.holds_pool else {}


class Pooled(Strategy):
    dp_sgd_refusal = "it pools the raw training data at one site: there is no per-hospital guarantee to give"
    client_dp_refusal = "not federated: the raw data are pooled"
    secure_aggregation_refusal = "not federated: the raw data are pooled"
    robust_aggregation_refusal = "not federated: one site trains on the pooled data"
    coded_keys = FedAvg.coded_keys
    pools_data = True
    Server = PooledServer
    Site = PooledSite
