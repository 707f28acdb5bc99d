"""FPFC (Yu, Liu, Wang and Sun): personalised models fused in clusters by a concave pairwise penalty, solved by ADMM.

Yu, Liu, Wang and Sun, "Clustered federated learning based on nonconvex
pairwise fusion", arXiv 2211.04218 ("Fusion Penalized Federated Clustering").
Every site i has its own model w_i; all pairs are coupled by a concave fusion
penalty (SCAD, or MCP; :mod:`medfed.federated.strategies.solvers.concave_penalty`)::

    min_{w_1..w_N}  sum_i f_i(w_i) + sum_{i<j} g_lam(||w_i - w_j||)

so the sites whose models end close together fuse (their difference is set
to exactly 0) into clusters whose number nobody chooses, while distant sites
are left unpenalised. Splitting zeta_ij = w_i - w_j (dual v_ij; zeta_ji =
-zeta_ij, v_ji = -v_ij) gives the ADMM the paper runs with partial
participation A_t; in round t:

1. **server -> site i in A_t**: its centre::

       u_i = (1/N) sum_{j=1..N} (w_j + zeta_ij - v_ij / rho)        (zeta_ii = v_ii = 0)

2. **site i**: from its own w_i, local training (the trainer's epochs, the
   site's optimiser) of::

       f_i(w) + (rho / 2) ||w - u_i||^2

   (the augmented Lagrangian's w_i-block, sum_{j != i} <v_ij, w - w_j -
   zeta_ij> + rho/2 ||w - w_j - zeta_ij||^2, plus rho/2 ||w - w_i||^2, all
   divided by N: the device step of the authors' code), replying w_i;
3. **server**, for every pair with at least one member in A_t, with the
   newest models (a site's last reply stands for it otherwise)::

       zeta_ij = prox_{g / rho}(w_i - w_j + v_ij / rho)      (closed-form SCAD / MCP thresholding)
       v_ij   <- v_ij + rho (w_i - w_j - zeta_ij)

The server holds the N last models and the N(N-1)/2 pair vectors zeta and v
(O(N^2 d) memory: fine for N <= 10, never d x d); everything is vectorised
over the pairs. Every site starts from the seeded prototype, so zeta = v = 0
at the start.

**Which parameters.** The pairwise penalty acts on the model's *personal*
part; the *shared* part is averaged over the participants (sample-weighted)
and delivered, as the authors' code does for neural networks (penalty on the
last layer, every other layer averaged). With medfed's splits: U-Net decoder
and DenseNet classifier fused pairwise, encoder / features averaged; the
clinical logistic regression is all personal, which is the paper's
formulation exactly. Sites are evaluated with their own model (shared part
as delivered, personal part their own).

**Limits.** With lam = 0 the prox is the identity, so v stays 0 and zeta_ij =
w_i - w_j for every pair, and u_i = w_i: each site trains f_i(w) + rho/2
||w - w_i^t||^2 from its own model, local training with a proximal damping
(Local as rho -> 0; tested, with a hand computation). A lam large enough
fuses every site into one model.

*Where medfed follows the paper's code or chooses.* The full paper text was
not available to us; the updates follow the authors' implementation
(github.com/xueyu-ubc/FPFC). It updates a pair twice in a round when both
members take part (once from each end, the dual in between); here each
touched pair is updated once. Its SCAD thresholding is Huber-smoothed near 0
by xi (``smoothing``); the same smoothing is defined here for MCP. The
paper's warm-up strategy for choosing lam and its final post-processing
(averaging the models of sites found in one cluster) are not implemented;
the clusters are reported instead (metrics below). The shared average is
sample-weighted (the code's is plain).

**Defaults** (the authors' code for (F)MNIST with label swaps): lam = 0.4
(0.6 in its synthetic experiment), a = 3.7, rho = 1, xi = 1e-6, SCAD. lam is
in the units of parameter distances, so its useful range depends on the
model: the per-round metrics ``distance_min/mean/max`` (pairwise
||w_i - w_j|| of the personal parts) show where lam sits against them; a pair
fuses once its distance plus v / rho falls below lam (1 + 1/rho) (SCAD).

Metrics per round: ``distance_*``, ``fused_pairs`` (pairs with ||zeta_ij|| <= xi,
i.e. fused up to the smoothing), ``clusters`` (connected components of the
fused pairs) and ``residual`` (primal residual sqrt(sum ||w_i - w_j - zeta_ij||^2)).
"""

from __future__ import annotations

import itertools

import torch

from medfed.federated.strategies.solvers.concave_penalty import fusion_prox
from medfed.federated.strategies.solvers.graph import connected_components, incidence_matrix
from medfed.federated.protocol import (
    MODEL, NUM_SAMPLES, SETUP, Payload, RoundContext, SiteView, TrainingPlan, num_samples,
)
from medfed.federated.strategies.base import ServerHalf, Strategy
from medfed.federated.strategies.proximal import Proximal, ProximalSite


