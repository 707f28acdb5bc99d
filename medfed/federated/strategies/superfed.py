"""SuPerFed (Hahn, Jeong and Lee, KDD 2022): a low-loss line between a federated and a local model.

Each site keeps a *federated model* w^f (its copy of the global model w^g,
trained and averaged as in FedAvg) and a *local model* w^l that never
leaves it. Local training connects them: at every step a mixing weight
lambda ~ U(0, 1) is drawn and the loss of the model on the segment between
them is minimised together with two regularisers::

    W(lambda) = (1 - lambda) w^f + lambda w^l
    L = l(W(lambda); B) + mu ||w^f - w^g||^2 + nu cos^2(w^f, w^l),   cos(a, b) = <a, b> / (||a|| ||b||)

over the whole parameter vectors (the objective as the authors' KDD poster
and slides print it: "L(h, W) = l(h(x), y; W(lambda)) + mu ||w^f - w^g|| + nu cos^2(w^f, w^l)").
Both models get gradients, (1 - lambda) and lambda times the mixture's
gradient plus their regularisers' (mu pulls w^f to the global model it
received, FedProx-like; nu pushes the two towards orthogonality, so the
segment spans distinct low-loss solutions). The mixture's forward pass runs
``training_step`` of the federated slot with the mixed parameters
(``torch.func.functional_call``, :func:`~medfed.federated.strategies.live_parameters.training_loss_with`);
the training plan steps the federated slot's optimiser on w^f and, declared
in the plan (``TrainingPlan.also_steps``), the local slot's optimiser on
w^l after it (each with its own state, e.g. Adam moments).

**Not batchable.** Each step's lambda is a fresh draw from the site's
seeded global generator inside the loss, which a batched step over sites
cannot reproduce draw for draw; SuPerFed's sites train one after another
(``batchable`` says so). Otherwise the loss is a function of the two slots
and the declared proximal centre w^g (``loss_state``), and nothing steps in
it: both optimisers step after the loop's one backward pass.

**Personalisation starts** at round ``start_round`` (the authors' code:
after round floor(L R), L = ``--L``). Before it only w^f trains, with
lambda = 0 (FedAvg with the proximal term) and the local model waits at its
initialisation. The local model is initialised independently of the
federated one (the cosine term needs two distinct models: at w^l = w^f its
gradient vanishes): every site re-draws the local slot's parameters with
each layer's own ``reset_parameters`` under a generator seeded from (run
seed, site), once, before round 1 (the authors' code draws the local weights
with Xavier-normal under a per-client seed).

**Server.** As FedAvg: w^g is the sample-weighted average of the
participants' w^f (the federated model's floating-point buffers too: the
mixture's forward pass runs in the federated module, so its BatchNorm
statistics are the mixtures'); it reaches a site with the next round's
message, with the round number.

**Evaluation.** Each site is evaluated with W(``eval_lambda``) of its own
two models as they stand after its last round, with the federated module's
buffers (``personalised`` slot, built at every delivery; nothing is
delivered); before personalisation starts, with w^f. The default
eval_lambda = 1 is the local model, the personalised model the authors'
code evaluates (``basic_evaluate``); their code's final evaluation reports,
per client, the best of lambda = 0, 0.1, ..., 1 on that client's test
split, which medfed does not do (a choice made on the test split).

**Readings and departures** (the paper's method section was not at hand
here beyond that formula; the rest follows the authors' code,
github.com/vaseline555/SuPerFed ``src/algorithm.py``, ``src/server.py``):

* model mixing ("SuPerFed-MM", one lambda for the whole model) is
  implemented; layer-wise mixing ("-LM", one lambda per layer) is not;
* every parameter is mixed; the authors' layers mix only weight tensors
  ("weight_local"), so biases stay federated-only;
* the proximal term is the squared norm over the whole vector; the code
  sums the unsquared norms of the layers' weights (mu sum_k ||w^f_k - w^g_k||),
  whose gradient has length mu per layer however close w^f is;
* cos^2 is over the whole parameter vectors, as the code (which also adds
  1e-6 to every product in the numerator; medfed does not);
* the local model stays at its site across rounds, as the paper describes;
  in the code, sending the global model loads the server's whole state
  dict, local weights included (never aggregated, so at the server's
  initialisation), into the client, which as we read it resets each
  sampled client's local model every round;
* the code's SGD (momentum 0.9, weight decay 1e-4, learning-rate decay
  0.999 per round) is the task's optimiser here.

Defaults: mu = 0.01, nu = 2 (the authors' defaults, ``--mu 0.01 --nu 2``);
start_round = 7, i.e. L = 0.2 (their default ``--L``) of the repo's 30 rounds.
"""

from __future__ import annotations

import torch

from medfed.federated.protocol import (
    NUM_SAMPLES, Payload, RoundContext, SecureSum, SiteView, TrainingPlan, num_samples,
)
from medfed.federated.strategies.base import SiteHalf, Strategy
from medfed.federated.strategies.fedavg import FedAvgServer
from medfed.federated.strategies.live_parameters import (
    live_parameters, live_vector, proximal_term, proximal_term_of, training_loss_with,
)
from medfed.models.base import unwrap

FEDERATED, LOCAL, PERSONALISED = "federated", "local", "personalised"
#: the stream of :meth:`~medfed.federated.site.Site.global_rng` the local model is drawn under (rounds use (round, phase))
_INITIALISATION_STREAM = 0


