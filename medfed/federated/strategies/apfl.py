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
sent, set by the delivery), ``local`` (v_i) and ``mixed`` (v_bar_i,
evaluated, loaded at every delivery: its parameters the mixture, its
buffers those of ``local``). v_i steps inside the global plan's loss
(:meth:`APFLSite.loss`), on the same batch and before w_i moves, since its
gradient is taken at v_bar with w^{t-1}: the mixed model's forward pass
runs ``local``'s module with the parameters alpha v + (1 - alpha) w
(``torch.func.functional_call``; w detached, so no gradient of the mixture
reaches w), one step of ``local``'s optimiser on it
(:meth:`~medfed.federated.site_view.SiteView.step`, a second pass of the
batch, counted in the global plan's compute) gives v's gradient and alpha's
in one backward pass and steps v, then the loop steps w on the returned
loss f_i(w; xi).

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

from dataclasses import dataclass

import torch

from medfed.config import require
from medfed.federated.strategies.base import DELIVER, Payload, RoundContext, SiteView, TrainingPlan
from medfed.federated.strategies.fedavg import FedAvg, FedAvgSite
from medfed.federated.strategies.live_parameters import live_parameters, training_loss_with
from medfed.federated.strategies.presets import by_preset, check_preset

GLOBAL, LOCAL, MIXED = "global", "local", "mixed"


def mixture(alpha: torch.Tensor, local: torch.Tensor, global_: torch.Tensor) -> torch.Tensor:
    """v_bar = alpha v + (1 - alpha) w, for vectors or parameter tensors of one shape (alpha a 0-d tensor)."""
    return alpha * local + (1.0 - alpha) * global_


class APFLSite(FedAvgSite):
    """FedAvg's site half on the ``global`` slot; also steps v_i and alpha_i on every batch; evaluated with the mixture."""

    global_slot = GLOBAL

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.alpha: torch.Tensor | None = None  # 0-d, on the model's device, from the first delivery

    def receive(self, site: SiteView, ctx: RoundContext, payload: Payload) -> None:
        super().receive(site, ctx, payload)
        if ctx.phase == DELIVER:
            if self.alpha is None:
                reference = site.get(LOCAL, "all")
                self.alpha = torch.tensor(self.options.alpha, dtype=reference.dtype, device=reference.device)
            self._load_mixture(site)

    def _load_mixture(self, site: SiteView) -> None:
        """``mixed`` <- alpha v + (1 - alpha) w (parameters) and ``local``'s buffers."""
        site.set(MIXED, "all", mixture(self.alpha, site.get(LOCAL, "all"), site.get(GLOBAL, "all")))
        site.set(MIXED, "buffers", site.get(LOCAL, "buffers"))

    def plan(self, ctx: RoundContext) -> tuple[TrainingPlan, ...]:
        """w's steps (each also steps v and alpha): ``step_share`` of the budget."""
        return (TrainingPlan(slot=GLOBAL, share=self.options.step_share),)

    def loss(self, site: SiteView, ctx: RoundContext, plan: TrainingPlan, batch) -> torch.Tensor:
        """Steps v_i and alpha_i on ``batch`` at the values before this step, then returns f_i(w; batch) for w's step."""
        self._local_step(site, batch)
        return super().loss(site, ctx, plan, batch)

    def _local_step(self, site: SiteView, batch) -> None:
        """v <- v - eta grad_v f(v_bar); alpha <- Pi_[0,1](alpha - eta_alpha <v - w, grad f(v_bar)>), one backward pass."""
        local, global_module = site.module(LOCAL), site.module(GLOBAL)
        alpha = self.alpha.detach().clone().requires_grad_(self.options.adaptive)
        names = local.parameter_split.names("all")
        pairs = zip(names, live_parameters(local, "all"), live_parameters(global_module, "all"), strict=True)
        mixed = {name: mixture(alpha, v, w.detach()) for name, v, w in pairs}
        local.train()
        site.step(LOCAL, training_loss_with(local, mixed, batch), batch)
        if self.options.adaptive:
            rate = self.options.alpha_lr if self.options.alpha_lr is not None else site.learning_rate(LOCAL)
            self.alpha = (alpha.detach() - rate * alpha.grad).clamp(0.0, 1.0)

    def state_dict(self) -> dict:
        return {"alpha": self.alpha}

    def load_state_dict(self, state: dict) -> None:
        self.alpha = state["alpha"]


class APFL(FedAvg):
    name = "apfl"
    summary = "each site evaluates alpha v + (1 - alpha) w, its own model mixed with the FedAvg one, alpha learned"
    reference = "Deng, Kamani, Mahdavi, Adaptive personalized federated learning, arXiv 2003.13461 (2020)"
    slots = (GLOBAL, LOCAL, MIXED)
    evaluated_slot = MIXED
    delivered_slot = GLOBAL  # the evaluated mixture is rebuilt from the delivered global model
    Site = APFLSite

    @dataclass
    class Options:
        preset: str = "equal"
        """"equal": the steps' two passes each share trainer.local_epochs; "published": a step per mini-batch of it."""
        step_share: float | None = None
        """Epochs of steps per round, in units of trainer.local_epochs (two passes each); null: the preset's (1/2 or 1)."""
        alpha: float = 0.5
        """Initial mixing weight alpha_i of the local model (the authors' code's default)."""
        adaptive: bool = True
        """Learn alpha_i by projected gradient steps (APFL's adaptive variant); false keeps it fixed."""
        alpha_lr: float | None = None
        """eta_alpha: step of alpha's updates; null = the learning rate of the local model's optimiser."""

        def __post_init__(self) -> None:
            check_preset(self.preset)
            if self.step_share is None:
                self.step_share = by_preset(self.preset, 0.5, 1.0)
            require(self.step_share > 0, "step_share", self.step_share, "a positive multiple of trainer.local_epochs")
            require(0.0 <= self.alpha <= 1.0, "alpha", self.alpha, "a weight in [0, 1]")
            require(self.alpha_lr is None or self.alpha_lr >= 0, "alpha_lr", self.alpha_lr, "null or >= 0")
