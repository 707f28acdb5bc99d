"""L2GD (Hanzely & Richtarik 2020): local models pulled part of the way towards their mean.

"Federated learning of a mixture of global and local models", arXiv
2002.05516, section 4. The n sites' models x = (x_1, ..., x_n) solve

    min_x  F(x) = f(x) + lambda psi(x),   f(x) = (1/n) sum_i f_i(x_i),
                                          psi(x) = (1/(2n)) sum_i ||x_i - x_bar||^2,

x_bar = (1/n) sum_i x_i: lambda = 0 leaves n independent local models, and
lambda -> infinity forces one global model. L2GD ("loopless local gradient
descent") is SGD on F with a two-point estimator of its gradient: every
iteration a coin xi comes up 1 with probability p, and

    xi = 0:  x_i <- x_i - alpha / (n (1 - p)) grad f_i(x_i)   at every site (local steps, no communication)
    xi = 1:  x_i <- x_i - alpha lambda / (n p) (x_i - x_bar)   at every site (the server computes x_bar)

so the aggregation step moves each model the fraction theta = alpha lambda /
(n p) of the way to the mean (theta <= 1: no step past it). Sites are
evaluated with their own x_i.

**Mapping onto medfed's rounds.** Between two aggregation steps L2GD takes
a geometric number of local steps, (1 - p) / p on average; a medfed round
takes a fixed number, the trainer's local steps, with the site's optimiser
in place of the step alpha / (n (1 - p)) grad f_i. So a round here is one
run of local steps followed by one aggregation step, in two phases:

* ``fit``: every participant trains x_i (parameters and buffers) for the
  trainer's local epochs and sends it; the server averages the replies;
* ``mix``: the server sends x_bar to every participant that came through,
  which moves x_i <- x_i + theta (x_bar - x_i) (``torch.lerp``) and
  replies nothing.

The coin's randomness, and with it p, then enters only through theta:
the option is ``mixing`` = theta = alpha lambda / (n p) itself. Its default
1/2 is the paper's own: at the communication-optimal p* = lambda /
(L + lambda) and the step size alpha = 1 / (2 L_F) of its theory,
L_F = (1/n) max(L / (1 - p), lambda / p) = (L + lambda) / n, one gets
theta = 1/2 whatever L, lambda and n (and the local step is then 1 / (2 L),
plain gradient descent's). theta = 0 (lambda = 0) is Local, bit for bit;
theta = 1 is full averaging: FedAvg, bit for bit, when every site takes
part (``tests/test_l2gd.py``).

**Mean and partial participation.** x_bar is the sample-weighted mean of
the participants' models, as FedAvg's (the halves reuse FedAvg's): with
weights w_i = n_i / sum_j n_j, F generalises to sum_i w_i f_i(x_i) + lambda
psi_w(x), psi_w = (1/2) sum_i w_i ||x_i - x_bar_w||^2, whose gradient in x_i
is w_i (grad f_i(x_i) + lambda (x_i - x_bar_w)); preconditioned by
1 / (n w_i) per site it is the paper's two steps with x_bar_w for x_bar
and the same theta at every site, and with equal sizes it is the paper's
method exactly. The paper's L2GD lets every site take part; here only the
round's participants send their models and step towards their mean: a site
that skips a round, or fails in it, keeps its x_i.

**Buffers.** Floating-point buffers (BatchNorm running statistics) travel
and mix with the parameters (the same theta), so theta = 0 and 1 hold for
them too; a convex combination keeps running variances positive.
"""

from __future__ import annotations

import torch

from medfed.federated.protocol import Payload, RoundContext, SiteView, TrainingPlan
from medfed.federated.strategies.fedavg import FedAvg, FedAvgServer, FedAvgSite

FIT, MIX = "fit", "mix"


class L2GDServer(FedAvgServer):
    """FedAvg's averaging of the fit replies; sends the mean in the mix phase and delivers nothing."""

    def message(self, ctx: RoundContext, site_index: int) -> Payload:
        if ctx.phase == MIX:
            return self.global_payload()
        return {}

    def aggregate(self, ctx: RoundContext, replies: dict[int, Payload]) -> None:
        if ctx.phase == FIT:
            super().aggregate(ctx, replies)

    def reply_keys(self, ctx: RoundContext, site_index: int) -> tuple[frozenset[str], ...]:
        """FedAvg's reply in the fit phase, an empty one in the mix phase."""
        return super().reply_keys(ctx, site_index) if ctx.phase != MIX else (frozenset(),)

    def deliver(self, ctx: RoundContext, site_index: int) -> Payload:
        return {}


class L2GDSite(FedAvgSite):
    """Trains and sends x_i in the fit phase; steps it the fraction theta towards the mean in the mix phase."""

    def receive(self, site: SiteView, ctx: RoundContext, payload: Payload) -> None:
        if ctx.phase != MIX:
            return
        for part, mean in payload.items():
            site.set(self.global_slot, part, torch.lerp(site.get(self.global_slot, part), mean, self.options.mixing))

    def plan(self, ctx: RoundContext) -> tuple[TrainingPlan, ...]:
        return (TrainingPlan(),) if ctx.phase == FIT else ()

    def reply(self, site: SiteView, ctx: RoundContext) -> Payload:
        return super().reply(site, ctx) if ctx.phase == FIT else {}


class L2GD(FedAvg):
    client_dp_refusal = "each site trains its own model and moves it towards the mean: the server never sent what a site trains from, so it has no update to clip"
    phases = (FIT, MIX)
    Server = L2GDServer
    Site = L2GDSite
