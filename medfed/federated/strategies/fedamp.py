"""FedAMP (Huang et al. 2021): federated attentive message passing (``shared/papers/fedamp-summary.md``).

Objective over the sites' personalised models W = [w_1 ... w_N]::

    min_W  sum_i F_i(w_i) + lam * sum_{i<j} A(||w_i - w_j||^2),   A(t) = 1 - exp(-t / sigma)

Each round alternates the two parts:

1. **server** — a gradient step of size alpha on the attention term turns
   the last models into one *cloud model* per site, a convex combination::

       u_i = sum_j xi_ij w_j,   xi_ij = alpha * A'(||w_i - w_j||^2)  (j != i),
       xi_ii = 1 - sum_{j != i} xi_ij,   A'(t) = exp(-t / sigma) / sigma

   (``variant: exponential``; ``xi_ii >= 0`` needs alpha (N - 1) / sigma <= 1,
   checked). For deep networks, where Euclidean distances between models of
   ~10^6 parameters are uninformative, the paper's heuristic (``variant:
   heuristic``) uses cosine similarity instead, with xi_ii a hyper-parameter::

       xi_ij = (1 - xi_ii) * softmax_{j != i}(cosine_scale * cos(w_i, w_j))

2. **site** — site i starts from u_i (as FedAMP's code does) and trains w_i
   on the proximal objective F_i(w) + lam / (2 alpha) * ||w - u_i||^2. The
   penalty is computed from the live parameters, so its gradient
   (lam / alpha)(w - u_i) reaches the optimiser (the popular library's
   detached, unsquared version has none: bug 6 of
   ``shared/design/algorithms.md``).

The server keeps every site's last uploaded model (a site that skipped rounds
keeps its last one, or the initial model) and derives all pairwise distances
and cosines from the N x N Gram matrix of those models (O(N^2 d) time, no
d x d or N x N x d array). The whole model is personalised (the shared /
personal split is not used) and sites are evaluated with their own w_i:
nothing is delivered.
"""

from __future__ import annotations

import torch

from medfed.errors import ConfigError
from medfed.federated.protocol import MODEL, SETUP, Payload, RoundContext, SiteView, TrainingPlan
from medfed.federated.strategies.base import ServerHalf, Strategy
from medfed.federated.strategies.proximal import Proximal, ProximalSite


def gram_matrix(models: torch.Tensor) -> torch.Tensor:
    """Inner products of every pair of models.

    Args:
        models: ``(N, d)``, one flattened model per row.

    Returns:
        float64 ``(N, N)``, entry (i, j) = <w_i, w_j>.
    """
    wide = models.to(torch.float64)
    return wide @ wide.T


def exponential_attention(models: torch.Tensor, alpha: float, sigma: float) -> torch.Tensor:
    """FedAMP's message-passing weights for A(t) = 1 - exp(-t / sigma).

    Args:
        models: ``(N, d)`` flattened models.
        alpha: the server's step size alpha_k on the attention term.
        sigma: A's scale, in the units of squared parameter distances.

    Returns:
        float64 ``(N, N)`` row-stochastic xi: off the diagonal
        ``alpha * exp(-||w_i - w_j||^2 / sigma) / sigma``, on it one minus the
        row's other entries.
    """
    gram = gram_matrix(models)
    norms = gram.diagonal()
    squared_distances = (norms[:, None] + norms[None, :] - 2.0 * gram).clamp_min(0.0)
    xi = alpha * torch.exp(-squared_distances / sigma) / sigma
    xi.fill_diagonal_(0.0)
    xi += torch.diag(1.0 - xi.sum(dim=1))
    return xi


