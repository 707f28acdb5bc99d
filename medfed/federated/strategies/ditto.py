"""Ditto (Li, Hu, Beirami, Smith, ICML 2021): a FedAvg global model and a personal model kept near it.

"Ditto: fair and robust federated learning through personalization",
Algorithm 1. Site k holds two models: the global model w, trained and
averaged as in FedAvg, and its personal model v_k, which never leaves it
and solves

    min_v  h_k(v; w*) = F_k(v) + lambda / 2 * ||v - w*||^2                 (eq. 2)

with w* the global model. In round t every participant k receives w^t and

1. trains w from w^t as FedAvg's local update does and sends it; the server
   averages the replies into w^{t+1} (FedAvg's halves, subclassed here);
2. takes the personal plan's steps on v_k, on h_k(v; w^t): gradient
   grad F_k(v) + lambda (v - w^t), w^t the global model it received this
   round (not the one it is training).

Sites are evaluated with v_k. A site that skips a round leaves v_k as it
is; the global model reaches every site at the end of each round (FedAvg's
delivery), so it trains from the newest one when it next takes part.

**Model slots and plans.** ``global`` (w, the slot FedAvg's site half
trains, replies and receives) and ``personal`` (v_k, evaluated). The
round's one phase has two training plans: the global plan, then the
personal plan (``personal_epochs`` or ``personal_steps`` set its length
outright, the paper's s local iterations). The personal plan draws its
batches from a data order of its own (``TrainingPlan.data_order``), so
neither model's batches depend on how long the other trains. It follows
that the global model is a FedAvg run's, bit for bit, whatever lambda, when
that run's budget is the global plan's; and that at lambda = 0 (no term is
added at all) the personal model is a Local run's, bit for bit, when that
run's budget is the personal plan's and whole epochs (the round's budget is
cut at whole mini-batches along one axis, so a half epoch after the global
plan's may end one mini-batch from where Local's would): its own steps on its own data in the
batch order a Local site draws, the optimiser state carried across rounds
(for models whose training draws nothing from the global generators, e.g.
without dropout: within a phase those are shared between the two plans). As
lambda grows the minimiser of eq. 2 tends to w^t, at distance
||(H + lambda I)^-1 grad F_k(w^t)|| for a quadratic F_k with Hessian H
(``tests/test_ditto.py`` checks both limits).

**Budget** (:mod:`medfed.federated.strategies.base`). By default (``preset:
equal``) the two plans share the round's budget E = ``trainer.local_epochs``
equally: E/2 epochs each (``global_share``, ``personal_share``), so a Ditto
round costs a FedAvg round's passes. ``preset: published`` is the paper's
protocol as medfed shipped it before: the global model E epochs, as FedAvg
trains, and the personal model as many again (2 E in all).

**BatchNorm buffers.** Each model keeps its own running statistics: w's are
averaged with w (FedAvg), v_k's are updated by v_k's own training steps.

**Where medfed differs.** The paper's global update may be any FedAvg-like
solver with uniform averaging over sampled devices; medfed's is FedAvg's
sample-weighted average over its uniformly drawn participants. PFLlib trains
the personal model first and puts lambda (v - w) inside a custom SGD step;
here the global model trains first (the order does not matter: the
personal term is anchored at the w^t received, kept aside) and the term is
part of the loss, so any optimiser descends h_k.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from medfed.config import require
from medfed.federated.strategies.base import DELIVER, Payload, RoundContext, SiteView, TrainingPlan
from medfed.federated.strategies.fedavg import FedAvg, FedAvgSite
from medfed.federated.strategies.live_parameters import proximal_term
from medfed.federated.strategies.presets import by_preset, check_preset

GLOBAL, PERSONAL = "global", "personal"


class DittoSite(FedAvgSite):
    """FedAvg's site half on the ``global`` slot, then the personal model's steps on h_k(v; w^t)."""

    global_slot = GLOBAL

    def receive(self, site: SiteView, ctx: RoundContext, payload: Payload) -> None:
        super().receive(site, ctx, payload)
        if ctx.phase != DELIVER:  # w^t: the global model the round starts from, before the global plan trains it
            self.anchor = site.get(GLOBAL, "all")

    def plan(self, ctx: RoundContext) -> tuple[TrainingPlan, ...]:
        """The global plan, then the personal plan in its own data order (their lengths: the module docstring's budget)."""
        options = self.options
        personal = TrainingPlan(
            slot=PERSONAL, share=options.personal_share, epochs=options.personal_epochs, steps=options.personal_steps, data_order=PERSONAL
        )
        return (TrainingPlan(slot=GLOBAL, share=options.global_share), personal)

    def regularizer(self, site: SiteView, ctx: RoundContext, plan: TrainingPlan) -> torch.Tensor | None:
        """lambda / 2 * ||v - w^t||^2 on the personal model's live parameters; none for the global plan or at lambda = 0."""
        if plan.slot != PERSONAL or self.options.lam == 0:
            return None
        return proximal_term(site.module(PERSONAL), "all", self.anchor, self.options.lam)

    def reply(self, site: SiteView, ctx: RoundContext) -> Payload:
        del self.anchor  # only needed while training
        return super().reply(site, ctx)


class Ditto(FedAvg):
    name = "ditto"
    summary = "a FedAvg global model, and a personal model per site trained near it (lambda/2 ||v - w||^2)"
    reference = "Li, Hu, Beirami, Smith, Ditto: fair and robust federated learning through personalization, ICML 2021"
    slots = (GLOBAL, PERSONAL)
    evaluated_slot = PERSONAL
    delivered = None  # the delivery sets the global slot; the evaluated personal model never leaves the site
    Site = DittoSite

    @dataclass
    class Options:
        lam: float = 0.1
        """lambda: pull of the personal model towards the global one; 0 = Local's model, large = the
        global model. The paper tunes it per data set over a small grid between 0.01 and 2; 0.1 is not
        tuned on medfed's tasks."""
        preset: str = "equal"
        """"equal": the global and personal plans share trainer.local_epochs equally; "published": each trains all of it."""
        global_share: float | None = None
        """Epochs of the global model per round, in units of trainer.local_epochs; null: the preset's (1/2 or 1)."""
        personal_share: float | None = None
        """Epochs of the personal model per round, in units of trainer.local_epochs; null: the preset's (1/2 or 1)."""
        personal_epochs: float | None = None
        """Epochs of the personal model per round instead (overrides personal_share)."""
        personal_steps: int | None = None
        """Optimiser steps of the personal model per round instead of epochs (the paper's s)."""

        def __post_init__(self) -> None:
            check_preset(self.preset)
            if self.global_share is None:
                self.global_share = by_preset(self.preset, 0.5, 1.0)
            if self.personal_share is None:
                self.personal_share = by_preset(self.preset, 0.5, 1.0)
            require(self.global_share > 0, "global_share", self.global_share, "a positive multiple of trainer.local_epochs")
            require(self.personal_share > 0, "personal_share", self.personal_share, "a positive multiple of trainer.local_epochs")
            require(self.lam >= 0, "lam", self.lam, "lambda >= 0")
            require(self.personal_epochs is None or self.personal_epochs > 0, "personal_epochs", self.personal_epochs, "null or > 0")
            require(self.personal_steps is None or self.personal_steps >= 1, "personal_steps", self.personal_steps, "null or >= 1")
            require(
                self.personal_epochs is None or self.personal_steps is None,
                "personal_steps",
                self.personal_steps,
                "null when personal_epochs is set (one length, epochs or steps)",
            )
