"""FedRoD (Chen and Chao, "On bridging generic and personalized federated learning for image classification", ICLR 2022).

A model is a body f(.; theta) (feature extractor) under two heads: a
*generic* head h_G(.; psi), trained by every site and averaged, and site
m's *personalised* head h_P(.; phi_m), which never leaves the site. With
z = f(x; theta) and g(x) = h_G(z; psi) the generic logits::

    generic predictor:       y^ = argmax g(x)
    personalised predictor:  y^ = argmax [ g(x) + h_P(z; phi_m) ]

Site m trains, for trainer.local_epochs epochs, on every mini-batch B at
once (one backward pass, one optimiser step)::

    L_m = BSM(theta, psi; B) + ERM(phi_m; B)
    BSM = mean_{(x,y) in B} -log [ N_{m,y}^gamma e^{g_y(x)} / sum_c N_{m,c}^gamma e^{g_c(x)} ]
        = the model's loss of g(x) + gamma log N_m                      (Balanced Softmax)
    ERM = the model's loss of sg(g(x)) + h_P(sg(z); phi_m)

N_{m,c} the site's training samples of class c (sg: stop-gradient), so
theta and psi learn from the class-balanced loss only and phi_m from the
empirical loss of the personalised prediction only. The server averages
(theta, psi) and the float buffers weighted by the sites' sample counts
(FedAvg) and delivers them; each site is evaluated with its personalised
predictor.

**Medfed's models.** The body and the generic head are the model's split
(:mod:`medfed.models.split`: shared = body, personal = head: U-Net encoder /
decoder, DenseNet features / classifier, the logistic regression's one
layer with an empty body). phi_m is a second copy of the personal part,
attached to every site's model by :meth:`FedRoD.prepare_slot`
(:mod:`medfed.models.additive_head`), which makes the model's forward the
personalised prediction; h_P(sg(z); phi_m) is the model's forward with the
body detached and the head's parameters replaced by phi_m, so this is the
full two-head architecture for all three models with no model code:

- DenseNet: a second linear classifier on the pooled features: the paper's
  linear personalised head (its hypernetwork variant is not implemented);
- logistic regression: a second logistic regression on the raw features
  (the body is empty), its log-odds added to the generic one; the generic
  model is the whole FedAvg-trained regression, so unlike FedPer and FedRep
  FedRoD does exchange a model on the clinical task;
- U-Net: a second decoder on the (detached) encoder features, every level
  through the skip connections, its per-pixel logits added to the generic
  decoder's.

"The model's loss" is its own training loss on the given logits: a
cross-entropy (DenseNet, logistic regression: binary cross-entropy of the
log-odds) or the U-Net's Dice + cross-entropy. Shifting the logits by
gamma log N is exactly the paper's BSM for a cross-entropy; for the U-Net
it is BSM per pixel, N counting the training pixels of each class
(:meth:`~medfed.models.base.FederatedModule.log_prior`), and the Dice term
sees the same shifted probabilities. A log-odds output (logistic regression,
the U-Net's ``task.regions: brats`` outputs) is shifted by gamma log(N_1 / N_0), which is
the two-logit BSM written as a log-odds; a class absent from a site's
training labels counts as 1.

Readings where the paper is silent, and PFLlib's choices:

- phi_m starts as a copy of the initial generic head (PFLlib's deep copy),
  identical at every site, so the first personalised logits are about twice
  the generic ones.
- The two losses are summed into one step of the model's optimiser (Adam;
  PFLlib steps two SGD optimisers, one per loss, on the same batch; with
  disjoint parameters the gradients are the same).
- The personalised term reruns the body (the features are not cached); its
  extra passes leave BatchNorm statistics as the generic pass left them, so
  each batch moves them once, as in PFLlib.
- With ``model.class_weight: balanced`` the classifiers' loss is
  reweighted as well: BSM then corrects the imbalance twice (the defaults
  weigh every sample 1).

Options: ``gamma``, the exponent of the class counts. The default 1 is Ren
et al.'s Balanced Softmax, the BSM the paper cites and PFLlib computes;
other values give the logit-adjusted losses of the same family (Menon et
al., ICLR 2021), and 0 trains the generic model on the plain empirical loss.

Only the personalised predictor is evaluated (the paper also reports the
generic one on a balanced test set: ``generic_output`` gives it).
"""

from __future__ import annotations

import torch

from medfed.federated.protocol import Payload, RoundContext, SiteView, TrainingPlan
from medfed.federated.strategies.fedavg import FedAvg, FedAvgSite
from medfed.federated.strategies.live_parameters import training_loss_with
from medfed.models.base import unwrap
from medfed.models.additive_head import attach_additive_head, generic_output
from medfed.models.base import FederatedModule


class FedRoDSite(FedAvgSite):
    """Trains body + generic head on BSM and its personal head on the empirical loss; sends body + generic head."""

    #: gamma log N_m, the Balanced Softmax's shift of the generic logits (the model's ``log_prior`` shape), from the
    #: site's training labels at its first message (not checkpointed: a resumed run computes the same again)
    loss_state = ("shift",)

    def receive(self, site: SiteView, ctx: RoundContext, payload: Payload) -> None:
        super().receive(site, ctx, payload)
        if self.shift is None:
            self.shift = self.options.gamma * unwrap(site.module(self.global_slot)).log_prior(site.data)

    def loss(self, site: SiteView, ctx: RoundContext, plan: TrainingPlan, batch) -> torch.Tensor:
        """BSM of the generic logits plus the empirical loss of the personalised ones, on one batch."""
        module = unwrap(site.module(plan.slot))
        return self.balanced_loss(module, batch) + self.personal_loss(module, batch)

    def balanced_loss(self, module: FederatedModule, batch) -> torch.Tensor:
        """BSM(theta, psi): the model's loss of the generic logits shifted by gamma log N_m."""
        with generic_output(module, self.shift):
            return module.training_step(batch, 0)

    @staticmethod
    def personal_loss(module: FederatedModule, batch) -> torch.Tensor:
        """ERM(phi_m): the model's loss of sg(g) + h_P(sg(z); phi_m), run on copies of the model's buffers.

        Its two body passes would move the BatchNorm running statistics
        again, for a batch the generic pass has already counted; on copies
        (dropped after the step) they leave them as the generic pass did.
        """
        copies = {name: buffer.clone() for name, buffer in module.named_buffers()}
        return training_loss_with(module, copies, batch)


class FedRoD(FedAvg):
    dp_sgd_refusal = "its loss passes each batch through the model twice (generic and personalised logits), which Opacus's per-sample hooks do not add up (tests/test_privacy.py)"
    Site = FedRoDSite

    @classmethod
    def prepare_slot(cls, slot: str, module: FederatedModule) -> None:
        """Every site's model gets its personalised head phi_m (a copy of the initial generic head)."""
        attach_additive_head(module)
