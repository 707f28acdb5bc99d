"""pFedNet (Zhao et al.): shared + personal components linked by a similarity network.

Objective (``shared/design/algorithms.md``)::

    min_{x, Z}  (1/N) sum_n f_n(M x + N z_n)  +  lam * sum_m w_m ||z_i - z_j||_p

over the edges m = (i, j) of a weighted KNN similarity network of the sites
(``lam ||Z Q||_{1,p}`` with Q the weighted incidence matrix). Two round
shapes (``schedule``; null, the default, is the preset's: joint at ``preset:
equal``, alternating at ``published``). With ``schedule: alternating`` one
round alternates two phases:

1. **shared** — each site trains only its shared coordinates from x_t (its
   personal part frozen); the server averages them (sample-weighted) into
   x_{t+1};
2. **personal** — each site receives x_{t+1}, trains only its personal
   coordinates from z_n, giving z~_n; the server solves the network-lasso
   proximal problem exactly::

       Z_{t+1} = argmin_Z 1/(2 eta_s) ||Z - Z~||_F^2 + lam_t ||Z Q||_{1,p}

   and delivers z_{t+1,n}, so site n is evaluated with M x_{t+1} + N z_{t+1,n}.

**Joint schedule** (``schedule: joint``, the default; the paper's Algorithm 2
with local steps instead of one gradient; at the same budget it beat the
alternating phases by 0.067 label IoU and FedPer by 0.010 on brats_lack0,
docs/results/pfednet_ablation.md). A round is one phase, ``"joint"``: each site
n starts from its delivered (x_t, z_{t,n}) and trains the whole model y_n =
M x + N z_n together, one plan for all of the round's budget E, giving
(x~_n, z~_n); it replies both (and its sample count), and the server makes
both updates from that one reply::

    x_{t+1} = sum_n s_n x~_n / sum_n s_n                    (s_n: sample counts)
    Z_{t+1} = argmin_Z 1/(2 eta_s) ||Z - Z~||_F^2 + lam_t ||Z Q||_{1,p}

then delivers (x_{t+1}, z_{t+1,n}) to every site. The two schedules differ
in what the personal parts are trained against: alternating trains z_n
against the new average x_{t+1}, joint against the site's own drifting x~_n
(as FedPer does). With lam = 0 the server step is the identity on Z, so
joint pFedNet is FedPer (same plan, same average of x; tests/test_pfednet.py
checks the models agree); alternating pFedNet is not, at any lam. Same cost
as alternating at ``preset: equal``: E epochs of training passes a round.

**Budget** (:mod:`medfed.federated.strategies.base`). The joint plan trains
the round's budget E = ``trainer.local_epochs``. Alternating, at ``preset:
equal``, each phase trains half of E (a training plan with ``share`` = 0.5;
the personal phase continues the shared phase's data order, so together
they take the steps of E epochs), and a part without parameters gives its
half to the other: with the clinical logistic regression (all personal) the
shared phase trains nothing and the personal phase trains E epochs.
``preset: published`` (or ``full_epoch_per_phase: true``) is alternating
with all of E for each phase, the paper's setting (2 E epochs of passes a
round).

**The server step and the paper.** The paper's Algorithm 4 solves the same
proximal problem around Z_t after one linearised step, with h(Z) =
<(1/N) grad, Z> + 1/(2 eta_t) ||Z - Z_t||^2: the 1/N of the objective sits
inside h. Here the sites train their personal parts for several Adam steps
on f_n, so Z~ is no gradient step of known length and no learning rate
calibrates eta_s; only lam_t * eta_s matters in the problem above.

**Penalty strength** (``lam_scale``, see :mod:`medfed.federated.strategies.solvers.fusion`):

- ``fusion`` (default): ``lam`` is a fraction of the fusion threshold of the
  round's Z~: lam_t = lam * lam_bar(Z~_t), where at lam_bar every connected
  component of the graph fuses to its mean (exactly on forests; an upper
  bound otherwise). 0 = independent personal parts, 1 = fused. This is an
  adaptive server step: lam_t eta_s does not depend on eta_s, nor on the
  model's scale, d or p.
- ``absolute``: lam in the paper's units, with eta_s = ``server_lr``.

**What lam means.** With the default ``fusion`` scale, lam = 1 fuses every
connected component of the similarity network into one personal part (its
mean), and lam = 0 leaves each site its own. In between, the parts fuse
group by group: a tight group of similar sites fuses at a small fraction of
lam_bar, because lam_bar is the threshold of the whole component, set by its
most different sites. So a small lam (0.1 on BraTS-like sites) may already
make the personal parts identical within each group of similar sites and
keep only the groups apart: pFedNet then behaves as clustered
personalisation, not as a gentle pull towards the neighbours.

Every round logs, after the server step (server metrics):
``distinct_personal``, the number of different personal parts left (parts
closer than 1e-3 of their mean norm count as one:
:func:`~medfed.federated.strategies.solvers.fusion.distinct_parts`), and
``personal_distance_min`` / ``_median`` / ``_max``, their pairwise Euclidean
distances; ``spread_removed``, the fraction of the between-site spread of
the personal parts that the server step removed (0 = no effect, 1 = all
fused; dominated by the largest differences, so it stays small when only
the groups' insides fuse: read it with ``distinct_personal``); with
``lam_effective`` (lam_t in the paper's units) and ``fusion_lam``
(lam_bar).

**Similarity network** (``graph_space``; the draft's section IV-A):

- ``data``: maximum mean discrepancy between the sites' joint distributions
  of (pixel or row, label), from random-Fourier-feature sketches;
- ``feature``: Frobenius distance between the sites' channel covariances;
- ``model``: Euclidean distance between the sites' locally trained personal
  parts z~_n (no extra message: the server receives them in the personal
  phase), built at round 1 and refreshed every ``graph_refresh_rounds``.

Edges: each site's ``knn_k`` nearest sites (``knn_rule`` union or mutual),
weighted by a Gaussian kernel of the distance (``edge_weights``). The graph
is logged per round (``graph/w_i_j``, 0 for absent pairs) and drawn in
``similarity_graph.png``, one panel per (re)build. A site that skipped the round keeps its column of
Z as the proximal centre; so does one left out of the personal phase after failing in either
phase (its shared reply counts if the shared phase accepted it), and it is delivered x_{t+1}.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Any

import torch

from medfed.errors import RunFailed, SiteFailure
from medfed.federated.strategies.solvers.fusion import distinct_parts, fusion_threshold, spread_removed
from medfed.federated.strategies.solvers.graph import (
    SimilarityGraph,
    connected_components,
    similarity_graph,
)
from medfed.federated.strategies.solvers.network_lasso import AdmmState, solve_network_lasso
from medfed.federated.strategies.solvers.sketch import check_sketch_size, data_sketch, feature_sketch
from medfed.federated.protocol import (
    MODEL, NUM_SAMPLES, SETUP, Payload, RoundContext, SiteView, TrainingPlan, num_samples,
)
from medfed.federated.strategies.base import ServerHalf, SiteHalf, Strategy
from medfed.options.strategies import P_NORMS

JOINT = "joint"
"""The one phase of ``schedule: joint``."""


class PFedNetServer(ServerHalf):
    """Holds the shared part x and every site's personal part (columns of Z); averages x, solves the network lasso for Z."""

    def setup(self, ctx: RoundContext, initial: Payload, replies: dict[int, Payload]) -> None:
        self.shared = initial["shared"].clone()
        self.personal = initial["personal"].reshape(-1, 1).repeat(1, self.n_sites)  # Z: (d2, N)
        self.graph: SimilarityGraph | None = None
        self.graph_history: list[tuple[int, SimilarityGraph]] = []  # (round it was built at, graph); 0 = before training
        if self.options.graph_space != "model":
            missing = [index for index in range(self.n_sites) if index not in replies]
            if missing:  # a site excluded at setup has no point in the graph
                raise SiteFailure(
                    f"pfednet's similarity graph in {self.options.graph_space} space needs every site's sketch; sites {missing} "
                    "sent none the server accepted (strategy.pfednet.graph_space=model builds it without sketches)"
                )
            sketches = torch.stack([replies[i]["sketch"] for i in range(self.n_sites)])
            self._build_graph(sketches, personal_step=0)
        self.personal_steps = 0
        self.admm_state = None
        self.last_solve: dict[str, float] = {}
        self.sites_holding_shared: set[int] = set()

    def _build_graph(self, points: torch.Tensor, personal_step: int) -> None:
        """Rebuild the similarity network from ``(N, s)`` points (sketches or personal parts)."""
        self.graph = similarity_graph(
            points,
            self.options.knn_k,
            rule=self.options.knn_rule,
            weighting=self.options.edge_weights,
            standardize=self.options.graph_standardize and self.options.graph_space != "model",
        )
        self.graph_history.append((personal_step, self.graph))
        self.admm_state = None  # the split variable W lives on the edges: a new graph starts cold

    def _graph_due(self) -> bool:
        """Model space: build at the first personal step, then every ``graph_refresh_rounds``."""
        if self.options.graph_space != "model":
            return False
        if self.graph is None:
            return True
        every = self.options.graph_refresh_rounds
        return every > 0 and (self.personal_steps - self.graph_history[-1][0]) >= every

    def message(self, ctx: RoundContext, site_index: int) -> Payload:
        return {"shared": self.shared} if ctx.phase == "personal" else {}

    def reply_keys(self, ctx: RoundContext, site_index: int) -> tuple[frozenset[str], ...]:
        """At setup the sketch (nothing in model space); then the phase's part(s), with the sample count beside "shared"."""
        if ctx.phase == SETUP:
            return (frozenset() if self.options.graph_space == "model" else frozenset({"sketch"}),)
        if ctx.phase == JOINT:
            return (frozenset({"shared", "personal", NUM_SAMPLES}),)
        return (frozenset({ctx.phase, NUM_SAMPLES} if ctx.phase == "shared" else {ctx.phase}),)

    def aggregate(self, ctx: RoundContext, replies: dict[int, Payload]) -> None:
        """Shared phase: average x; personal phase: the network lasso on z; joint phase: both, from the same replies."""
        if ctx.phase in ("shared", JOINT):
            self.shared = self.aggregation(
                [r["shared"] for r in replies.values()], [float(r["num_samples"]) for r in replies.values()], self.shared
            )
            self.sites_holding_shared = set()  # joint: every site trained from x_t, so every site is delivered x_{t+1}
            if ctx.phase == "shared":
                return
        else:
            # The sites replying now trained their personal parts from x_{t+1} and hold it; one that got
            # the message but failed was put back to its start-of-round state, so it needs x_{t+1} delivered.
            self.sites_holding_shared = set(replies)
        centre = self.personal  # written in place (no second (d2, N) copy): the replies' columns, the others as they were
        while replies:  # consumed as read: no reply is held through the solve
            index, reply = replies.popitem()
            centre[:, index] = reply["personal"]
        self.personal_steps += 1
        if self._graph_due():
            self._build_graph(centre.T, self.personal_steps)
        self.personal = self._network_lasso_step(centre)

    def _network_lasso_step(self, centre: torch.Tensor) -> torch.Tensor:
        """Solve the server's proximal problem around ``centre`` (d2, N); warm-started."""
        if centre.shape[0] == 0:
            return centre
        eta = self.options.server_lr
        p = P_NORMS[str(self.options.p)]
        threshold = fusion_threshold(centre, self.graph, eta, p)
        lam = self.options.lam * threshold if self.options.lam_scale == "fusion" else self.options.lam
        if not math.isfinite(lam):  # finite replies (the link refuses others) whose differences overflow
            raise RunFailed(
                f"pfednet's server step after {self.personal_steps} personal steps: the sites' personal parts differ beyond "
                f"what {centre.dtype} holds (fusion threshold {threshold:g}, so lam_t = {lam:g}): their training diverged; "
                "lower model.lr"
            )
        result = solve_network_lasso(
            centre,
            self.graph.incidence(dtype=centre.dtype, device=centre.device),
            lam=lam,
            eta=eta,
            p=p,
            rho=self.options.rho,
            max_iter=self.options.admm_max_iter,
            abs_tol=self.options.admm_abs_tol,
            rel_tol=self.options.admm_rel_tol,
            warm_start=self.admm_state,
        )
        self.admm_state = result.state
        components = connected_components(self.graph.edges, self.n_sites)
        parts = distinct_parts(result.Z)
        self.last_solve = {
            "distinct_personal": parts["distinct"],
            **{f"personal_{key}": parts[key] for key in ("distance_min", "distance_median", "distance_max")},
            "spread_removed": spread_removed(centre, result.Z, components),
            "lam_effective": float(lam),
            "fusion_lam": threshold,
            "admm_iterations": float(result.iterations),
            "admm_primal_residual": float(result.primal_residual),
            "admm_dual_residual": float(result.dual_residual),
        }
        return result.Z

    def deliver(self, ctx: RoundContext, site_index: int) -> Payload:
        payload = {"personal": self.personal[:, site_index]}
        if site_index not in self.sites_holding_shared:
            payload["shared"] = self.shared
        return payload

    def metrics(self) -> dict[str, float]:
        """The last server step (spread_removed, lam_effective, ADMM) and the graph, edge by edge."""
        metrics = dict(self.last_solve)
        if self.graph is not None:
            weight = dict(zip(self.graph.edges, self.graph.weights))
            metrics["graph_edges"] = float(len(self.graph.edges))
            for i, j in itertools.combinations(range(self.n_sites), 2):
                metrics[f"graph/w_{i}_{j}"] = weight.get((i, j), 0.0)
        return metrics

    def figures(self) -> dict[str, Any]:
        """``similarity_graph``: the network the penalty ran over, one panel per (re)build."""
        if not self.graph_history:
            return {}
        from medfed.viz.plots import plot_similarity_graphs

        built = [at for at, _ in self.graph_history]
        panels = [(_served(at, end), graph) for (at, graph), end in zip(self.graph_history, [*built[1:], None])]
        title = f"pFedNet similarity network, {self.options.graph_space} space, k={self.options.knn_k} ({self.options.knn_rule})"
        return {"similarity_graph": plot_similarity_graphs(panels, title)}

    # Not declared fields: the graphs and the ADMM state are objects and the holders a set, checkpointed as plain data.
    def state_dict(self) -> dict:
        return {
            "graph_history": [(at, graph.to_dict()) for at, graph in self.graph_history],
            "personal_steps": self.personal_steps,
            "shared": self.shared,
            "personal": self.personal,
            "admm_state": None if self.admm_state is None else dataclasses.asdict(self.admm_state),
            "last_solve": self.last_solve,
            "sites_holding_shared": sorted(self.sites_holding_shared),
        }

    def load_state_dict(self, state: dict) -> None:
        self.graph_history = [(at, SimilarityGraph.from_dict(graph)) for at, graph in state["graph_history"]]
        self.graph = self.graph_history[-1][1] if self.graph_history else None
        self.personal_steps = state["personal_steps"]
        self.shared = state["shared"]
        self.personal = state["personal"]
        self.admm_state = None if state["admm_state"] is None else AdmmState(**state["admm_state"])
        self.last_solve = state["last_solve"]
        self.sites_holding_shared = set(state["sites_holding_shared"])


