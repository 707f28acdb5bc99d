"""pFedMe (Dinh, Tran and Nguyen, NeurIPS 2020): personalised models through Moreau envelopes.

Site i's objective is the Moreau envelope of its loss f_i around the global
model w, and its personalised model theta_i the envelope's proximal point::

    F_i(w) = min_theta f_i(theta) + lam/2 ||theta - w||^2,      theta_i(w) = argmin of the same      (paper eqs. 2-3)
    min_w (1/N) sum_i F_i(w)                                                                           (eq. 1)

F_i is smooth with gradient grad F_i(w) = lam (w - theta_i(w)) (Moreau's
identity), which is what the local update steps along.

**Round t** (Algorithm 1). The server sends w^t; a participating site sets
its local model w_{i,0} = w^t and its personalised model theta = w^t; then
for every local round r (here: every mini-batch B of its
``trainer.local_epochs`` passes):

1. *inner problem* (eq. 7): theta_i = an approximate minimiser of
   h(theta) = f_i(theta; B) + lam/2 ||theta - w_{i,r}||^2, from the
   previous theta (warm start): up to ``inner_steps`` = K gradient steps,
   stopping early once ||grad h(theta)|| <= ``inner_tolerance`` = nu (the
   paper's "accuracy nu"; without it exactly K steps are taken);
2. *local update*: w_{i,r+1} = w_{i,r} - eta lam (w_{i,r} - theta_i), a
   gradient step on F_i(w; B) whose gradient is lam (w - theta_i).

The site replies w_{i,R}; the server updates::

    w^{t+1} = (1 - beta) w^t + beta sum_{i in S^t} n_i w_{i,R} / sum_{i in S^t} n_i

and sites are evaluated with their personalised theta_i (nothing is
delivered: a site that skips a round keeps its theta_i).

**Optimisers.** Step 2 is the ``local`` slot's optimiser applied to the
loss lam/2 ||w - theta_i||^2 (theta_i fixed), whose gradient is
lam (w - theta_i): with plain SGD at learning rate eta it is the paper's
update exactly; with the tasks' Adam it is Adam on the envelope. Step 1
uses the ``personal`` slot's optimiser (the model's own, e.g. Adam at the
task's learning rate) or, with ``inner_lr``, plain gradient steps
theta <- theta - inner_lr grad h(theta) (the paper's "personal learning rate").

**Readings where the paper is silent** (each as in the authors' code and
PFLlib): theta starts every round at w^t and is warm-started from one
mini-batch to the next; one local round is one mini-batch; the average is
weighted by the sites' sample counts (Algorithm 1 prints 1/S). The
floating-point buffers (BatchNorm statistics) are those of theta's module,
the only one whose forward pass runs: the site replies them and the server
averages them (sample-weighted, without beta) and sends them with w^t.

**Where medfed differs from the reference code.** Both the authors'
``pFedMeOptimizer`` and PFLlib's add mu theta (mu = 0.001, a weight decay)
to the inner gradient; medfed solves the paper's inner problem, without it.
In both, the list kept as the personalised model is the module's own
parameter list, which the code then overwrites (the authors' with w_{i,R}
at the end of ``train()``; PFLlib with the global model before it
evaluates), so what they report as the personalised model is w_{i,R} or
w^t; medfed evaluates theta_i, as the paper defines. PFLlib's ``--beta``
defaults to 0, with which w^{t+1} = w^t: its pFedMe learns a global model
only when beta is given on the command line.

**Cost and budget.** Each mini-batch takes K forward and backward passes
(the outer step needs no forward pass): K times a FedAvg step. The plan
declares it (``data_pass=False``: its own step passes no sample) and each
inner step goes through :meth:`~medfed.federated.protocol.SiteView.step`,
so the run's compute counts K passes per mini-batch. By default (``preset:
equal``) those passes are the round's budget E = ``trainer.local_epochs``
(:mod:`medfed.federated.strategies.base`): the plan's length counts passes
(``TrainingPlan.passes_per_step`` = K), so its E B passes (B mini-batches
an epoch, cut at a whole one) make ceil(E B / K) local rounds of Algorithm 1,
and each local round on a mini-batch of m samples takes min(K, [left / m])
inner steps, at least 1 ([x] = floor(x + 1/2); left: the samples of the
round's E n still to pass), so the inner passes spend E epochs of samples
to within half a mini-batch: K a local round, fewer at the end.
``preset: published`` is the paper's
protocol as medfed shipped it before: a local round per mini-batch of E
epochs, K E epochs of passes. With ``inner_tolerance`` the inner steps may
stop early and pass fewer (every inner step then also reads the gradient
norm on the host: one device synchronisation per inner step).

**Not batchable.** The inner solve runs inside the step's loss: up to K
optimiser steps of the ``personal`` slot per mini-batch, stopped early by
the tolerance (a host read) and by the round's pass budget, Python control
flow the batched executor cannot stack over sites (``batchable`` says so;
pFedMe's sites always train one after another).

Defaults: lam = 15, K = 5, beta = 1, the paper's MNIST settings (the
authors' README: ``--lamda 15 --K 5 --beta 1``).
"""