class FPFCServer(ServerHalf):
    """Holds the shared average, every site's last personal part and the pair variables zeta, v; runs the ADMM's server steps."""

    state_fields = ("shared", "models", "fusion", "duals", "last_step")

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.pairs = list(itertools.combinations(range(self.n_sites), 2))  # (i, j), i < j: row p of zeta and v

    def setup(self, ctx: RoundContext, initial: Payload, replies: dict[int, Payload]) -> None:
        self.shared = initial["shared"].clone()
        self.models = initial["personal"].reshape(1, -1).repeat(self.n_sites, 1)  # (N, d2): last w_j
        self.fusion = self.models.new_zeros(len(self.pairs), self.models.shape[1])  # (P, d2): zeta_ij
        self.duals = torch.zeros_like(self.fusion)  # (P, d2): v_ij
        self.last_step: dict[str, float] = {}

    def message(self, ctx: RoundContext, site_index: int) -> Payload:
        """x and u_i = (sum_j w_j + sum_{j != i} (zeta_ij - v_ij / rho)) / N."""
        row = incidence_matrix(self.pairs, self.n_sites, dtype=self.models.dtype, device=self.models.device)[site_index]  # (P,) +-1
        centre = self.models.sum(dim=0) + row @ self.fusion - (row @ self.duals) / self.options.rho
        return {"shared": self.shared, "personal": centre / self.n_sites}

    def reply_keys(self, ctx: RoundContext, site_index: int) -> tuple[frozenset[str], ...]:
        """Both parts and the sample count; nothing at setup."""
        return super().reply_keys(ctx, site_index) if ctx.phase == SETUP else (frozenset({"shared", "personal", NUM_SAMPLES}),)

    def aggregate(self, ctx: RoundContext, replies: dict[int, Payload]) -> None:
        self.shared = self.aggregation([r["shared"] for r in replies.values()], [float(r["num_samples"]) for r in replies.values()], self.shared)
        for index, reply in replies.items():
            self.models[index] = reply["personal"]
        touched = [p for p, (i, j) in enumerate(self.pairs) if i in replies or j in replies]
        if touched:
            rows = torch.tensor(touched, dtype=torch.int64, device=self.models.device)
            first, second = self._ends(touched)
            difference = self.models[first] - self.models[second]  # (T, d2) w_i - w_j
            rho = self.options.rho
            fused = fusion_prox(
                difference + self.duals[rows] / rho, self.options.penalty, self.options.lam, self.options.a, rho, self.options.smoothing
            )
            self.duals[rows] += rho * (difference - fused)
            self.fusion[rows] = fused
        self.last_step = self._diagnostics()

    def _ends(self, pairs: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Index tensors of the first and second member of each listed pair."""
        ends = torch.tensor([self.pairs[p] for p in pairs], dtype=torch.int64, device=self.models.device).reshape(-1, 2)
        return ends[:, 0], ends[:, 1]

    def _diagnostics(self) -> dict[str, float]:
        """Pairwise distances of the personal parts, fused pairs, clusters and the primal residual."""
        if not self.pairs:
            return {"clusters": 1.0}
        first, second = self._ends(list(range(len(self.pairs))))
        difference = self.models[first] - self.models[second]
        distances = torch.linalg.vector_norm(difference, dim=1, dtype=torch.float64)
        fused = (torch.linalg.vector_norm(self.fusion, dim=1, dtype=torch.float64) <= self.options.smoothing).tolist()
        edges = [pair for pair, is_fused in zip(self.pairs, fused) if is_fused]
        return {
            "distance_min": float(distances.min()),
            "distance_mean": float(distances.mean()),
            "distance_max": float(distances.max()),
            "fused_pairs": float(len(edges)),
            "clusters": float(len(connected_components(edges, self.n_sites))),
            "residual": float(torch.linalg.vector_norm(difference - self.fusion, dtype=torch.float64)),
        }

    def deliver(self, ctx: RoundContext, site_index: int) -> Payload:
        return {"shared": self.shared}

    def metrics(self) -> dict[str, float]:
        return dict(self.last_step)


class FPFCSite(ProximalSite):
    """Trains its own model on f_i(w) + rho/2 ||w_personal - u_i||^2 (u_i from the server), shared part from the average."""

    centre_key = "personal"  # u_i, the centre of the round's message

    def deliver(self, site: SiteView, ctx: RoundContext, payload: Payload) -> None:
        site.set(MODEL, "shared", payload["shared"])

    def receive(self, site: SiteView, ctx: RoundContext, payload: Payload) -> None:
        site.set(MODEL, "shared", payload["shared"])
        super().receive(site, ctx, payload)

    def proximal(self, ctx: RoundContext, plan: TrainingPlan) -> Proximal:
        """rho/2 ||w - u_i||^2 on the personal part (gradient rho (w - u_i))."""
        return Proximal(MODEL, "personal", self.options.rho)

    def reply(self, site: SiteView, ctx: RoundContext) -> Payload:
        super().reply(site, ctx)
        return {"shared": site.get(MODEL, "shared"), "personal": site.get(MODEL, "personal"), "num_samples": num_samples(site)}


class FPFC(Strategy):
    client_dp_refusal = "its server step needs each site's own vector: pairwise fusion variables"
    secure_aggregation_refusal = "its server step needs each site's own vector: pairwise fusion variables"
    robust_aggregation_refusal = None  # the shared part's average passes through the run's aggregation rule
    coded_keys = {"shared": "shared", "personal": "personal"}
    Server = FPFCServer
    Site = FPFCSite
