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

Subclasses of the halves change what travels by naming other parts of the
model (:data:`~medfed.models.split.PARTS`) in ``parameters_part`` and
``buffers_part`` (FedBN leaves out the BatchNorm layers; FedPer and FedRep
average the shared part and no buffers: ``buffers_part = None``), and where
the global model lives at a site that holds several models in
``global_slot`` (Ditto, APFL).
"""

from __future__ import annotations

from typing import ClassVar

from medfed.federated.aggregate import weighted_average
from medfed.federated.protocol import (
    DELIVER, MODEL, NUM_SAMPLES, SETUP, Payload, RoundContext, SecureSum, SiteView, num_samples,
)
from medfed.federated.strategies.base import ServerHalf, SiteHalf, Strategy


class FedAvgServer(ServerHalf):
    """Holds the global model and buffers; averages the replies weighted by the sites' sample counts."""

    #: the vector of parameters averaged (and coded on the wire)
    parameters_part: ClassVar[str] = "all"
    #: the vector of floating-point buffers averaged (dense on the wire); None: buffers stay at their site
    buffers_part: ClassVar[str | None] = "buffers"
    state_fields = ("global_model", "global_buffers")

    def setup(self, ctx: RoundContext, initial: Payload, replies: dict[int, Payload]) -> None:
        self.global_model = initial[self.parameters_part].clone()
        self.global_buffers = None if self.buffers_part is None else initial[self.buffers_part].clone()

    def aggregate(self, ctx: RoundContext, replies: dict[int, Payload]) -> None:
        weights = [float(reply["num_samples"]) for reply in replies.values()]
        self.global_model = weighted_average([reply[self.parameters_part] for reply in replies.values()], weights)
        if self.buffers_part is not None:
            self.global_buffers = weighted_average([reply[self.buffers_part] for reply in replies.values()], weights)

    def reply_keys(self, ctx: RoundContext, site_index: int) -> tuple[frozenset[str], ...]:
        """The parameters, the buffers (where averaged) and the sample count; nothing at setup."""
        if ctx.phase == SETUP:
            return super().reply_keys(ctx, site_index)
        return (frozenset({self.parameters_part, NUM_SAMPLES} | ({self.buffers_part} if self.buffers_part else set())),)

    def deliver(self, ctx: RoundContext, site_index: int) -> Payload:
        payload = {self.parameters_part: self.global_model}
        if self.buffers_part is not None:
            payload[self.buffers_part] = self.global_buffers
        return payload


class FedAvgSite(SiteHalf):
    """Trains the delivered global model; replies with its parameters, buffers and sample count."""

    parameters_part: ClassVar[str] = FedAvgServer.parameters_part
    buffers_part: ClassVar[str | None] = FedAvgServer.buffers_part
    #: the model slot holding the global model (strategies with several slots name theirs)
    global_slot: ClassVar[str] = MODEL

    def receive(self, site: SiteView, ctx: RoundContext, payload: Payload) -> None:
        if ctx.phase == DELIVER:
            for part, vector in payload.items():
                site.set(self.global_slot, part, vector)

    def reply(self, site: SiteView, ctx: RoundContext) -> Payload:
        reply = {self.parameters_part: site.get(self.global_slot, self.parameters_part)}
        if self.buffers_part is not None:
            reply[self.buffers_part] = site.get(self.global_slot, self.buffers_part)
        return {**reply, "num_samples": num_samples(site)}


class FedAvg(Strategy):
    client_dp_refusal = None  # the server step is a sample-weighted sum (also for every subclass that keeps it)
    secure_aggregation_refusal = None
    secure_sums = {"fit": SecureSum(NUM_SAMPLES)}  # every vector of the fit reply, weighted by the sample count
    coded_keys = {"all": "all"}
    delivered = "all"
    Server = FedAvgServer
    Site = FedAvgSite