class SuPerFedServer(FedAvgServer):
    """FedAvg's average of the federated models, sent with the round number at the start of each round."""

    state_fields = (*FedAvgServer.state_fields, "completed_rounds")

    def setup(self, ctx: RoundContext, initial: Payload, replies: dict[int, Payload]) -> None:
        super().setup(ctx, initial, replies)
        self.completed_rounds = 0

    def message(self, ctx: RoundContext, site_index: int) -> Payload:
        return {"all": self.global_model, "buffers": self.global_buffers, "round": torch.tensor([float(self.completed_rounds + 1)], device=self.global_model.device)}

    def aggregate(self, ctx: RoundContext, replies: dict[int, Payload]) -> None:
        super().aggregate(ctx, replies)
        self.completed_rounds += 1

    def deliver(self, ctx: RoundContext, site_index: int) -> Payload:
        return {}


class SuPerFedSite(SiteHalf):
    """Trains w^f and w^l along the segment between them; evaluated with W(eval_lambda)."""

    state_fields = ("round",)
    #: w^g, ``(size("all"),)``: the proximal centre, the global model of the round's message (None outside training)
    loss_state = ("global_model",)
    batchable = "its loss draws the mixing weight lambda ~ U(0, 1) from the site's global generator at every step"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.round = 0  # the round of the last message (0: none yet)

    @property
    def personalising(self) -> bool:
        return self.round >= self.options.start_round

    def setup(self, site: SiteView, ctx: RoundContext) -> Payload:
        """Draw the local model afresh, independently of the federated one (seeded by the run seed and the site)."""
        with site.global_rng(_INITIALISATION_STREAM), torch.no_grad():
            for layer in unwrap(site.module(LOCAL)).modules():
                if hasattr(layer, "reset_parameters"):
                    layer.reset_parameters()
        return {}

    def deliver(self, site: SiteView, ctx: RoundContext, payload: Payload) -> None:
        self._load_personalised_model(site)

    def receive(self, site: SiteView, ctx: RoundContext, payload: Payload) -> None:
        site.set(FEDERATED, "all", payload["all"])
        site.set(FEDERATED, "buffers", payload["buffers"])
        self.global_model = payload["all"]  # w^g, the proximal centre (until the reply)
        self.round = int(payload["round"])

    def plan(self, ctx: RoundContext) -> tuple[TrainingPlan, ...]:
        """w^f's steps; the local slot's optimiser steps w^l after each (a step without a gradient for w^l,
        before ``start_round``, leaves it and its optimiser state alone)."""
        return (TrainingPlan(slot=FEDERATED, also_steps=(LOCAL,)),)

    def loss(self, site: SiteView, ctx: RoundContext, plan: TrainingPlan, batch) -> torch.Tensor:
        """Before ``start_round``: l(w^f; B) + mu ||w^f - w^g||^2; from it on, the mixture's loss at a fresh lambda ~ U(0, 1).

        lambda comes from torch's CPU generator, which the loop seeds for
        each site, round and phase (:meth:`~medfed.federated.site.Site.global_rng`):
        the draws are the same in a resumed run, and reading them costs no
        device synchronisation.
        """
        federated = site.module(FEDERATED)
        if not self.personalising:
            return federated.training_step(batch, 0) + proximal_term(federated, "all", self.global_model, 2.0 * self.options.mu)
        return self.mixture_loss(site, batch, float(torch.rand((), device="cpu")))

    def mixture_loss(self, site: SiteView, batch, lam: float) -> torch.Tensor:
        """l(W(lam); B) + mu ||w^f - w^g||^2 + nu cos^2(w^f, w^l), differentiable in both models' live parameters."""
        federated, local = site.module(FEDERATED), site.module(LOCAL)
        parameters = live_parameters(federated, "all")
        f, l = live_vector(federated, "all"), live_vector(local, "all")  # (d,) w^f and w^l
        mixed = torch.lerp(f, l, lam)  # (1 - lam) w^f + lam w^l
        names = federated.parameter_split.names("all")
        pieces = mixed.split([p.numel() for p in parameters])
        data_loss = training_loss_with(federated, {n: t.view_as(p) for n, t, p in zip(names, pieces, parameters)}, batch)
        proximal = proximal_term_of(f, self.global_model, 2.0 * self.options.mu)  # mu ||w^f - w^g||^2
        cosine_squared = (f @ l).square() / ((f @ f) * (l @ l)).clamp_min(torch.finfo(f.dtype).tiny)
        return data_loss + proximal + self.options.nu * cosine_squared

    def _load_personalised_model(self, site: SiteView) -> None:
        """personalised <- W(eval_lambda) of the two models (w^f before personalisation), with the federated buffers."""
        weights = site.get(FEDERATED, "all")
        if self.personalising:
            weights = torch.lerp(weights, site.get(LOCAL, "all"), self.options.eval_lambda)
        site.set(PERSONALISED, "all", weights)
        site.set(PERSONALISED, "buffers", site.get(FEDERATED, "buffers"))

    def reply(self, site: SiteView, ctx: RoundContext) -> Payload:
        self.global_model = None  # only needed while training
        return {"all": site.get(FEDERATED, "all"), "buffers": site.get(FEDERATED, "buffers"), "num_samples": num_samples(site)}


class SuPerFed(Strategy):
    dp_sgd_refusal = "its loss runs the model with mixed parameter tensors (functional_call), which Opacus's per-sample hooks attribute to the wrong parameters"
    client_dp_refusal = None  # the federated models are averaged (sample-weighted)
    secure_aggregation_refusal = None
    robust_aggregation_refusal = None  # FedAvg's server half: the federated models through the run's aggregation rule
    secure_sums = {"fit": SecureSum(NUM_SAMPLES)}  # every vector of the fit reply, weighted by the sample count
    coded_keys = {"all": "all"}
    slots = (FEDERATED, LOCAL, PERSONALISED)
    evaluated_slot = PERSONALISED
    Server = SuPerFedServer
    Site = SuPerFedSite
