"""LG-FedAvg (Liang, Liu, Ziyin, Allen, Auerbach, Brent, Salakhutdinov, Morency, "Think locally, act globally:
federated learning with local and global representations", arXiv:2001.01523, 2020).

Each site m keeps a *local* model l_m(x; theta^l_m) that maps its raw inputs
to a representation H = l_m(x), and all sites share one *global* model
g(H; theta^g) on top of it. Round t, over the participants m (n_m training
samples each)::

    site m:  (theta^l_m, theta^g_m) <- local training of both on
                 L_m(theta^l, theta^g) = E_{(x, y) ~ D_m} loss(g(l_m(x; theta^l); theta^g), y)
             from (theta^l_m, theta^g_t) for trainer.local_epochs epochs; sends theta^g_m, never theta^l_m
    server:  theta^g_{t+1} = sum_m n_m theta^g_m / sum_m n_m

and every site is delivered theta^g_{t+1} and evaluated with (theta^l_m, theta^g_{t+1}).
The local representation absorbs what differs between sites (their inputs:
scanners, missing sequences); only the global model, on top of it, travels.

The local model is the model's body and the global model its head
(:data:`~medfed.models.split.ROLES`: the split's shared and personal parts;
U-Net: encoder local, decoder global; DenseNet: features local, classifier
global): FedPer's split with the roles reversed, which is all this strategy
declares (:class:`~medfed.federated.strategies.fedavg.Averaged`). Buffers
(BatchNorm running statistics) stay at their site. The clinical logistic
regression is all head: everything is averaged, and LG-FedAvg is FedAvg
there (``tests/test_lgfedavg.py``).

**Where medfed differs.** The server step weights the global models by n_m
(medfed's FedAvg convention); the authors' code (``main_lg.py``) averages
them uniformly over the participants, the same at equal site sizes. The
authors start every site from a FedAvg-pretrained model and report each
site's best round on its test data; here every site starts from the run's
seeded prototype and is evaluated every round, as every medfed strategy is.
The representation is learnt end to end on the task's loss (the paper's
supervised variant; its auxiliary unsupervised and adversarial local
objectives are not implemented). Local training uses the model's own
optimiser (Adam) rather than SGD.

Options: none (local epochs and batch size are ``trainer.local_epochs`` and
``trainer.batch_size``).
"""

from __future__ import annotations

from medfed.federated.strategies.fedavg import Averaged, FedAvg


class LGFedAvg(FedAvg):
    averaged = Averaged("head", None)  # the global model on top; the local representation (the body) and the buffers stay
