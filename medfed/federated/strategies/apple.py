"""APPLE (Luo & Wu, "Adapt to adaptation"): core models mixed by learned directed relationships.

See ``shared/papers/apple-adapt-to-adaptation.md`` (Algorithm 1, sections
3.2-3.4, appendix A). Every site i uploads a *core model* w_i^(c); the server
keeps the N core models. Site i keeps copies of the core models it has
downloaded and its *directed-relationship* (DR) vector p_i, which never
leaves it; its personalised model is::

    w_i^(p) = sum_j p_ij w_j^(c)                                          (eq. 4)

Local training updates only its own core model (the copies are frozen) and
p_i, on the loss of w_i^(p) plus the proximal DR penalty::

    F_i(w_i^(p)) + lambda(r) * mu / 2 * ||p_i - p_0||^2,   p_0 = [n_1/n ... n_N/n]   (eq. 7)

w_i^(c) is stepped by the module's optimiser (eq. 5), p_i by plain SGD with
its own rate ``dr_lr`` = eta_2 (eq. 6). p_i starts at p_0 (the authors' code).

**Loss scheduler** (appendix A.1). r = rounds completed before this one (0 in
the first round, so lambda starts at 1 as "between 1 and 0" requires); L =
``scheduler_rounds``; lambda(r) = 0 from r = L on; before that

* cosine: (cos(r pi / L) + 1) / 2;
* exponential: eps^(r / L), eps = ``scheduler_eps`` = 1e-3. The paper prints
  e^{r/L}, which *increases*; the eps it names and the "rapid transition from
  global to local" it describes give the decreasing eps^{r/L} (1 at r = 0,
  eps as r -> L), which is also what the authors' code computes.

**Download budget** M (section 3.4, appendix A.2). Every site starts with the
seeded initial model as every core model (as the authors' code, which
downloads all of them in round 0, equivalently "by setting seeds"), so
nothing is fetched for that. In each round it takes part in, site i fetches
min(M, N - 1) of the other core models:

1. those it has never downloaded first; if there are more than slots, a
   random subset (seeded generator in the site's state);
2. the remaining slots among the already-downloaded ones, drawn without
   replacement with probability b(r)^|p_ij| / sum_k b(r)^|p_ik|,
   b(r) = max(1.5, r M / N) (eqs. 8-9).

The download counters are updated on every reception and kept in the site's
state (the authors' code never updated them, so its selection was uniform:
bug 8 of ``shared/design/algorithms.md``; it could also pick a core twice
when filling, which the draw here excludes). ``download_budget: null``
fetches all N - 1 every round. Bytes per round therefore scale with M.

**Life cycle.** Phase "select": the server sends r, the site picks its
cores (no training) and replies with a 0/1 request vector (N floats; p_i
stays at the site). Phase "fit": the server sends "core/<j>" for each
requested j, the site trains and replies "core/<i>". Deliveries carry
nothing except p_0 after setup. Only "fit" trains, so it takes all of
``trainer.local_epochs`` (the default training plan), as a FedAvg
round does.

**Model slots.** A site holds two: ``core`` (w_i^(c), trained: its
optimiser and moments act on the core model) and ``personalised``
(w_i^(p), evaluated). The forward pass of training runs ``training_step``
of the core slot through ``torch.func.functional_call`` with the parameters
p_ii * w_i^(c) + sum_{j != i} p_ij w_j^(c), built from the live core
parameters and the frozen copies, so gradients reach w_i^(c) (scaled by
p_ii, eq. 5) and p_i (eq. 6). p_i is the half's declared auxiliary parameter
(:meth:`APPLESite.auxiliary`): the step's one backward pass gives both
gradients at the same point, the core's optimiser steps w_i^(c) and then
p_i <- p_i - eta_2 dF/dp_i (plain SGD, no projection). The loss reads only
declared state (:attr:`APPLESite.loss_state`): p_i, p_0, the core copies,
e_i (the one-hot of the site's own index, so that p_ii = <p_i, e_i>) and the
penalty's weight lambda(r) mu / 2, set when the round's first message (r) arrives. At every delivery (after setup and at the end
of each round, when the loop evaluates) the site records its core model
among its copies and loads w_i^(p), with the core slot's buffers (BatchNorm
statistics), into the personalised slot. Each site holds N model vectors
(fine for N ~ 5-20).
"""

from __future__ import annotations

import math

import torch

from medfed.federated.protocol import (
    NUM_SAMPLES, SETUP, Auxiliary, Payload, RoundContext, SiteView, TrainingPlan, num_samples,
)
from medfed.federated.strategies.base import ServerHalf, SiteHalf, Strategy
from medfed.federated.strategies.live_parameters import live_parameters, training_loss_with