class PFedNetSite(SiteHalf):
    """Trains the shared part, then its personal part, from what the server sent; sends its data sketch once."""

    def setup(self, site: SiteView, ctx: RoundContext) -> Payload:
        """Data/feature space: the site's sketch of its training split; model space: nothing."""
        if self.options.graph_space == "model":
            return {}
        check_sketch_size(site.data.train, self.options.min_sketch_samples, site.name)
        if self.options.graph_space == "feature":
            return {"sketch": feature_sketch(site.data.train)}
        sketch = data_sketch(
            site.data.train,
            site.module(MODEL).num_classes,
            features=self.options.kernel_features,
            bandwidth=self.options.kernel_bandwidth,
            seed=self.seed,
        )
        return {"sketch": sketch}

    def receive(self, site: SiteView, ctx: RoundContext, payload: Payload) -> None:
        """The parts the message holds (x_t in the shared phase, z_{t,n} in the personal one) into the model."""
        for part in ("shared", "personal"):
            if part in payload:
                site.set(MODEL, part, payload[part])

    deliver = receive  # the delivery's parts (M x_{t+1} + N z_{t+1,n}) load the same way

    def plan(self, ctx: RoundContext) -> tuple[TrainingPlan, ...]:
        """Joint phase: the whole model (x and z together) for the round's budget. Alternating: the phase's
        part ("shared" or "personal") for half the round's budget, all of it with ``full_epoch_per_phase`` or
        when the other part has no parameters; nothing for a part without any."""
        if ctx.phase == JOINT:
            return (TrainingPlan(part="all"),)
        other = "personal" if ctx.phase == "shared" else "shared"
        if self.options.full_epoch_per_phase:
            return (TrainingPlan(part=ctx.phase),)
        if self.split.size(ctx.phase) == 0:
            return ()
        return (TrainingPlan(part=ctx.phase, share=1.0 if self.split.size(other) == 0 else 0.5),)

    def reply(self, site: SiteView, ctx: RoundContext) -> Payload:
        parts = ("shared", "personal") if ctx.phase == JOINT else (ctx.phase,)
        reply = {part: site.get(MODEL, part) for part in parts}
        if "shared" in parts:
            reply["num_samples"] = num_samples(site)
        return reply


