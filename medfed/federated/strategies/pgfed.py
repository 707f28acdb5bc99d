"""PGFed and PGFedMo (Luo et al.): each site's personalised global objective.

See ``shared/papers/pgfed-personalized-global-objective.txt`` (section 4,
Algorithm 1). Site i minimises its own risk plus a weighted sum of the other
sites' risks (eq. 5), each estimated to first order around that site's model
(eqs. 7-9)::

    F_i(theta_i, a_i) = f_i(theta_i) + mu * sum_j a_ij [f_j(theta_j) + grad f_j(theta_j)^T (theta_i - theta_j)]

The auxiliary term's gradient in theta_i is the *auxiliary gradient*
g~_i = mu * sum_j a_ij grad f_j(theta_j) (eq. 10), which the server forms
from a_i and the sites' uploaded gradients; its gradient in a_ij is
g1_j + g2 with g1_j = mu (f_j(theta_j) - grad f_j(theta_j)^T theta_j), a scalar
site j uploads, and g2 = mu grad f_j^T theta_i, approximated by
gbar^T theta_i with gbar = (mu / M) sum_j grad f_j(theta_j) (eqs. 11-12).

**Round t, Algorithm 1 as implemented.** The server keeps, from round t - 1
only, the participants S_{t-1}, their gradients grad_{t-1}[j] and their
scalars g1_{t-1}[j] ("built for next round": a site that skipped round t - 1
contributes nothing in round t), the matrix A of a_i vectors (each row as its
site last returned it) and theta_glob^{t-1}.

* t = 1: each participant trains from theta_glob^0 as in FedAvg.
* t >= 2: participant i receives theta_glob^{t-1},
  g~ = mu sum_{j in S_{t-1}} a_ij grad_{t-1}[j] (eq. 13), gbar_{S_{t-1}} (eq. 14,
  M = |S_{t-1}|), g1_{t-1} and a_i. It sets theta_i = theta_glob^{t-1}, its
  auxiliary gradient g~_i = (1 - beta) g~ + beta g~_i(previous) (eq. 15;
  PGFed is beta = 0), then for every batch: theta_i <- optimiser step on
  grad f(theta_i, B) + g~_i (line 8), then g2 = gbar^T theta_i with the
  *updated* theta_i (line 9) and a_ij <- a_ij - eta_2 (g1_{t-1}[j] + g2) for
  j in S_{t-1} (line 10; j = i included, as eq. 5 sums over [N]).
* Every participant (any t) then computes f(theta_i^t) and grad f(theta_i^t)
  over its whole training split (sample-weighted mean of the batch losses and
  their gradients) and uploads theta_i^t, grad f(theta_i^t),
  g1 = mu (f - grad f^T theta_i^t) and a_i (line 13). The server sets
  A[i] = a_i, theta_glob^t = the sample-weighted mean of the participants'
  theta_i^t (normalised over S_t: the printed sum_{i in S_t} p_i theta_i
  with p_i = n_i / n would shrink the model under partial participation;
  the authors' code normalises), and keeps S_t's gradients and g1 for t + 1.

Readings where the paper is silent, each as in the authors' code:
a_ij = 1/M initially with M the number of participants per round (the server
learns M from round 1's replies; a is first used in round 2); a_ij is
projected onto a_ij >= 0 after each step (the paper requires a_ij > 0); the
first momentum step of a site, which has no previous g~_i, uses the
downloaded g~ as is. Line 8's update is the module's optimiser applied to the
loss f(theta_i, B) + <g~_i, theta_i> (the linear term on the live parameters
has gradient g~_i), so with plain SGD it is exactly line 8.

**The local objective as declared state** (``PGFedSite.loss_state``). A
step's loss reads g~_i, gbar, g1_{t-1}, the mask of S_{t-1} and a_i, set
when the round's message arrives, and changes none of them: a_i is an
auxiliary parameter (:meth:`PGFedSite.auxiliary`, plain steps of
``alpha_lr`` projected onto a >= 0), whose gradient comes from the
zero-valued term ``due * [T - sg(T)]`` added to the loss,

    T(a) = sum_{j in S_{t-1}} a_ij (g1_{t-1}[j] + gbar^T sg(theta_i)),      dT/da_ij = g1_{t-1}[j] + g2

(eq. 5's auxiliary risk in a, eqs. 11-12), taken at the model the step
starts from. That is theta after the previous batch's step, so the a-step
of batch k (line 9 reads the *updated* theta) is taken at step k + 1;
``due`` is 0 in the round's first step (no a-step is due yet) and 1 from the
second on (an auxiliary whose every step sets it to 1), and the a-step of
the last batch is taken in the reply. a_i is kept in float64 during the
round, each step's arithmetic in float64 and its result rounded to the
model's dtype, the precision a_i travels and is kept at the server in.

Sites are evaluated with their own theta_i (nothing is delivered). The
gradients ("aux_gradient", "mean_gradient" down; "gradient" up) are
model-sized too and go through the configured codecs, their first message
coded against zero.
"""

