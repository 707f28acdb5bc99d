"""pFedNet (Zhao et al.): shared + personal components linked by a similarity network.

Objective (``shared/design/algorithms.md``)::

    min_{x, Z}  (1/N) sum_n f_n(M x + N z_n)  +  lam * ||Z Q||_{1,p}

with Q the incidence matrix of a symmetric KNN graph over the sites' data
sketches. One round alternates two phases:

1. **shared** — each site trains only its shared coordinates from x_t (its
   personal part frozen); the server averages them (sample-weighted) into
   x_{t+1};
2. **personal** — each site receives x_{t+1}, trains only its personal
   coordinates from z_n, giving z~_n; the server solves the network-lasso
   proximal problem exactly by ADMM::

       Z_{t+1} = argmin_Z 1/(2 eta_s) ||Z - Z~||_F^2 + lam ||Z Q||_{1,p}

   and delivers z_{t+1,n}, so site n is evaluated with M x_{t+1} + N z_{t+1,n}.

A site that skipped the round keeps its column of Z as the proximal centre.
The graph is built once, before round 1, from sketches that reveal no sample
(:mod:`medfed.federated.sketch`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from medfed.config import require
from medfed.federated.aggregate import weighted_average
from medfed.federated.graph import incidence_matrix, knn_edges
from medfed.federated.network_lasso import AdmmState, solve_network_lasso
from medfed.federated.sketch import data_sketch
from medfed.federated.strategies.base import DELIVER, Payload, Strategy, num_samples

P_NORMS = {"1": 1.0, "2": 2.0, "inf": float("inf")}


class PFedNet(Strategy):
    name = "pfednet"
    phases = ("shared", "personal")

    @dataclass
    class Options:
        lam: float = 1.0
        """lambda: strength of the graph penalty (0 = independent personal parts)."""
        server_lr: float = 0.01
        """eta_s: weight 1/(2 eta_s) of the proximal term around the sites' trained z~.

        The paper's step is a gradient step on (1/N) sum_n f_n; a site's local
        training minimises f_n itself, i.e. takes N times that step, so eta_s is
        about N x the local learning rate (5 sites x 3e-3 = 0.015 for the U-Net
        config). lam * eta_s is the per-edge shrinkage in parameter units."""
        p: str = "2"
        """Column norm of the penalty: "1", "2" or "inf"."""
        knn_k: int = 3
        rho: float | None = None
        """ADMM penalty; default 1 / server_lr (then adapted by residual balancing)."""
        admm_max_iter: int = 500
        admm_abs_tol: float = 1e-6
        admm_rel_tol: float = 1e-5
        full_epoch_per_phase: bool = False
        """True: each phase trains all of trainer.local_epochs (the paper's setting: twice a
        one-phase baseline's local steps per round); False: each phase takes half of them, so a
        round takes the local steps a FedAvg round takes."""

        def __post_init__(self) -> None:
            require(self.lam >= 0, "lam", self.lam, "lambda >= 0")
            require(self.server_lr > 0, "server_lr", self.server_lr, "eta_s > 0")
            require(str(self.p) in P_NORMS, "p", self.p, "one of 1, 2, inf")
            require(self.knn_k >= 1, "knn_k", self.knn_k, "k >= 1")
            require(self.rho is None or self.rho > 0, "rho", self.rho, "null or rho > 0")
            require(self.admm_max_iter >= 1, "admm_max_iter", self.admm_max_iter, ">= 1")

    # ------------------------------------------------------------------ server side
    def server_setup(self, initial: Payload, replies: dict[int, Payload]) -> None:
        sketches = torch.stack([replies[i]["sketch"] for i in range(self.n_sites)]).to(torch.float64)
        self.edges = knn_edges(sketches, self.options.knn_k)
        self.shared = initial["shared"].clone()
        self.personal = initial["personal"].reshape(-1, 1).repeat(1, self.n_sites)  # Z: (d2, N)
        self.admm_state = None
        self.last_solve: dict[str, float] = {}
        self.sites_holding_shared: set[int] = set()

    def server_message(self, phase: str, site_index: int) -> Payload:
        if phase == "personal":
            self.sites_holding_shared.add(site_index)
            return {"shared": self.shared}
        return {}

    def server_aggregate(self, phase: str, replies: dict[int, Payload]) -> None:
        if phase == "shared":
            self.shared = weighted_average(
                [r["shared"] for r in replies.values()], [float(r["num_samples"]) for r in replies.values()]
            )
            self.sites_holding_shared = set()
            return
        centre = self.personal.clone()
        for index, reply in replies.items():
            centre[:, index] = reply["personal"]
        self.personal = self._network_lasso_step(centre)

    def _network_lasso_step(self, centre: torch.Tensor) -> torch.Tensor:
        """Solve the server's proximal problem around ``centre`` (d2, N); warm-started."""
        if centre.shape[0] == 0:
            return centre
        q = incidence_matrix(self.edges, self.n_sites, dtype=centre.dtype)
        result = solve_network_lasso(
            centre,
            q,
            lam=self.options.lam,
            eta=self.options.server_lr,
            p=P_NORMS[str(self.options.p)],
            rho=self.options.rho,
            max_iter=self.options.admm_max_iter,
            abs_tol=self.options.admm_abs_tol,
            rel_tol=self.options.admm_rel_tol,
            warm_start=self.admm_state,
        )
        self.admm_state = result.state
        self.last_solve = {
            "admm_iterations": float(result.iterations),
            "admm_primal_residual": float(result.primal_residual),
            "admm_dual_residual": float(result.dual_residual),
            "personal_spread": float((result.Z - result.Z.mean(dim=1, keepdim=True)).norm()),
        }
        return result.Z

    def server_deliver(self, site_index: int) -> Payload:
        payload = {"personal": self.personal[:, site_index]}
        if site_index not in self.sites_holding_shared:
            payload["shared"] = self.shared
        return payload

    def server_metrics(self) -> dict[str, float]:
        return {"graph_edges": float(len(self.edges)), **self.last_solve}

    def server_state_dict(self) -> dict:
        return {
            "edges": list(self.edges),
            "shared": self.shared,
            "personal": self.personal,
            "admm_state": None if self.admm_state is None else dataclasses.asdict(self.admm_state),
            "last_solve": self.last_solve,
            "sites_holding_shared": sorted(self.sites_holding_shared),
        }

    def load_server_state_dict(self, state: dict) -> None:
        self.edges = [tuple(edge) for edge in state["edges"]]
        self.shared = state["shared"]
        self.personal = state["personal"]
        self.admm_state = None if state["admm_state"] is None else AdmmState(**state["admm_state"])
        self.last_solve = state["last_solve"]
        self.sites_holding_shared = set(state["sites_holding_shared"])

    # ------------------------------------------------------------------ site side
    def site_setup(self, site) -> Payload:
        return {"sketch": data_sketch(site.data.train, site.module.num_classes)}

    def site_receive(self, site, phase: str, payload: Payload) -> None:
        for part in ("shared", "personal"):
            if part in payload:
                site.module.set_vector(part, payload[part])

    def site_epoch_share(self, phase: str) -> float:
        return 1.0 if self.options.full_epoch_per_phase else 0.5

    def site_trainable(self, phase: str) -> str:
        return phase  # "shared" or "personal"

    def site_reply(self, site, phase: str) -> Payload:
        reply = {phase: site.module.get_vector(phase)}
        if phase == "shared":
            reply["num_samples"] = num_samples(site)
        return reply