from __future__ import annotations

import math

import torch

from medfed.federated.compute import batch_samples
from medfed.federated.protocol import (
    NUM_SAMPLES, SETUP, Payload, RoundContext, SecureSum, SiteView, TrainingPlan, num_samples,
)
from medfed.federated.strategies.base import ServerHalf, SiteHalf, Strategy
from medfed.federated.strategies.live_parameters import live_parameters, proximal_term
from medfed.options.presets import by_preset

LOCAL, PERSONAL = "local", "personal"


class PFedMeServer(ServerHalf):
    """Holds w^t (and the averaged buffers); mixes the participants' average into it with weight beta."""

    state_fields = ("global_model", "global_buffers")

    def setup(self, ctx: RoundContext, initial: Payload, replies: dict[int, Payload]) -> None:
        self.global_model = initial["all"].clone()
        self.global_buffers = initial["buffers"].clone()

    def message(self, ctx: RoundContext, site_index: int) -> Payload:
        return {"all": self.global_model, "buffers": self.global_buffers}

    def reply_keys(self, ctx: RoundContext, site_index: int) -> tuple[frozenset[str], ...]:
        """The local model's parameters, the personal model's buffers and the sample count; nothing at setup."""
        return super().reply_keys(ctx, site_index) if ctx.phase == SETUP else (frozenset({"all", "buffers", NUM_SAMPLES}),)

    def aggregate(self, ctx: RoundContext, replies: dict[int, Payload]) -> None:
        weights = [float(reply["num_samples"]) for reply in replies.values()]
        average = self.aggregation([reply["all"] for reply in replies.values()], weights, self.global_model)
        self.global_model = torch.lerp(self.global_model, average, self.options.beta)  # (1 - beta) w + beta average
        self.global_buffers = self.aggregation([reply["buffers"] for reply in replies.values()], weights, self.global_buffers)