from __future__ import annotations

import torch

from medfed.federated.protocol import (
    MODEL, NUM_SAMPLES, SETUP, Auxiliary, Payload, RoundContext, SiteView, TrainingPlan, num_samples,
)
from medfed.federated.strategies.base import ServerHalf, SiteHalf, Strategy
from medfed.federated.strategies.live_parameters import gradient_only, live_parameters, live_vector


def training_risk(site: SiteView) -> tuple[float, torch.Tensor]:
    """f(theta) and grad f(theta) of the site's model over its whole training split.

    f is the sample-weighted mean of ``training_step`` over batches (the
    training batch size, in a fixed order that leaves the site's shuffling
    generator untouched: :meth:`~medfed.federated.protocol.SiteView.full_pass`,
    counted as ``aux/gradient_estimate``), grad f the same mean of the batch
    gradients (zero for a parameter the loss does not use).

    The module runs in train mode, as in local training: BatchNorm normalises
    each batch with its own statistics, so f and grad f are those of the
    objective the local steps descend (eq. 5's f_j; eval mode would
    differentiate another function, the network normalised by its running
    statistics). Train mode also updates the running statistics, a side
    effect the estimate must not have: every buffer is restored afterwards,
    so the site keeps (and is evaluated with) the model it trained.

    Returns:
        ``(f, gradient)``: a float and a float32 vector of shape
        ``(size("all"),)`` on the module's device.
    """
    module = site.module(MODEL)
    parameters = live_parameters(module, "all")
    risk = 0.0
    gradient = torch.zeros(sum(p.numel() for p in parameters), dtype=torch.float64, device=parameters[0].device)
    buffers = [(buffer, buffer.clone()) for buffer in module.buffers()]
    module.train()
    for batch, samples in site.full_pass("train", "gradient_estimate", backward=True):
        share = samples / site.n_train
        loss = module.training_step(batch, 0)
        batch_gradients = torch.autograd.grad(loss, parameters, allow_unused=True, materialize_grads=True)
        gradient += share * torch.cat([g.reshape(-1) for g in batch_gradients]).to(torch.float64)
        risk += share * loss.item()
    with torch.no_grad():
        for buffer, saved in buffers:
            buffer.copy_(saved)
    return risk, gradient.to(parameters[0].dtype)


