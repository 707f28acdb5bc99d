"""FedBABU (Oh, Kim and Yun, ICLR 2022): the body trained and averaged with the head frozen; the head fine-tuned to evaluate.

"FedBABU: Towards enhanced representation for federated image
classification". A model is a body (every layer but the last) under a head
(its last layer). During federated training the head is never updated: it
stays at its random initialisation, the same at every site (the run's seeded
prototype), and every site trains only the body; the server averages the
bodies (FedAvg: sample-weighted, the floating-point buffers too) and
delivers the average. Personalisation is fine-tuning: before every
evaluation each site starts from the delivered global model and fine-tunes
it on its own training data (the loop's *adapt* step,
:meth:`~medfed.federated.protocol.SiteHalfProtocol.adapt`), then is
evaluated with it::

    round t, site i:   body_i <- local steps on F_i(body, head_0) from body^t   (head frozen at head_0)
    server:            body^{t+1} = sum_i n_i body_i / sum_i n_i
    evaluation:        (body, head)_i <- fine-tuning of (body^{t+1}, head_0) on site i's data; evaluate it

**The split.** FedBABU's head is the model's last layer (the module holding
its last parameters: the U-Net's final 1x1 convolution, not the decoder; the
DenseNet's classifier), whatever the run's shared/personal split:
:meth:`FedBABU.prepare_slot` re-splits every slot's module into body
("shared", or ``"body"``) and head ("personal", or ``"head"``), and the body
travels under the payload key ``"body"``, coded against the initial model's body
(:meth:`FedBABU.initial_values`). A model of one layer (the clinical
logistic regression) has no head apart from its body: the whole model is the
body, trained and averaged, and the adapt step fine-tunes all of it, so
FedBABU is then FedAvg with fine-tuning (its global model is FedAvg's, bit
for bit).

**Model slots.** ``global`` (the body trained with the head frozen, sent,
set by the delivery) and ``personalised`` (evaluated): at every delivery it
is loaded with the global model (parameters and buffers), and the adapt
step fine-tunes ``finetune_part`` of it in a data order of its own, so
fine-tuning never feeds back into federated training nor moves the
training batches. Its passes count as ``adapt/finetune`` in the run's
compute.

**Where medfed differs.** The paper fine-tunes with plain SGD for a few
epochs (its Table 4 varies them) and reports both head-only and whole-model
fine-tuning; here the fine-tuning uses the ``personalised`` slot's own
optimiser (the task's, e.g. Adam, whose state carries over from one
round's fine-tuning to the next), ``finetune_part`` chooses the head
("personal", the default, as the method's description) or the whole model
("all"), and ``finetune_epochs`` / ``finetune_steps`` the length. The
average is FedAvg's sample-weighted one over the round's participants.
"""

from __future__ import annotations

import re

import torch

from medfed.federated.protocol import Payload, RoundContext, SiteView, TrainingPlan
from medfed.federated.strategies.fedavg import Averaged, FedAvg, FedAvgSite
from medfed.models.base import FederatedModule
from medfed.models.split import ParameterSplit

GLOBAL, PERSONALISED = "global", "personalised"
BODY = "body"
FINETUNE = "finetune"


def head_names(split: ParameterSplit) -> tuple[str, ...]:
    """The parameters of the model's last layer (the module holding its last parameter), model order;
    none for a model of one layer, which is all body."""
    names = split.names("all")
    last_module = names[-1].rpartition(".")[0]
    head = tuple(name for name in names if name.rpartition(".")[0] == last_module)
    return () if len(head) == len(names) else head


class FedBABUSite(FedAvgSite):
    """Trains the body of ``global`` (head frozen); loads and fine-tunes ``personalised`` before every evaluation."""

    global_slot = GLOBAL

    def deliver(self, site: SiteView, ctx: RoundContext, payload: Payload) -> None:
        super().deliver(site, ctx, payload)  # the body (of the re-split module) and the buffers into ``global``
        for part in ("all", "buffers"):  # the model to fine-tune: the global one, head at its initialisation
            site.set(PERSONALISED, part, site.get(GLOBAL, part))

    def plan(self, ctx: RoundContext) -> tuple[TrainingPlan, ...]:
        """The body for the trainer's epochs, the head frozen."""
        return (TrainingPlan(slot=GLOBAL, part=BODY),)

    def adapt(self, ctx: RoundContext) -> tuple[TrainingPlan, ...]:
        """Fine-tune ``finetune_part`` of the personalised model (all of a one-layer model) in its own data order."""
        options = self.options
        epochs = None if options.finetune_steps is not None else options.finetune_epochs
        part = options.finetune_part if head_names(self.split) else "all"
        return (
            TrainingPlan(slot=PERSONALISED, part=part, epochs=epochs, steps=options.finetune_steps, name=FINETUNE, data_order=FINETUNE),
        )


class FedBABU(FedAvg):
    #: the body of the re-split module (every layer but the last), coded against the initial model's body
    #: (:meth:`initial_values`), and the buffers
    averaged = Averaged(BODY, "buffers")
    slots = (GLOBAL, PERSONALISED)
    evaluated_slot = PERSONALISED
    Site = FedBABUSite

    def __init__(self, options, split: ParameterSplit, n_sites: int, seed: int) -> None:
        super().__init__(options, split, n_sites, seed)
        head = head_names(split)
        names = split.names("all")
        #: which entries of the "all" vector are the body's, (size("all"),) bool
        self.body_mask = torch.cat(
            [torch.full((split.numels[name],), name not in head, dtype=torch.bool, device="cpu") for name in names]
        )

    @classmethod
    def prepare_slot(cls, slot: str, module: FederatedModule) -> None:
        """Every slot's module split into body ("shared") and head ("personal": its last layer)."""
        names = module.parameter_split.names("all")
        head = set(head_names(module.parameter_split))
        module.configure_split(
            personal_patterns=[f"^{re.escape(name)}$" for name in names if name in head],
            shared_patterns=[f"^{re.escape(name)}$" for name in names if name not in head],
        )

    def initial_values(self, model: Payload) -> Payload:
        """The model's parts and its body as ``"body"`` (what the first message of a site's body is coded against)."""
        return {**model, BODY: model["all"][self.body_mask.to(model["all"].device)]}
