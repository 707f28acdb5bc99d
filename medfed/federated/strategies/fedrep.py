"""FedRep (Collins, Hassani, Mokhtari, Shakkottai, "Exploiting shared representations for personalized federated learning", ICML 2021).

A model is a representation phi (the body, shared by every site) under a
head h_i (site i's own). Algorithm 1, round t, over the participants i::

    h_i <- tau_h local updates of the head, the body frozen at phi^t:
           h_i <- h_i - alpha grad_h f_i(h_i, phi^t)
    phi_i <- tau local updates of the body from phi^t, the head frozen at the new h_i:
           phi_i <- phi_i - alpha grad_phi f_i(h_i, phi_i)
    site i sends phi_i, never h_i
    server:  phi^{t+1} = sum_i n_i phi_i / sum_i n_i

and every site is delivered phi^{t+1} and evaluated with (phi^{t+1}, h_i).
The head starts each round from where the site's last round left it.

Body and head are the model's split (:mod:`medfed.models.split`): its body
and its head (U-Net: encoder / decoder; DenseNet: features /
classifier). The clinical logistic regression is all personal: the body is
empty, the body plan trains nothing, nothing but a sample count travels,
and FedRep is local training there, the head plan taking the body's share
of the budget as well (under the published preset, only its own).

The two stretches are two training plans of the round's one phase, named
``head`` and ``body`` (losses ``train_loss/fit/head`` and ``.../body``):
tau_h and tau are ``head_share`` and ``body_share`` times
``trainer.local_epochs`` epochs, or ``head_steps`` / ``body_steps``
optimiser steps when given. The frozen part gets no gradient, so the
model's one optimiser (Adam, per-parameter state) steps only the trained
part, as the authors' two optimisers do.

**Budget** (:mod:`medfed.federated.strategies.base`). By default (``preset:
equal``) the two plans share the round's budget E = ``trainer.local_epochs``
2 : 1, the authors' ratio: the head 2/3 E, the body 1/3 E (the body plan
continues the head plan's data order, so together they take the steps of E
epochs). ``preset: published`` is the authors' protocol as medfed shipped
it before: the head 2 E and the body E, about three times a FedAvg round's
passes (the head's backward passes stop at the head, its forward passes do
not).

Defaults and readings where the paper is silent:

- tau_h : tau = 2 : 1: the authors' scripts (CIFAR, FEMNIST) train the head
  10 epochs and the body 5.
- phi^{t+1} is the n_i-weighted mean: Algorithm 1 prints the plain mean over
  the participants, the authors' code weights by the sites' sample counts
  (medfed's FedAvg convention).
- Float buffers (BatchNorm running statistics, all in the DenseNet's body)
  stay at their site, as in :mod:`~medfed.federated.strategies.fedper`.
- Local updates are the model's optimiser (Adam) on mini-batches rather than
  the paper's SGD.
"""

from __future__ import annotations

from medfed.federated.protocol import RoundContext, TrainingPlan
from medfed.federated.strategies.fedavg import FedAvgSite
from medfed.federated.strategies.fedper import FedPer
from medfed.options.presets import EQUAL


class FedRepSite(FedAvgSite):
    """Trains its head with the body frozen, then the body with the head frozen; sends the body."""

    def plan(self, ctx: RoundContext) -> tuple[TrainingPlan, ...]:
        """The head's plan, then the body's. Under the equal preset a part without parameters (which trains
        nothing) leaves its share to the other."""
        options = self.options
        head_share, body_share = options.head_share, options.body_share
        if options.preset == EQUAL and self.split.size("body") == 0:  # e.g. the clinical logistic regression: all head
            head_share += body_share
        elif options.preset == EQUAL and self.split.size("head") == 0:
            body_share += head_share
        return (
            TrainingPlan(part="head", share=head_share, steps=options.head_steps, name="head"),
            TrainingPlan(part="body", share=body_share, steps=options.body_steps, name="body"),
        )


class FedRep(FedPer):
    Site = FedRepSite
