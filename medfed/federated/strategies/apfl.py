"""APFL (Deng, Kamani, Mahdavi 2020): each site mixes its own model with the global one, with a learned weight.

"Adaptive personalized federated learning", arXiv 2003.13461, Algorithm 1.
Site i holds the global model's local version w_i, trained and averaged as
in FedAvg, its local model v_i and its mixing weight alpha_i in [0, 1]; its
personalised model is

    v_bar_i = alpha_i v_i + (1 - alpha_i) w_i.

Every local step draws one batch xi and takes, from the values before the
step (superscript t-1),

    w_i     <- w_i - eta grad f_i(w_i; xi)
    v_i     <- v_i - eta grad_v f_i(v_bar_i; xi)         = v_i - eta alpha_i grad f_i(v_bar_i; xi)
    alpha_i <- Pi_[0,1](alpha_i - eta_alpha grad_alpha f_i(v_bar_i; xi)),
               grad_alpha f_i(v_bar_i; xi) = <v_i - w_i, grad f_i(v_bar_i; xi)>

and at the end of the round the server averages the participants' w_i into
w (FedAvg: this module subclasses its halves) and every site gets it. Sites
are evaluated with v_bar_i = alpha_i v_i + (1 - alpha_i) w, w the global
model just delivered (the mixture the paper outputs, with the average of
the w_i).

"eta" is each model's optimiser (its own state, e.g. Adam's moments, for w
and for v); alpha takes plain projected SGD steps of ``alpha_lr``, by
default the learning rate of v's optimiser (the paper uses one eta_t for
all three). ``adaptive: false`` keeps alpha_i at ``alpha`` (the paper's
fixed-alpha variant). With alpha fixed at 1, v_i follows a Local run's
model bit for bit (its gradient is grad f_i(v_i), on the batches a Local
site draws); at 0 the evaluated mixture's parameters are the global model's;
w is the global model of a FedAvg run with the global plan's budget, bit for
bit, whatever alpha (``tests/test_apfl.py``).

**Budget** (:mod:`medfed.federated.strategies.base`). Every step passes its
batch twice, forward and backward (w's loss and v_bar's), both counted as
the global plan's. By default (``preset: equal``) the plan takes E/2
epochs of steps (``step_share`` 1/2), E = ``trainer.local_epochs``, so a
round costs a FedAvg round's passes; ``preset: published`` is the paper's
protocol as medfed shipped it before: a step per mini-batch of E epochs,
2 E epochs of passes.

**Model slots.** ``global`` (w_i, trained by the round's training plan,
sent, set by the delivery), ``local`` (v_i, trained by the same plan:
``TrainingPlan.also_steps``) and ``mixed`` (v_bar_i, evaluated, loaded at
every delivery: its parameters the mixture, its buffers those of
``local``). alpha_i is the half's declared auxiliary parameter
(:meth:`APFLSite.auxiliary`: plain steps of ``alpha_lr``, projected onto
[0, 1]). Each step's loss is one function of w, v and alpha at the values
before the step::

    loss = f_i(w; xi) + [f_i(v_bar; xi) - sg(f_i(v_bar; xi))],   v_bar = alpha v + (1 - alpha) sg(w)

(sg: stop-gradient): its value is f_i(w; xi), the loss reported; its
gradient in w is grad f_i(w; xi) (w is detached in the mixture), in v and
alpha that of f_i(v_bar; xi), so one backward pass gives the three
gradients of the update above; w's and v's optimisers step, then alpha.
The mixture's forward pass runs ``local``'s module with the parameters
alpha v + (1 - alpha) w (``torch.func.functional_call``), before w's; both
passes are counted in the global plan's compute (``data_pass=2``).

**BatchNorm buffers.** ``global``'s running statistics are w_i's, averaged
as FedAvg averages them; ``local``'s are updated by the mixed model's
forward passes in training, so they are the running statistics of v_bar
(with the w of each step), and are the ones ``mixed`` is evaluated with.

**Where medfed follows the paper rather than the code.** The authors' code
(FedTorch) mixes the *outputs* of the two networks, alpha f(x; v) +
(1 - alpha) f(x; w), updates alpha once per round (first batch only) with
<v - w, alpha g_v + (1 - alpha) g_w> (the two networks' gradients mixed)
plus 0.02 alpha, and by default keeps alpha fixed at 0.5. PFLlib trains v_i on its own loss f_i(v_i)
(not on v_bar's), and at the end of each round overwrites v_i with the
mixture. Here the parameters are mixed, as the paper's v_bar is, and every
step updates alpha with the exact gradient above, projected onto [0, 1] as
the paper constrains alpha (and the authors' code clips). The average is
FedAvg's sample-weighted one over the participants (the paper's is
uniform: the same with equal site sizes). The initial alpha, 0.5, is the
authors' code's default.
"""

