"""FedAvg (McMahan et al. 2017): one global model, sample-weighted averaging.

Every parameter *and* every floating-point buffer (BatchNorm running means
and variances) is averaged, weighted by the sites' training-set sizes n_i::

    w_{t+1} = sum_i n_i w_i / sum_i n_i        (parameters, vector "all")
    b_{t+1} = sum_i n_i b_i / sum_i n_i        (float buffers, vector "buffers")

over the participants i of round t; the personalisation split is ignored.
Integer buffers (BatchNorm's ``num_batches_tracked``) are not averaged and
stay at their site: each counts its own site's steps, and BatchNorm reads it
only without a momentum (medfed's models all set one). Sites are evaluated
with the global model delivered at the end of each round.

On the wire the parameters are a coded model vector (``coded_keys``), the
buffers travel dense: they are small (2,784 floats against 98,466
parameters in the LUNA16 DenseNet), and a lossy code of a change could turn a
running variance negative.

The family's members change what travels by declaring other parts of the
model once, as the strategy's :attr:`FedAvg.averaged` (:class:`Averaged`),
which both halves take (FedBN leaves out the BatchNorm layers; FedPer and
FedRep average the body and no buffers, LG-FedAvg the head), and where the
global model lives at a site that holds several models in the site half's
``global_slot`` (Ditto, APFL).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from medfed.federated.protocol import MODEL, NUM_SAMPLES, SETUP, Payload, RoundContext, SecureSum, SiteView, num_samples
from medfed.federated.strategies.base import ServerHalf, SiteHalf, Strategy
from medfed.models.split import ROLES


@dataclass(frozen=True)
class Averaged:
    """What a FedAvg-family strategy averages, sends and delivers: parts of the model (:data:`~medfed.models.split.PARTS`,
    or the role names ``"body"`` / ``"head"``, :data:`~medfed.models.split.ROLES`).

    Attributes:
        parameters: the parameter vector averaged (a coded model vector on the wire, under its own name).
        buffers: the floating-point buffer vector averaged (dense on the wire); None: buffers stay at their site.
    """

    parameters: str = "all"
    buffers: str | None = "buffers"

    @property
    def parts(self) -> tuple[str, ...]:
        """The averaged vectors' names, parameters first."""
        return (self.parameters,) if self.buffers is None else (self.parameters, self.buffers)


class FedAvgServer(ServerHalf):
    """Holds the global model and buffers; averages the replies weighted by the sites' sample counts.

    Args:
        averaged: what is averaged (the strategy's :attr:`FedAvg.averaged`); the rest as :class:`ServerHalf`'s.
    """

    state_fields = ("global_model", "global_buffers")

    def __init__(self, *args: Any, averaged: Averaged = Averaged(), **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.averaged = averaged

    def setup(self, ctx: RoundContext, initial: Payload, replies: dict[int, Payload]) -> None:
        self.global_model = initial[self.averaged.parameters].clone()
        self.global_buffers = None if self.averaged.buffers is None else initial[self.averaged.buffers].clone()

    def aggregate(self, ctx: RoundContext, replies: dict[int, Payload]) -> None:
        weights = [float(reply[NUM_SAMPLES]) for reply in replies.values()]
        self.global_model = self.aggregation([reply[self.averaged.parameters] for reply in replies.values()], weights, self.global_model)
        if self.averaged.buffers is not None:
            self.global_buffers = self.aggregation([reply[self.averaged.buffers] for reply in replies.values()], weights, self.global_buffers)

    def reply_keys(self, ctx: RoundContext, site_index: int) -> tuple[frozenset[str], ...]:
        """The averaged vectors and the sample count; nothing at setup."""
        if ctx.phase == SETUP:
            return super().reply_keys(ctx, site_index)
        return (frozenset({*self.averaged.parts, NUM_SAMPLES}),)

    def deliver(self, ctx: RoundContext, site_index: int) -> Payload:
        return self.global_payload()

    def global_payload(self) -> Payload:
        """The averaged vectors under their names (the global model and, where averaged, its buffers)."""
        return dict(zip(self.averaged.parts, (self.global_model, self.global_buffers)))


class FedAvgSite(SiteHalf):
    """Trains the delivered global model; replies with its averaged vectors and sample count.

    Args:
        averaged: what is averaged (the strategy's :attr:`FedAvg.averaged`); the rest as :class:`SiteHalf`'s.
    """

    #: the model slot holding the global model (strategies with several slots name theirs)
    global_slot: ClassVar[str] = MODEL

    def __init__(self, *args: Any, averaged: Averaged = Averaged(), **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.averaged = averaged

    def deliver(self, site: SiteView, ctx: RoundContext, payload: Payload) -> None:
        for part, vector in payload.items():
            site.set(self.global_slot, part, vector)

    def reply(self, site: SiteView, ctx: RoundContext) -> Payload:
        return {**{part: site.get(self.global_slot, part) for part in self.averaged.parts}, NUM_SAMPLES: num_samples(site)}


class FedAvg(Strategy):
    """FedAvg and its family: :attr:`averaged` says what the halves average, send and deliver."""

    client_dp_refusal = None  # the server step is a sample-weighted sum (also for every subclass that keeps it)
    secure_aggregation_refusal = None
    robust_aggregation_refusal = None  # the averaged parts pass through the run's aggregation rule
    secure_sums = {"fit": SecureSum(NUM_SAMPLES)}  # every vector of the fit reply, weighted by the sample count
    #: what is averaged, declared once for both halves (a subclass naming other parts gets them as its coded key)
    averaged: ClassVar[Averaged] = Averaged()
    coded_keys = {averaged.parameters: averaged.parameters}
    Server = FedAvgServer
    Site = FedAvgSite

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "coded_keys" not in vars(cls):  # the averaged parameters are the model vector on the wire
            cls.coded_keys = {cls.averaged.parameters: cls.averaged.parameters}

    def server_half(self) -> FedAvgServer:
        return self.Server(self.options, self.split, self.n_sites, self.seed, averaged=self.averaged)

    def site_half(self, index: int) -> FedAvgSite:
        return self.Site(self.options, self.split, self.n_sites, self.seed, index, averaged=self.averaged)

    def initial_values(self, model: Payload) -> Payload:
        """The model's parts, and each averaged part named by its role (``"body"``, ``"head"``) under that name."""
        return {**model, **{part: model[ROLES[part]] for part in self.averaged.parts if part in ROLES}}