def loss_scheduler(kind: str, completed_rounds: int, last_round: int, eps: float) -> float:
    """lambda(r) of appendix A.1 (see the module docstring for the exponential form).

    Args:
        kind: "cosine" or "exponential".
        completed_rounds: r, rounds completed before the current one (>= 0).
        last_round: L >= 1; lambda is 0 from r = L on.
        eps: the exponential scheduler's value approached as r -> L.

    Returns:
        lambda(r) in [0, 1], non-increasing in r.
    """
    if completed_rounds >= last_round:
        return 0.0
    fraction = completed_rounds / last_round
    if kind == "cosine":
        return (math.cos(math.pi * fraction) + 1.0) / 2.0
    return eps**fraction


def choose_downloads(
    site_index: int,
    downloads: torch.Tensor,
    dr: torch.Tensor,
    budget: int,
    completed_rounds: int,
    generator: torch.Generator,
) -> list[int]:
    """Which core models site i fetches this round (appendix A.2).

    Args:
        site_index: i.
        downloads: int64 ``(N,)``, how often each core model was downloaded by i.
        dr: ``(N,)`` the DR vector p_i.
        budget: M >= 1, core models per round (at most N - 1 are fetched).
        completed_rounds: r, for the base b(r) = max(1.5, r M / N).
        generator: CPU generator for the random tie-break and the weighted draw.

    Returns:
        Sorted indices j != i: never-downloaded ones first (a random subset if
        they exceed the budget), the remaining slots drawn without replacement
        among the already-downloaded ones with probability ∝ b(r)^|p_ij|.
    """
    n = downloads.numel()
    others = [j for j in range(n) if j != site_index]
    if budget >= len(others):
        return others
    never = [j for j in others if int(downloads[j]) == 0]
    if len(never) >= budget:
        order = torch.randperm(len(never), generator=generator)[:budget]
        return sorted(never[k] for k in order.tolist())
    seen = [j for j in others if int(downloads[j]) > 0]
    base = max(1.5, completed_rounds * budget / n)
    weights = torch.tensor([base ** abs(float(dr[j])) for j in seen], dtype=torch.float64, device="cpu")  # drawn with a CPU generator
    drawn = torch.multinomial(weights, budget - len(never), replacement=False, generator=generator)
    return sorted(never + [seen[k] for k in drawn.tolist()])


CORE, PERSONALISED = "core", "personalised"


class APPLEServer(ServerHalf):
    """Keeps the N core models; sends each site the cores it requests."""

    state_fields = ("cores", "prior", "completed_rounds")

    def setup(self, ctx: RoundContext, initial: Payload, replies: dict[int, Payload]) -> None:
        self.cores = initial["all"].reshape(1, -1).repeat(self.n_sites, 1)  # (N, d) w_j^(c)
        none = torch.zeros_like(self.cores[0, :1])  # the size of a site excluded at setup (no reply): no weight in p_0
        sizes = torch.cat([replies[i][NUM_SAMPLES] if i in replies else none for i in range(self.n_sites)]).to(torch.float64)
        self.prior = sizes / sizes.sum()  # p_0
        self.completed_rounds = 0
        self.requests: dict[int, list[int]] = {}

    def message(self, ctx: RoundContext, site_index: int) -> Payload:
        if ctx.phase == "select":
            return {"completed_rounds": torch.tensor([float(self.completed_rounds)], device="cpu")}
        return {f"core/{j}": self.cores[j] for j in self.requests[site_index]}

    def aggregate(self, ctx: RoundContext, replies: dict[int, Payload]) -> None:
        if ctx.phase == "select":
            self.requests = {i: torch.nonzero(reply["request"]).flatten().tolist() for i, reply in replies.items()}
            return
        for index, reply in replies.items():
            self.cores[index] = reply[f"core/{index}"]
        self.completed_rounds += 1

    def reply_keys(self, ctx: RoundContext, site_index: int) -> tuple[frozenset[str], ...]:
        """The sample count at setup, the download request in "select", the site's own core model in "fit"."""
        keys = {SETUP: NUM_SAMPLES, "select": "request", "fit": f"{CORE}/{site_index}"}
        return (frozenset({keys[ctx.phase]}),)

    def deliver(self, ctx: RoundContext, site_index: int) -> Payload:
        return {"prior": self.prior} if self.completed_rounds == 0 else {}

    def metrics(self) -> dict[str, float]:
        return {"cores_sent_per_site": sum(map(len, self.requests.values())) / max(len(self.requests), 1)}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.requests = {}  # a round's requests never outlive it: a restored server has none pending


