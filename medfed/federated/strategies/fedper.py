"""FedPer (Arivazhagan, Aggarwal, Singh, Choudhary, "Federated learning with personalization layers", arXiv:1912.00818, 2019).

A model is *base layers* W_B, shared by every site, under *personalization
layers* W_P,j, site j's own. Round t, over the participants j (n_j training
samples each)::

    site j:  (W_B,j, W_P,j) <- local training of every layer from (W_B^t, W_P,j)
             for trainer.local_epochs epochs; sends W_B,j, never W_P,j
    server:  W_B^{t+1} = sum_j n_j W_B,j / sum_j n_j          (FedAvg over the base)

and every site is delivered W_B^{t+1} and evaluated with (W_B^{t+1}, W_P,j).

Base and personalization layers are the model's split
(:mod:`medfed.models.split`): its body = base, its head = personalization
layers (U-Net: encoder / decoder; DenseNet: features / classifier). The
clinical logistic regression is all personal: the base is empty, nothing but
a sample count travels and FedPer *is* local training there
(``tests/test_fedper.py``).

Readings where the paper is silent:

- The base is averaged weighted by n_j (the paper's FedAvg step, as PFLlib).
- Float buffers (BatchNorm running statistics; in medfed's models only the
  DenseNet's, all in its base) stay at their site: the paper averages
  layer weights, and PFLlib averages parameters only (medfed's FedAvg, in
  contrast, averages the statistics too). Batch-norm layers of the base thus
  share their affine weights but normalise with the site's own statistics,
  as in FedBN.
- Local training uses the model's optimiser (Adam, its state kept across
  rounds) rather than the paper's plain SGD, as every medfed strategy does.

Options: none (the paper's only knobs are the local epochs and batch size,
``trainer.local_epochs`` and ``trainer.batch_size``).
"""

from __future__ import annotations

from medfed.federated.strategies.fedavg import Averaged, FedAvg


class FedPer(FedAvg):
    averaged = Averaged("body", None)  # the base layers; the personalisation layers (the head) and the buffers stay