class PFedMeSite(SiteHalf):
    """Per mini-batch: solve the inner problem for theta_i, then step w_i along lam (w_i - theta_i)."""

    batchable = "its loss solves the inner problem with up to K optimiser steps of its own per mini-batch (SiteView.step), stopped by a tolerance and a pass budget"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._inner_sgd: torch.optim.SGD | None = None  # plain steps at inner_lr (stateless), made at first use
        self.samples_passed = 0  # samples the round's inner steps passed so far (equal preset), from the round's message on

    def receive(self, site: SiteView, ctx: RoundContext, payload: Payload) -> None:
        """w_{i,0} = theta = w^t (with its buffers); the delivery carries nothing."""
        self.samples_passed = 0
        for slot in (LOCAL, PERSONAL):
            site.set(slot, "all", payload["all"])
            site.set(slot, "buffers", payload["buffers"])

    def plan(self, ctx: RoundContext) -> tuple[TrainingPlan, ...]:
        """The local rounds: E epochs of passes, K a mini-batch (equal preset), or a mini-batch of E epochs each (published)."""
        passes_per_step = by_preset(self.options.preset, self.options.inner_steps, 1)
        return (TrainingPlan(slot=LOCAL, data_pass=False, passes_per_step=passes_per_step),)

    def loss(self, site: SiteView, ctx: RoundContext, plan: TrainingPlan, batch) -> torch.Tensor:
        """Solve the inner problem on ``batch``; return a loss whose gradient in w is lam (w - theta_i).

        Its value is f_i(theta; B) at the last inner iterate whose gradient
        was taken plus lam/2 ||w - theta_i||^2: an estimate of F_i(w; B).
        """
        inner_steps = self.options.inner_steps
        if plan.pass_budget is not None:  # the equal preset: spend the round's samples, K a mini-batch, fewer at the end
            samples = batch_samples(batch)
            inner_steps = max(1, min(inner_steps, math.floor((plan.pass_budget - self.samples_passed) / samples + 0.5)))
            self.samples_passed += inner_steps * samples
        data_loss = self.solve_inner_problem(site, batch, site.get(LOCAL, "all"), inner_steps)
        theta = site.get(PERSONAL, "all")
        return data_loss + proximal_term(site.module(LOCAL), "all", theta, self.options.lam)

    def solve_inner_problem(self, site: SiteView, batch, centre: torch.Tensor, inner_steps: int | None = None) -> torch.Tensor:
        """theta <- approx. argmin f_i(theta; batch) + lam/2 ||theta - centre||^2, in the ``personal`` slot.

        Args:
            site: the site (its ``personal`` slot holds theta, the warm start).
            batch: the device batch B.
            centre: w_{i,r}, ``(d,)``, detached.
            inner_steps: at most this many gradient steps (None: K; fewer: the passes left of the round's budget).

        Returns:
            f_i(theta; B), detached, at the last iterate whose gradient was
            taken: the returned theta when the tolerance stopped the steps,
            else the iterate before the K-th step.
        """
        module = site.module(PERSONAL)
        parameters = live_parameters(module, "all")
        optimizer = None if self.options.inner_lr is None else self._plain_steps(parameters)
        tolerance = self.options.inner_tolerance
        converged = None if tolerance is None else (lambda: _gradient_norm(parameters) <= tolerance)
        module.train()
        for _ in range(self.options.inner_steps if inner_steps is None else inner_steps):
            data_loss = module.training_step(batch, 0)
            objective = data_loss + proximal_term(module, "all", centre, self.options.lam)
            if not site.step(PERSONAL, objective, batch, optimizer=optimizer, stop_if=converged):
                break
        return data_loss.detach()

    def _plain_steps(self, parameters: list[torch.nn.Parameter]) -> torch.optim.SGD:
        """SGD without momentum at ``inner_lr`` over theta's parameters: theta <- theta - inner_lr grad h."""
        if self._inner_sgd is None:  # a site keeps its modules (and their parameter objects) for the whole run
            self._inner_sgd = torch.optim.SGD(parameters, lr=self.options.inner_lr)
        return self._inner_sgd

    def reply(self, site: SiteView, ctx: RoundContext) -> Payload:
        return {
            "all": site.get(LOCAL, "all"),
            "buffers": site.get(PERSONAL, "buffers"),
            "num_samples": num_samples(site),
        }


def _gradient_norm(parameters: list[torch.nn.Parameter]) -> float:
    """||grad|| over ``parameters`` (a host read: used only with a tolerance)."""
    grads = [p.grad for p in parameters if p.grad is not None]
    return float(torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))) if grads else 0.0


class PFedMe(Strategy):
    dp_sgd_refusal = "its K inner steps reuse each sampled batch (SiteView.step); accounting for several noised steps per batch is not built"
    client_dp_refusal = None  # the server averages the sites' local models (sample-weighted), then moves towards the mean
    secure_aggregation_refusal = None
    robust_aggregation_refusal = None  # the sites' models are averaged through the run's aggregation rule
    secure_sums = {"fit": SecureSum(NUM_SAMPLES)}  # every vector of the fit reply, weighted by the sample count
    coded_keys = {"all": "all"}
    slots = (LOCAL, PERSONAL)
    evaluated_slot = PERSONAL
    Server = PFedMeServer
    Site = PFedMeSite