from __future__ import annotations

import torch

from medfed.federated.protocol import Auxiliary, Payload, RoundContext, SiteView, TrainingPlan
from medfed.federated.strategies.fedavg import FedAvg, FedAvgSite
from medfed.federated.strategies.live_parameters import gradient_only, live_parameters, training_loss_with

GLOBAL, LOCAL, MIXED = "global", "local", "mixed"


def mixture(alpha: torch.Tensor, local: torch.Tensor, global_: torch.Tensor) -> torch.Tensor:
    """v_bar = alpha v + (1 - alpha) w, for vectors or parameter tensors of one shape (alpha a 0-d tensor)."""
    return alpha * local + (1.0 - alpha) * global_


def unit_interval(alpha: torch.Tensor) -> torch.Tensor:
    """Pi_[0,1]: alpha clamped to [0, 1]."""
    return alpha.clamp(0.0, 1.0)


class APFLSite(FedAvgSite):
    """FedAvg's site half on the ``global`` slot; its steps also train v_i and alpha_i; evaluated with the mixture."""

    state_fields = ("alpha",)
    #: alpha_i, 0-d on the model's device, from the first delivery (an auxiliary parameter where ``adaptive``)
    loss_state = ("alpha",)

    global_slot = GLOBAL

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.alpha_rate: float | None = None  # eta_alpha: alpha_lr, or v's learning rate (read when a message arrives)

    def receive(self, site: SiteView, ctx: RoundContext, payload: Payload) -> None:
        super().receive(site, ctx, payload)
        self.alpha_rate = self.options.alpha_lr if self.options.alpha_lr is not None else site.learning_rate(LOCAL)

    def deliver(self, site: SiteView, ctx: RoundContext, payload: Payload) -> None:
        """w <- the delivered global model; alpha_i set at the first delivery; the evaluated mixture rebuilt."""
        super().deliver(site, ctx, payload)
        if self.alpha is None:
            reference = site.get(LOCAL, "all")
            self.alpha = torch.tensor(self.options.alpha, dtype=reference.dtype, device=reference.device)
        self._load_mixture(site)

    def _load_mixture(self, site: SiteView) -> None:
        """``mixed`` <- alpha v + (1 - alpha) w (parameters) and ``local``'s buffers."""
        site.set(MIXED, "all", mixture(self.alpha, site.get(LOCAL, "all"), site.get(GLOBAL, "all")))
        site.set(MIXED, "buffers", site.get(LOCAL, "buffers"))

    def plan(self, ctx: RoundContext) -> tuple[TrainingPlan, ...]:
        """w's steps, each also stepping v (``also_steps``) and alpha; two passes a step; ``step_share`` of the budget."""
        return (TrainingPlan(slot=GLOBAL, share=self.options.step_share, also_steps=(LOCAL,), data_pass=2),)

    def auxiliary(self, ctx: RoundContext, plan: TrainingPlan) -> dict[str, Auxiliary]:
        """alpha_i <- Pi_[0,1](alpha_i - eta_alpha grad_alpha), where ``adaptive``."""
        return {"alpha": Auxiliary(self.alpha_rate, unit_interval)} if self.options.adaptive else {}

    def loss(self, site: SiteView, ctx: RoundContext, plan: TrainingPlan, batch) -> torch.Tensor:
        """f_i(w; batch) in value; the gradient of f_i(v_bar; batch) in v and alpha besides (module docstring)."""
        local, global_module = site.module(LOCAL), site.module(GLOBAL)
        names = local.parameter_split.names("all")
        pairs = zip(names, live_parameters(local, "all"), live_parameters(global_module, "all"), strict=True)
        mixed = {name: mixture(self.alpha, v, w.detach()) for name, v, w in pairs}
        mixture_loss = training_loss_with(local, mixed, batch)  # the mixture's pass first (the draws' order)
        return super().loss(site, ctx, plan, batch) + gradient_only(mixture_loss)


class APFL(FedAvg):
    dp_sgd_refusal = "its loss runs the local model with mixed parameter tensors (functional_call), which Opacus's per-sample hooks attribute to the wrong parameters, and steps its mixing weight outside the clipping"
    slots = (GLOBAL, LOCAL, MIXED)
    evaluated_slot = MIXED
    Site = APFLSite