class APPLESite(SiteHalf):
    """Holds p_i, p_0, its copies of the core models and its download counts; trains its core model."""

    #: set at the first delivery: p_0, p_i, its copies of the core models (N, d), its download counts (N,),
    #: its download generator's state, and r
    state_fields = ("prior", "dr", "cores", "downloads", "generator", "completed_rounds")
    #: what the loss reads: p_i (N,) (an auxiliary parameter), p_0 (N,), the core copies (N, d), e_i (N,) one-hot
    #: of the site's index, and lambda(r) mu / 2 (0-d), the last two set when the round's "select" message arrives
    loss_state = ("dr", "prior", "cores", "own", "penalty_weight")

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        for name in self.state_fields:
            setattr(self, name, None)

    def setup(self, site: SiteView, ctx: RoundContext) -> Payload:
        return {"num_samples": num_samples(site)}

    def deliver(self, site: SiteView, ctx: RoundContext, payload: Payload) -> None:
        if "prior" in payload:
            self._initialise(site, payload["prior"])
        self._load_personalised_model(site)

    def receive(self, site: SiteView, ctx: RoundContext, payload: Payload) -> None:
        if ctx.phase == "select":
            self.completed_rounds = int(payload["completed_rounds"])
            self._set_loss_constants()
            return
        for key, core in payload.items():
            j = int(key.split("/", 1)[1])
            self.cores[j] = core
            self.downloads[j] += 1

    def _set_loss_constants(self) -> None:
        """e_i and lambda(r) mu / 2 for the round's loss, on p_i's device and dtype."""
        self.own = torch.zeros_like(self.dr)
        self.own[self.index] = 1.0
        weight = loss_scheduler(self.options.scheduler, self.completed_rounds, self.options.scheduler_rounds, self.options.scheduler_eps)
        self.penalty_weight = torch.tensor(weight * self.options.mu / 2.0, dtype=self.dr.dtype, device=self.dr.device)

    def _initialise(self, site: SiteView, prior: torch.Tensor) -> None:
        """State before round 1: p_i = p_0, every core model = the seeded initial model."""
        initial = site.get(CORE, "all")
        self.prior = prior.to(initial.dtype)
        self.dr = self.prior.clone()
        self.cores = initial.reshape(1, -1).repeat(self.n_sites, 1)
        self.downloads = torch.zeros(self.n_sites, dtype=torch.int64, device="cpu")  # bookkeeping for the CPU draw of choose_downloads
        self.generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.index).get_state()
        self.completed_rounds = 0

    def _load_personalised_model(self, site: SiteView) -> None:
        """Record the core model among the copies; load w_i^(p) = sum_j p_ij w_j^(c) and the core's buffers."""
        self.cores[self.index] = site.get(CORE, "all")
        site.set(PERSONALISED, "all", self.dr @ self.cores)
        site.set(PERSONALISED, "buffers", site.get(CORE, "buffers"))

    def plan(self, ctx: RoundContext) -> tuple[TrainingPlan, ...]:
        return () if ctx.phase == "select" else (TrainingPlan(slot=CORE),)

    def auxiliary(self, ctx: RoundContext, plan: TrainingPlan) -> dict[str, Auxiliary]:
        """p_i, stepped by plain SGD at ``dr_lr`` = eta_2 (eq. 6)."""
        return {"dr": Auxiliary(self.options.dr_lr)}

    def loss(self, site: SiteView, ctx: RoundContext, plan: TrainingPlan, batch) -> torch.Tensor:
        """Loss of w_i^(p) = p_ii w_i^(c) + sum_{j != i} p_ij w_j^(c) on ``batch`` plus lambda(r) mu/2 ||p_i - p_0||^2."""
        core = site.module(CORE)
        frozen = (self.dr * (1.0 - self.own)) @ self.cores  # sum_{j != i} p_ij w_j^(c), (d,)
        own_weight = self.dr @ self.own  # p_ii
        names = core.parameter_split.names("all")
        mixed, offset = {}, 0
        for name, parameter in zip(names, live_parameters(core, "all"), strict=True):
            size = parameter.numel()
            mixed[name] = own_weight * parameter + frozen[offset : offset + size].view_as(parameter)
            offset += size
        penalty = self.penalty_weight * (self.dr - self.prior).square().sum()
        return training_loss_with(core, mixed, batch) + penalty

    def reply(self, site: SiteView, ctx: RoundContext) -> Payload:
        if ctx.phase == "fit":
            return {f"core/{self.index}": site.get(CORE, "all")}
        budget = self.n_sites - 1 if self.options.download_budget is None else self.options.download_budget
        generator = torch.Generator()
        generator.set_state(self.generator)
        chosen = choose_downloads(self.index, self.downloads, self.dr, budget, self.completed_rounds, generator)
        self.generator = generator.get_state()
        request = torch.zeros(self.n_sites, device="cpu")  # indexed by the CPU draw; the link carries it
        request[chosen] = 1.0
        return {"request": request}


class APPLE(Strategy):
    dp_sgd_refusal = "its loss runs the core model with mixed parameter tensors (functional_call), and its directed relationships are stepped outside the clipping"
    client_dp_refusal = "its server step needs each site's own vector: every site downloads the others' core models"
    secure_aggregation_refusal = "its server step needs each site's own vector: every site downloads the others' core models"
    robust_aggregation_refusal = "each site combines the others' core models with its own learned weights: no average to make robust"
    phases = ("select", "fit")
    coded_keys = {"core": "all"}
    slots = (CORE, PERSONALISED)
    evaluated_slot = PERSONALISED
    Server = APPLEServer
    Site = APPLESite
