"""FedBN (Li et al., "FedBN: Federated learning on non-IID features via local batch normalization", ICLR 2021).

FedAvg over everything except the BatchNorm layers: their affine parameters
(weight, bias) *and* their running statistics (mean, variance, step counter)
stay at their site, so each site normalises its features with its own
statistics (the paper's remedy for feature shift between sites). Averaged,
sample-weighted as in :mod:`~medfed.federated.strategies.fedavg`: every
parameter outside BatchNorm layers (vector ``"all_except_batchnorm"``) and
every floating-point buffer outside them (``"buffers_except_batchnorm"``,
empty for medfed's models). A model without BatchNorm layers (the BraTS
U-Net uses instance normalisation) makes FedBN exactly FedAvg.
"""

from __future__ import annotations

from medfed.federated.strategies.fedavg import Averaged, FedAvg


class FedBN(FedAvg):
    dp_sgd_refusal = "DP-SGD replaces BatchNorm by GroupNorm, which leaves FedBN nothing to keep at the site: it would be FedAvg"
    averaged = Averaged("all_except_batchnorm", "buffers_except_batchnorm")