class PFedNet(Strategy):
    phases = ("shared", "personal")
    client_dp_refusal = "its server step needs each site's own vector: the network lasso fuses the personal parts pair by pair"
    secure_aggregation_refusal = "its server step needs each site's own vector: the network lasso fuses the personal parts pair by pair"
    robust_aggregation_refusal = None  # the shared part's average passes through the run's aggregation rule
    dp_sgd_refusal = "only with graph_space=model: the data- and feature-space sketches a site sends at setup are computed on its raw data"

    @classmethod
    def dp_sgd_refused(cls, options: Any) -> str | None:
        """Model space sends no sketch: every data-dependent payload then comes out of DP-SGD steps."""
        return None if options.graph_space == "model" else f"with graph_space={options.graph_space!r} {cls.dp_sgd_refusal.split(': ', 1)[1]} (use graph_space=model)"

    Server = PFedNetServer
    Site = PFedNetSite

    def __init__(self, options: Any, split: Any, n_sites: int, seed: int) -> None:
        super().__init__(options, split, n_sites, seed)
        if options.schedule == "joint":
            self.phases = (JOINT,)  # one phase: this run's round shape (the class's is the alternating one)


def _served(built_at: int, next_built_at: int | None) -> str:
    """A similarity graph's panel label: when it was built and the rounds whose server steps it served.

    A graph built in round k (from that round's personal parts) serves round k's fusion already and each
    round after until the next graph is built; one built at setup (round 0, before training) serves from round 1.
    """
    when = "built before training" if built_at == 0 else f"built in round {built_at}"
    first = max(built_at, 1)
    if next_built_at is None:
        return f"{when}, used in every round" if built_at == 0 else f"{when}, used from round {first} on"
    last = next_built_at - 1
    rounds = f"round {first}" if last == first else f"rounds {first}-{last}"
    return f"{when}, used in {rounds}"
