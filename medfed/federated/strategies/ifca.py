"""IFCA (Ghosh, Chung, Yin and Ramchandran): k cluster models; each site trains the one that fits its data best.

Ghosh et al., "An efficient framework for clustered federated learning",
NeurIPS 2020 / IEEE Trans. Inf. Theory 68(12), 2022, Algorithm 1 with
option II (*model averaging*). The server holds k cluster models
theta_1 .. theta_k (parameters and float buffers). In round t:

1. the server sends every participant all k models;
2. site i estimates its cluster identity from the loss of each model on its
   own training split and picks the smallest::

       j_i = argmin_j  F_i(theta_j),   F_i(theta) = (1/n_i) sum_{batches b} |b| * loss_b(theta)

   (ties: the lowest j), loads theta_{j_i} and trains it locally (the
   trainer's local epochs, the site's optimiser) into theta~_i;
3. it replies with j_i and theta~_i; the server averages per cluster::

       theta_j <- sum_{i in S_j} n_i theta~_i / sum_{i in S_j} n_i,   S_j = {participants with j_i = j}

   (float buffers alike); a cluster no participant chose keeps its model
   (the paper leaves that case open).

A site is evaluated with the model of the cluster it last chose, delivered at
the end of every round (the server knows that choice only from replies; a
site that has not taken part yet chose at setup, below).

**Initial cluster models** (the paper draws them at random; the server must
not see data and here knows only the seeded initial model and the run's
seed). theta_1 is the seeded prototype theta_0 itself; for j >= 2 every
parameter tensor T of the prototype gets seeded Gaussian noise of the
tensor's own spread::

    theta_j[T] = theta_0[T] + init_scale * std(theta_0[T]) * eps_{j,T},   eps ~ N(0, I) from (seed, j)

so a layer's scale is kept (a tensor initialised constant, e.g. a
normalisation layer's weight, is not perturbed), and ``init_scale = 1``
puts a cluster model about as far from theta_0 as an independent
initialisation of the same spread would be. The draw is on the CPU in float64
from the initial vector alone (:func:`cluster_initialisations`), so every
end computes the same vectors: they are declared as the links' initial
values of the keys "cluster/j" (``Strategy.initial_values``), and the first
message of a cluster model is coded against it (under a lossy codec the
seeded initial models cost nothing to send). Float buffers start equal to
the prototype's in every cluster. With ``clusters = 1`` IFCA is FedAvg
exactly (one cluster, everyone in it; tested).

*Setup.* So that the server can deliver a cluster model to a site that has
not taken part yet, every site makes its first choice among the k initial
models at setup (step 2 without training) and sends the index alone.

*Where the paper is silent or medfed chooses.* The cluster estimate uses the
training loss in evaluation mode (no dropout; BatchNorm with the cluster's
running statistics), without gradients, over the whole training split in a
fixed order (the fixed reference patch of a random-crop split), on a loader
with its own generator so that it leaves the site's data order and global
generators untouched. The average is sample-weighted (the paper's is
unweighted: equal with equal sizes), and float buffers are averaged like
parameters, as in FedAvg. The paper's weight-sharing variant (shared lower
layers across clusters) and its random restarts are not implemented: the
whole model is clustered, from one seeded set of initial models.

**Defaults.** ``clusters = 2`` (the paper's CIFAR-10 setting; its rotated
MNIST uses 4 rotations; medfed's tasks have 5 sites), ``init_scale = 1``.
Like the paper's algorithm, IFCA can fall into one cluster when one initial
model fits every site better: the per-round ``cluster_size/j`` metrics show it.

On the wire: down, "cluster/j" (coded) and "cluster_buffers/j" (dense) for
every j, then the delivery "all" + "buffers"; up, "cluster_id", the trained
"cluster/<j_i>" (coded against what the site received for it, so a lossy
codec sends the training change) and "cluster_buffers/<j_i>". Downlink per
round: (k + 1) model vectors per participant.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np
import torch

from medfed.federated.protocol import MODEL, NUM_SAMPLES, SETUP, Payload, RoundContext, SiteView, num_samples
from medfed.federated.strategies.base import ServerHalf, SiteHalf, Strategy
from medfed.models.split import ParameterSplit

CLUSTER, CLUSTER_BUFFERS, CLUSTER_ID = "cluster", "cluster_buffers", "cluster_id"


def cluster_initialisations(model: torch.Tensor, split: ParameterSplit, clusters: int, seed: int, scale: float) -> torch.Tensor:
    """The k initial cluster models: the prototype and k - 1 seeded perturbations of it.

    Args:
        model: ``(d,)`` the prototype's ``"all"`` vector (parameters in model order).
        split: the model's parts (sizes of its parameter tensors, in order).
        clusters: k >= 1.
        seed: the run's seed; cluster j's noise comes from ``(seed, j)``.
        scale: ``init_scale``, the noise in units of each tensor's standard deviation.

    Returns:
        ``(k, d)`` like ``model`` (dtype and device): row 0 is ``model``, row j
        adds ``scale * std(T) * eps_j`` on every parameter tensor T (population
        std over T's entries; eps_j standard normal, drawn on the CPU).
    """
    sizes = torch.tensor([split.numels[name] for name in split.names("all")], dtype=torch.int64, device="cpu")
    reference = model.detach().to(device="cpu", dtype=torch.float64)
    if int(sizes.sum()) != reference.numel():
        raise ValueError(f"model: expected {int(sizes.sum())} values (the 'all' part), got {reference.numel()}")
    segment = torch.repeat_interleave(torch.arange(len(sizes), dtype=torch.int64, device="cpu"), sizes)  # (d,) tensor of each entry
    counts = sizes.to(torch.float64)
    mean = torch.zeros(len(sizes), dtype=torch.float64, device="cpu").index_add_(0, segment, reference) / counts
    variance = torch.zeros_like(mean).index_add_(0, segment, (reference - mean[segment]).square()) / counts
    spread = scale * variance.sqrt()[segment]  # (d,)
    rows = [reference]
    for j in range(1, clusters):
        generator = torch.Generator(device="cpu").manual_seed(int(np.random.SeedSequence([seed, j, 0x1FCA]).generate_state(1)[0]))
        rows.append(reference + spread * torch.randn(reference.numel(), generator=generator, dtype=torch.float64, device="cpu"))
    return torch.stack(rows).to(device=model.device, dtype=model.dtype)


class IFCAServer(ServerHalf):
    """Holds the k cluster models and every site's last chosen cluster; averages each cluster's replies."""

    state_fields = ("models", "buffers", "assignment", "reassigned")

    def setup(self, ctx: RoundContext, initial: Payload, replies: dict[int, Payload]) -> None:
        k = self.options.clusters
        self.models = torch.stack([initial[f"{CLUSTER}/{j}"] for j in range(k)])  # (k, d)
        self.buffers = initial["buffers"].reshape(1, -1).repeat(k, 1)  # (k, b)
        # j_i of every site (cluster 0 for a site excluded at setup)
        self.assignment = [int(replies[i][CLUSTER_ID]) if i in replies else 0 for i in range(self.n_sites)]
        self.reassigned = 0

    def message(self, ctx: RoundContext, site_index: int) -> Payload:
        payload = {}
        for j in range(self.options.clusters):
            payload[f"{CLUSTER}/{j}"] = self.models[j]
            payload[f"{CLUSTER_BUFFERS}/{j}"] = self.buffers[j]
        return payload

    def reply_keys(self, ctx: RoundContext, site_index: int) -> tuple[frozenset[str], ...]:
        """At setup the chosen cluster's index; then the index, that cluster's model and buffers and the sample count."""
        if ctx.phase == SETUP:
            return (frozenset({CLUSTER_ID}),)
        return tuple(
            frozenset({CLUSTER_ID, f"{CLUSTER}/{j}", f"{CLUSTER_BUFFERS}/{j}", NUM_SAMPLES}) for j in range(self.options.clusters)
        )

    def reply_fault(self, ctx: RoundContext, site_index: int, reply: Payload) -> str | None:
        """The cluster index must be one whole number j in 0..k-1, and (after setup) the cluster whose keys the reply holds."""
        value = reply[CLUSTER_ID]
        j = float(value.reshape(-1)[0]) if value.numel() == 1 else math.nan
        if not (j.is_integer() and 0 <= j < self.options.clusters):
            return f"reply {CLUSTER_ID!r} is not one cluster index from 0 to {self.options.clusters - 1}"
        if ctx.phase != SETUP and f"{CLUSTER}/{int(j)}" not in reply:
            return f"reply {CLUSTER_ID!r} = {int(j)} names another cluster than the model it sent"
        return None

    def aggregate(self, ctx: RoundContext, replies: dict[int, Payload]) -> None:
        chosen = {index: int(reply[CLUSTER_ID]) for index, reply in replies.items()}
        for j in sorted(set(chosen.values())):
            members = [index for index, cluster in chosen.items() if cluster == j]
            weights = [float(replies[index]["num_samples"]) for index in members]
            self.models[j] = self.aggregation([replies[index][f"{CLUSTER}/{j}"] for index in members], weights, self.models[j])
            self.buffers[j] = self.aggregation([replies[index][f"{CLUSTER_BUFFERS}/{j}"] for index in members], weights, self.buffers[j])
        self.reassigned = sum(self.assignment[index] != cluster for index, cluster in chosen.items())
        for index, cluster in chosen.items():
            self.assignment[index] = cluster

    def deliver(self, ctx: RoundContext, site_index: int) -> Payload:
        j = self.assignment[site_index]
        return {"all": self.models[j], "buffers": self.buffers[j]}

    def metrics(self) -> dict[str, float]:
        """How many sites are in each cluster now, and how many participants changed cluster this round."""
        sizes = {f"cluster_size/{j}": float(self.assignment.count(j)) for j in range(self.options.clusters)}
        return {**sizes, "reassigned": float(self.reassigned)}


class IFCASite(SiteHalf):
    """Picks the cluster model with the lowest training loss, trains it, replies with its index and the trained model."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.cluster: int | None = None  # j_i, from receiving a round's models to replying

    def setup(self, site: SiteView, ctx: RoundContext) -> Payload:
        """The first choice, among the seeded initial cluster models (which the site computes itself)."""
        models = cluster_initialisations(site.get(MODEL, "all"), self.split, self.options.clusters, self.seed, self.options.init_scale)
        buffers = site.get(MODEL, "buffers")
        return {CLUSTER_ID: _cluster_id(choose_cluster(site, ((m, buffers) for m in models)))}

    def deliver(self, site: SiteView, ctx: RoundContext, payload: Payload) -> None:
        for part, vector in payload.items():
            site.set(MODEL, part, vector)

    def receive(self, site: SiteView, ctx: RoundContext, payload: Payload) -> None:
        candidates = ((payload[f"{CLUSTER}/{j}"], payload[f"{CLUSTER_BUFFERS}/{j}"]) for j in range(self.options.clusters))
        self.cluster = choose_cluster(site, candidates)

    def reply(self, site: SiteView, ctx: RoundContext) -> Payload:
        j, self.cluster = self.cluster, None
        return {
            CLUSTER_ID: _cluster_id(j),
            f"{CLUSTER}/{j}": site.get(MODEL, "all"),
            f"{CLUSTER_BUFFERS}/{j}": site.get(MODEL, "buffers"),
            "num_samples": num_samples(site),
        }


def _cluster_id(j: int) -> torch.Tensor:
    """The payload entry naming cluster j: float32 ``(1,)`` on the CPU (the link places it)."""
    return torch.tensor([float(j)], dtype=torch.float32, device="cpu")


def choose_cluster(site: SiteView, candidates: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> int:
    """IFCA's cluster estimate: load each (parameters, buffers) candidate, keep the one with the lowest training loss.

    Args:
        site: the site; its model (slot ``model``) is overwritten.
        candidates: k pairs ``((d,), (b,))`` of the ``"all"`` and ``"buffers"`` vectors.

    Returns:
        argmin_j F_i(theta_j) (the lowest j among equal losses); the module
        holds that candidate on return.
    """
    losses, kept = [], []
    for parameters, buffers in candidates:
        site.set(MODEL, "all", parameters)
        site.set(MODEL, "buffers", buffers)
        losses.append(training_loss(site))
        kept.append((parameters, buffers))
    best = int(torch.argmin(torch.stack(losses)))
    site.set(MODEL, "all", kept[best][0])
    site.set(MODEL, "buffers", kept[best][1])
    return best


@torch.no_grad()
def training_loss(site: SiteView) -> torch.Tensor:
    """F_i: the model's mean training loss over the site's training split, evaluation mode, no gradients.

    The split is read in order (a random-crop split gives its fixed
    reference patches), in batches of the evaluation's size, by
    :meth:`~medfed.federated.protocol.SiteView.full_pass` (neither the
    site's data order nor the global generators move; counted as
    ``forward/cluster_choice``). Each batch's mean loss is weighted by the
    batch's size. Returns a 0-d tensor on the module's device.
    """
    module = site.module(MODEL)
    module.eval()
    total = None
    # evaluation batches (no gradients): 4 x the training batch
    for index, (batch, size) in enumerate(site.full_pass("train", "cluster_choice", backward=False, batch_size=site.eval_batch_size)):
        loss = module.training_step(batch, index) * size
        total = loss if total is None else total + loss
    return total / site.n_train


class IFCA(Strategy):
    dp_sgd_refusal = "its cluster choice, sent to the server, is the lowest loss over the site's training data, computed outside DP-SGD"
    client_dp_refusal = "its server step needs each site's own vector: grouped by its cluster choice"
    secure_aggregation_refusal = "its server step needs each site's own vector: grouped by its cluster choice"
    robust_aggregation_refusal = None  # each cluster's members' models pass through the run's aggregation rule
    coded_keys = {CLUSTER: "all", "all": "all"}
    Server = IFCAServer
    Site = IFCASite


    def initial_values(self, model: Payload) -> Payload:
        """The model's parts and the k seeded initial cluster models as "cluster/j"."""
        models = cluster_initialisations(model["all"], self.split, self.options.clusters, self.seed, self.options.init_scale)
        return {**model, **{f"{CLUSTER}/{j}": vector for j, vector in enumerate(models)}}