class PGFedServer(ServerHalf):
    """Holds the global model, the learned weights A and the last participants' gradients."""

    state_fields = ("global_model", "alpha", "previous")

    def setup(self, ctx: RoundContext, initial: Payload, replies: dict[int, Payload]) -> None:
        self.global_model = initial["all"].clone()
        self.alpha: torch.Tensor | None = None  # A (N, N), from the end of round 1
        self.previous: dict | None = None  # S_{t-1}: "sites" (k,), "gradients" (k, d), "offsets" (k,)

    def message(self, ctx: RoundContext, site_index: int) -> Payload:
        message = {"all": self.global_model}
        if self.previous is None:  # round 1
            return message
        sites = self.previous["sites"]
        gradients = self.previous["gradients"]
        a_i = self.alpha[site_index]
        in_previous = torch.zeros(self.n_sites, device=a_i.device)
        in_previous[sites] = 1.0
        offsets = torch.zeros(self.n_sites, device=a_i.device)
        offsets[sites] = self.previous["offsets"]
        message.update(
            aux_gradient=self.options.mu * (a_i[sites] @ gradients),  # g~_{S_{t-1}}, eq. 13
            mean_gradient=self.options.mu / len(sites) * gradients.sum(dim=0),  # gbar_{S_{t-1}}, eq. 14
            alpha=a_i,
            previous_offsets=offsets,  # g1_{t-1}[j] for j in S_{t-1}, 0 elsewhere
            previous_participants=in_previous,
        )
        return message

    def reply_keys(self, ctx: RoundContext, site_index: int) -> tuple[frozenset[str], ...]:
        """The model, its gradient, the offset and the sample count, with the site's a_i once the message carried it."""
        if ctx.phase == SETUP:
            return super().reply_keys(ctx, site_index)
        keys = {"all", "gradient", "alpha_offset", NUM_SAMPLES}
        return (frozenset(keys if self.previous is None else keys | {"alpha"}),)

    def aggregate(self, ctx: RoundContext, replies: dict[int, Payload]) -> None:
        if self.alpha is None:
            self.alpha = torch.full((self.n_sites, self.n_sites), 1.0 / len(replies), device=self.global_model.device)
        sites = sorted(replies)
        for index in sites:
            if "alpha" in replies[index]:
                self.alpha[index] = replies[index]["alpha"].to(self.alpha)
        self.global_model = self.aggregation(
            [replies[i]["all"] for i in sites], [float(replies[i]["num_samples"]) for i in sites], self.global_model
        )
        self.previous = {
            "sites": sites,
            "gradients": torch.stack([replies[i]["gradient"] for i in sites]),
            "offsets": torch.cat([replies[i]["alpha_offset"] for i in sites]),
        }

    def metrics(self) -> dict[str, float]:
        return {} if self.alpha is None else {"alpha_mean": float(self.alpha.mean()), "alpha_min": float(self.alpha.min())}