def heuristic_attention(models: torch.Tensor, self_weight: float, cosine_scale: float) -> torch.Tensor:
    """FedAMP's heuristic weights for deep networks: a softmax of scaled cosine similarities.

    Args:
        models: ``(N, d)`` flattened models (a zero model has cosine 0 with all).
        self_weight: xi_ii, the same for every site.
        cosine_scale: the paper's sigma multiplying the cosine inside the softmax.

    Returns:
        float64 ``(N, N)`` row-stochastic xi with ``self_weight`` on the
        diagonal and ``(1 - self_weight) * softmax_{j != i}(cosine_scale *
        cos(w_i, w_j))`` off it (a lone site gets xi = [[1]]).
    """
    n = models.shape[0]
    if n == 1:
        return torch.ones(1, 1, dtype=torch.float64, device=models.device)
    gram = gram_matrix(models)
    norms = gram.diagonal().sqrt().clamp_min(torch.finfo(torch.float64).tiny)
    logits = cosine_scale * gram / (norms[:, None] * norms[None, :])
    logits.fill_diagonal_(-torch.inf)
    xi = (1.0 - self_weight) * torch.softmax(logits, dim=1)
    xi += torch.diag(torch.full((n,), self_weight, dtype=torch.float64, device=models.device))
    return xi


class FedAMPServer(ServerHalf):
    """Keeps every site's last model; sends each site its cloud model u_i."""

    state_fields = ("models", "attention")

    def setup(self, ctx: RoundContext, initial: Payload, replies: dict[int, Payload]) -> None:
        self.models = initial["all"].reshape(1, -1).repeat(self.n_sites, 1)  # (N, d): last w_j of every site
        self.attention = self._attention()

    def _attention(self) -> torch.Tensor:
        """xi (N, N) float64 from the models the server holds now."""
        if self.options.variant == "exponential":
            return exponential_attention(self.models, self.options.alpha, self.options.sigma)
        return heuristic_attention(self.models, self.options.self_weight, self.options.cosine_scale)

    def message(self, ctx: RoundContext, site_index: int) -> Payload:
        weights = self.attention[site_index].to(self.models.dtype)
        return {"all": weights @ self.models}  # the cloud model u_i

    def reply_keys(self, ctx: RoundContext, site_index: int) -> tuple[frozenset[str], ...]:
        """The site's trained model; nothing at setup."""
        return super().reply_keys(ctx, site_index) if ctx.phase == SETUP else (frozenset({"all"}),)

    def aggregate(self, ctx: RoundContext, replies: dict[int, Payload]) -> None:
        for index, reply in replies.items():
            self.models[index] = reply["all"]
        self.attention = self._attention()

    def metrics(self) -> dict[str, float]:
        return {"self_attention_mean": float(self.attention.diagonal().mean())}


class FedAMPSite(ProximalSite):
    """Trains w_i from its cloud model u_i on F_i(w) + lam / (2 alpha) ||w - u_i||^2."""

    centre_key = "all"  # u_i, the cloud model of the round's message

    def receive(self, site: SiteView, ctx: RoundContext, payload: Payload) -> None:
        site.set(MODEL, "all", payload["all"])  # w_i starts from u_i
        super().receive(site, ctx, payload)

    def proximal(self, ctx: RoundContext, plan: TrainingPlan) -> Proximal:
        """lam / (2 alpha) * ||w - u_i||^2 on the whole model (gradient (lam / alpha)(w - u_i))."""
        return Proximal(MODEL, "all", self.options.lam / self.options.alpha)

    def reply(self, site: SiteView, ctx: RoundContext) -> Payload:
        super().reply(site, ctx)
        return {"all": site.get(MODEL, "all")}


class FedAMP(Strategy):
    client_dp_refusal = "its server step needs each site's own vector: attention weights between pairs of sites"
    secure_aggregation_refusal = "its server step needs each site's own vector: attention weights between pairs of sites"
    robust_aggregation_refusal = "its server step combines the sites' models per site, weighted by attention between pairs of sites: no average to make robust"
    Server = FedAMPServer
    Site = FedAMPSite


    def __init__(self, options, split, n_sites: int, seed: int) -> None:
        super().__init__(options, split, n_sites, seed)
        largest_off_diagonal_sum = options.alpha * (n_sites - 1) / options.sigma
        if options.variant == "exponential" and largest_off_diagonal_sum > 1.0:
            raise ConfigError(
                f"config keys 'strategy.fedamp.alpha' = {options.alpha} and 'strategy.fedamp.sigma' = {options.sigma}: "
                f"with {n_sites} sites xi_ii = 1 - sum_j xi_ij can reach 1 - alpha (N-1)/sigma = "
                f"{1.0 - largest_off_diagonal_sum:.3g} < 0 (u_i would not be a convex combination); "
                "expected alpha * (N - 1) / sigma <= 1"
            )