class PGFedSite(SiteHalf):
    """Trains theta_i on its risk plus the first-order auxiliary risk; learns its row a_i of A."""

    state_fields = ("aux_gradient",)
    #: g~_i (d,), kept across rounds for the momentum (eq. 15); from round 2 on, while the round trains: gbar (d,),
    #: a_i (N,) float64 (an auxiliary parameter), g1_{t-1} (N,) float64 (0 off S_{t-1}), the 0/1 mask of S_{t-1}
    #: (N,) float64 and the 0-d "an a-step is due" flag (an auxiliary parameter); None otherwise
    loss_state = ("aux_gradient", "mean_gradient", "alpha", "alpha_offsets", "alpha_mask", "alpha_due")
    _round_state = ("mean_gradient", "alpha", "alpha_offsets", "alpha_mask", "alpha_due")

    @property
    def beta(self) -> float:
        """Momentum on the auxiliary gradient (eq. 15)."""
        return 0.0

    def receive(self, site: SiteView, ctx: RoundContext, payload: Payload) -> None:
        site.set(MODEL, "all", payload["all"])  # theta_i <- theta_glob^{t-1}
        if "aux_gradient" not in payload:  # round 1: FedAvg-style local training
            return
        downloaded = payload["aux_gradient"]
        previous = self.aux_gradient
        self.aux_gradient = downloaded if previous is None else (1.0 - self.beta) * downloaded + self.beta * previous
        self.mean_gradient = payload["mean_gradient"]
        self.alpha = payload["alpha"].to(torch.float64)
        self.alpha_offsets = payload["previous_offsets"].to(torch.float64)
        self.alpha_mask = (payload["previous_participants"] > 0.5).to(torch.float64)
        self.alpha_due = torch.zeros((), dtype=torch.float64, device=self.alpha.device)

    def auxiliary(self, ctx: RoundContext, plan: TrainingPlan) -> dict[str, Auxiliary]:
        """From round 2 on: a_i (line 10, projected onto a >= 0) and the due flag (set to 1 by every step)."""
        if self.alpha is None:
            return {}
        return {"alpha": self.alpha_rule(), "alpha_due": Auxiliary(1.0, torch.ones_like)}

    def alpha_rule(self) -> Auxiliary:
        """a_ij <- max(0, a_ij - eta_2 dT/da_ij), stepped in float64 and kept at the precision a_i travels in (the model's)."""
        travels_as = self.mean_gradient.dtype
        return Auxiliary(self.options.alpha_lr, lambda alpha: alpha.clamp_min(0.0).to(travels_as).to(torch.float64))

    def alpha_gradient(self, theta: torch.Tensor) -> torch.Tensor:
        """dT/da_i at ``theta``: (g1_{t-1}[j] + gbar^T theta) for j in S_{t-1}, 0 elsewhere; (N,) float64."""
        g2 = torch.dot(self.mean_gradient.to(torch.float64), theta.to(torch.float64))
        return self.alpha_mask * (self.alpha_offsets + g2)

    def loss(self, site: SiteView, ctx: RoundContext, plan: TrainingPlan, batch) -> torch.Tensor:
        """Line 8's loss f(theta; batch) + <g~_i, theta>; from round 2 on plus due * [T - sg(T)] (value 0; module docstring)."""
        loss = super().loss(site, ctx, plan, batch)
        if self.alpha is None:
            return loss
        theta = live_vector(site.module(MODEL), "all").detach()
        alpha_term = self.alpha_due * gradient_only(self.alpha @ self.alpha_gradient(theta))
        return loss + alpha_term.to(loss.dtype)

    def regularizer(self, site: SiteView, ctx: RoundContext, plan: TrainingPlan) -> torch.Tensor | None:
        """<g~_i, theta_i> on the live parameters: its gradient is the auxiliary gradient g~_i (line 8)."""
        if self.alpha is None:
            return None
        return torch.dot(self.aux_gradient, live_vector(site.module(MODEL), "all"))

    def reply(self, site: SiteView, ctx: RoundContext) -> Payload:
        theta = site.get(MODEL, "all")
        alpha = self.alpha
        if alpha is not None and bool(self.alpha_due):  # the last batch's a-step (lines 9-10 with the final theta)
            alpha = self.alpha_rule().step(alpha, self.alpha_gradient(theta))
        self._end_round()
        risk, gradient = training_risk(site)
        offset = self.options.mu * (risk - float(torch.dot(gradient.to(torch.float64), theta.to(torch.float64))))
        reply = {
            "all": theta,
            "gradient": gradient,
            "alpha_offset": torch.tensor([offset], device=theta.device),
            "num_samples": num_samples(site),
        }
        if alpha is not None:
            reply["alpha"] = alpha.to(theta.dtype)
        return reply

    def _end_round(self) -> None:
        """Drop the round's state (a round's reply material never outlives it)."""
        for name in self._round_state:
            setattr(self, name, None)

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self._end_round()  # a restored site has no round pending


class PGFed(Strategy):
    """PGFed: momentum beta = 0 (see the module docstring)."""

    dp_sgd_refusal = "its auxiliary gradient, sent to the server, is a full pass over the site's training data outside DP-SGD"
    client_dp_refusal = "its server step needs each site's own vector: each site's gradient estimate, weighted per pair"
    secure_aggregation_refusal = "its server step needs each site's own vector: each site's gradient estimate, weighted per pair"
    robust_aggregation_refusal = None  # the global model's average passes through the run's aggregation rule
    coded_keys = {"all": "all", "gradient": "zeros", "aux_gradient": "zeros", "mean_gradient": "zeros"}
    Server = PGFedServer
    Site = PGFedSite


class PGFedMoSite(PGFedSite):
    @property
    def beta(self) -> float:
        return self.options.beta


class PGFedMo(PGFed):
    """PGFedMo: PGFed with momentum ``beta`` on each site's auxiliary gradient (eq. 15)."""

    Site = PGFedMoSite
