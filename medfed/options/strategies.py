"""The registered strategies, declared torch-free: one :class:`StrategySpec` each, and their option groups.

:data:`STRATEGY_SPECS` is the registry: a strategy's name, its class's
``"module:Class"`` path, its one-line summary, its reference, its options
dataclass and a smoke preset, each written once. The CLI's list, the
generated tables, the ``strategy`` config group, compare grids and the
registry-driven tests all derive from it, and the class takes its name and
options from it (docs/strategies.md: adding a method). The ``strategy.<name>``
option groups are plain dataclasses here, so :func:`parse_strategy_group`
checks a config's ``strategy`` group and fills in its defaults (``fit
--print-config``) before torch is imported. A field's docstring is what the
option means; ``__post_init__`` refuses a value the algorithm cannot run
with, naming the key (:func:`~medfed.config.require`).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any

from medfed.config import did_you_mean, parse_options, require
from medfed.options.presets import by_preset, check_preset
from medfed.errors import ConfigError

SCHEDULERS = ("cosine", "exponential")
"""APPLE's loss schedulers lambda(r)."""
VARIANTS = ("exponential", "heuristic")
"""FedAMP's attention functions."""
PENALTIES = ("scad", "mcp")
"""FPFC's concave pairwise penalties (:mod:`medfed.federated.strategies.solvers.concave_penalty`)."""
P_NORMS = {"1": 1.0, "2": 2.0, "inf": float("inf")}
"""pFedNet's column norms of the graph penalty, by their config spelling."""
GRAPH_SPACES = ("data", "feature", "model")
"""Where pFedNet measures the similarity of sites."""
SCHEDULES = ("alternating", "joint")
"""pFedNet's round shapes: two phases (shared, then personal) or one joint plan (the paper's Algorithm 2 with local steps)."""
LAM_SCALES = ("fusion", "absolute")
"""The units of pFedNet's lambda."""
KNN_RULES = ("union", "mutual")
"""How a k-nearest-neighbour graph joins sites (:func:`medfed.federated.strategies.solvers.graph.knn_graph`)."""
EDGE_WEIGHTINGS = ("gaussian", "uniform")
"""How a similarity graph weighs its edges (:mod:`medfed.federated.strategies.solvers.graph`)."""


@dataclass
class NoOptions:
    """No options (the ``strategy.<name>`` group of a strategy that takes none)."""


@dataclass
class FedProxOptions:
    """The ``strategy.fedprox`` group."""
    mu: float = 0.01
    """Weight of the proximal term; 0 is FedAvg. The paper tunes mu over {0.001, 0.01, 0.1, 1}
    per data set; 0.01, inside that grid, is not tuned on medfed's tasks."""

    def __post_init__(self) -> None:
        require(self.mu >= 0, "mu", self.mu, "mu >= 0")


@dataclass
class FedRepOptions:
    """The ``strategy.fedrep`` group."""
    preset: str = "equal"
    """"equal": head and body share trainer.local_epochs 2:1; "published": the head 2 and the body 1 x local_epochs."""
    head_share: float | None = None
    """tau_h: epochs of the head plan, in units of trainer.local_epochs; null: the preset's (2/3 or 2)."""
    body_share: float | None = None
    """tau: epochs of the body plan, in units of trainer.local_epochs; null: the preset's (1/3 or 1)."""
    head_steps: int | None = None
    """tau_h as a number of optimiser steps instead (overrides head_share)."""
    body_steps: int | None = None
    """tau as a number of optimiser steps instead (overrides body_share)."""

    def __post_init__(self) -> None:
        check_preset(self.preset)
        if self.head_share is None:
            self.head_share = by_preset(self.preset, 2.0 / 3.0, 2.0)
        if self.body_share is None:
            self.body_share = by_preset(self.preset, 1.0 / 3.0, 1.0)
        require(self.head_share > 0, "head_share", self.head_share, "a positive multiple of trainer.local_epochs")
        require(self.body_share > 0, "body_share", self.body_share, "a positive multiple of trainer.local_epochs")
        require(self.head_steps is None or self.head_steps >= 1, "head_steps", self.head_steps, "null or an integer >= 1")
        require(self.body_steps is None or self.body_steps >= 1, "body_steps", self.body_steps, "null or an integer >= 1")


@dataclass
class FedRoDOptions:
    """The ``strategy.fedrod`` group."""
    gamma: float = 1.0
    """Exponent of the class counts in BSM (1: the Balanced Softmax; 0: plain empirical loss)."""

    def __post_init__(self) -> None:
        require(self.gamma >= 0, "gamma", self.gamma, "gamma >= 0")


@dataclass
class FedBABUOptions:
    """The ``strategy.fedbabu`` group."""
    finetune_part: str = "personal"
    """What the adapt step fine-tunes before each evaluation: "personal" (the head, the last layer) or "all"."""
    finetune_epochs: float = 1.0
    """Epochs of fine-tuning per evaluation (over the site's training split)."""
    finetune_steps: int | None = None
    """Optimiser steps of fine-tuning per evaluation instead of epochs."""

    def __post_init__(self) -> None:
        require(self.finetune_part in ("personal", "all"), "finetune_part", self.finetune_part, '"personal" (the head) or "all"')
        require(self.finetune_epochs > 0, "finetune_epochs", self.finetune_epochs, "epochs > 0")
        require(self.finetune_steps is None or self.finetune_steps >= 1, "finetune_steps", self.finetune_steps, "null or >= 1")


@dataclass
class DittoOptions:
    """The ``strategy.ditto`` group."""
    lam: float = 0.1
    """lambda: pull of the personal model towards the global one; 0 = Local's model, large = the
    global model. The paper tunes it per data set over a small grid between 0.01 and 2; 0.1 is not
    tuned on medfed's tasks."""
    preset: str = "equal"
    """"equal": the global and personal plans share trainer.local_epochs equally; "published": each trains all of it."""
    global_share: float | None = None
    """Epochs of the global model per round, in units of trainer.local_epochs; null: the preset's (1/2 or 1)."""
    personal_share: float | None = None
    """Epochs of the personal model per round, in units of trainer.local_epochs; null: the preset's (1/2 or 1)."""
    personal_epochs: float | None = None
    """Epochs of the personal model per round instead (overrides personal_share)."""
    personal_steps: int | None = None
    """Optimiser steps of the personal model per round instead of epochs (the paper's s)."""

    def __post_init__(self) -> None:
        check_preset(self.preset)
        if self.global_share is None:
            self.global_share = by_preset(self.preset, 0.5, 1.0)
        if self.personal_share is None:
            self.personal_share = by_preset(self.preset, 0.5, 1.0)
        require(self.global_share > 0, "global_share", self.global_share, "a positive multiple of trainer.local_epochs")
        require(self.personal_share > 0, "personal_share", self.personal_share, "a positive multiple of trainer.local_epochs")
        require(self.lam >= 0, "lam", self.lam, "lambda >= 0")
        require(self.personal_epochs is None or self.personal_epochs > 0, "personal_epochs", self.personal_epochs, "null or > 0")
        require(self.personal_steps is None or self.personal_steps >= 1, "personal_steps", self.personal_steps, "null or >= 1")
        require(
            self.personal_epochs is None or self.personal_steps is None,
            "personal_steps",
            self.personal_steps,
            "null when personal_epochs is set (one length, epochs or steps)",
        )


@dataclass
class APFLOptions:
    """The ``strategy.apfl`` group."""
    preset: str = "equal"
    """"equal": the steps' two passes each share trainer.local_epochs; "published": a step per mini-batch of it."""
    step_share: float | None = None
    """Epochs of steps per round, in units of trainer.local_epochs (two passes each); null: the preset's (1/2 or 1)."""
    alpha: float = 0.5
    """Initial mixing weight alpha_i of the local model (the authors' code's default)."""
    adaptive: bool = True
    """Learn alpha_i by projected gradient steps (APFL's adaptive variant); false keeps it fixed."""
    alpha_lr: float | None = None
    """eta_alpha: step of alpha's updates; null = the learning rate of the local model's optimiser."""

    def __post_init__(self) -> None:
        check_preset(self.preset)
        if self.step_share is None:
            self.step_share = by_preset(self.preset, 0.5, 1.0)
        require(self.step_share > 0, "step_share", self.step_share, "a positive multiple of trainer.local_epochs")
        require(0.0 <= self.alpha <= 1.0, "alpha", self.alpha, "a weight in [0, 1]")
        require(self.alpha_lr is None or self.alpha_lr >= 0, "alpha_lr", self.alpha_lr, "null or >= 0")


@dataclass
class L2GDOptions:
    """The ``strategy.l2gd`` group."""
    mixing: float = 0.5
    """theta = alpha lambda / (n p): the fraction of the way to the mean each aggregation step
    moves a model; 0 = Local, 1 = FedAvg. 1/2 is the paper's theory's value (module docstring)."""

    def __post_init__(self) -> None:
        require(0.0 <= self.mixing <= 1.0, "mixing", self.mixing, "theta in [0, 1]")


@dataclass
class PFedMeOptions:
    """The ``strategy.pfedme`` group."""
    preset: str = "equal"
    """"equal": the K inner passes of every mini-batch share trainer.local_epochs (E/K epochs of
    mini-batches); "published": every mini-batch of E epochs takes them (K E epochs of passes)."""
    lam: float = 15.0
    """lambda: weight of ||theta - w||^2 in the inner problem (the paper's MNIST value)."""
    inner_steps: int = 5
    """K: gradient steps on the inner problem per mini-batch (at most K with inner_tolerance)."""
    inner_tolerance: float | None = None
    """nu: stop the inner steps once ||grad h(theta)|| <= nu (null: always K steps)."""
    inner_lr: float | None = None
    """Plain gradient steps of this size on the inner problem (the paper's personal learning
    rate); null: the model's own optimiser (e.g. Adam at model.lr) in the personal slot."""
    beta: float = 1.0
    """Server step: w <- (1 - beta) w + beta average (1: the average; the paper also uses 2)."""

    def __post_init__(self) -> None:
        check_preset(self.preset)
        require(self.lam > 0, "lam", self.lam, "lambda > 0")
        require(self.inner_steps >= 1, "inner_steps", self.inner_steps, "K >= 1")
        require(
            self.inner_tolerance is None or self.inner_tolerance > 0,
            "inner_tolerance", self.inner_tolerance, "null or nu > 0",
        )
        require(self.inner_lr is None or self.inner_lr > 0, "inner_lr", self.inner_lr, "null or a step > 0")
        require(self.beta > 0, "beta", self.beta, "beta > 0")


@dataclass
class SuPerFedOptions:
    """The ``strategy.superfed`` group."""
    mu: float = 0.01
    """Weight of the proximal term ||w^f - w^g||^2 (0: none)."""
    nu: float = 2.0
    """Weight of cos^2(w^f, w^l), the orthogonality regulariser (0: none)."""
    start_round: int = 7
    """First round that trains the mixture (the authors' floor(L R) + 1; 1 = from the start)."""
    eval_lambda: float = 1.0
    """The mixture each site is evaluated with: 0 = its federated model, 1 = its local model."""

    def __post_init__(self) -> None:
        require(self.mu >= 0, "mu", self.mu, "mu >= 0")
        require(self.nu >= 0, "nu", self.nu, "nu >= 0")
        require(self.start_round >= 1, "start_round", self.start_round, "a round >= 1")
        require(0.0 <= self.eval_lambda <= 1.0, "eval_lambda", self.eval_lambda, "a weight in [0, 1]")


@dataclass
class IFCAOptions:
    """The ``strategy.ifca`` group."""
    clusters: int = 2
    """k: cluster models on the server (the paper's CIFAR-10 setting; 1 = FedAvg)."""
    init_scale: float = 1.0
    """Seeded noise of the initial cluster models 2..k, in units of each parameter tensor's std."""

    def __post_init__(self) -> None:
        require(self.clusters >= 1, "clusters", self.clusters, "k >= 1")
        require(self.init_scale >= 0, "init_scale", self.init_scale, "a scale >= 0")


@dataclass
class FPFCOptions:
    """The ``strategy.fpfc`` group."""
    lam: float = 0.4
    """lambda of the pairwise penalty, in parameter-distance units (0 = no coupling: local training damped by rho)."""
    penalty: str = "scad"
    """"scad" (the paper's) or "mcp"."""
    a: float = 3.7
    """The penalty's concavity: flat beyond a * lam; SCAD needs a > 1 + 1/rho, MCP a > 1/rho (when lam > 0)."""
    rho: float = 1.0
    """ADMM penalty: weight of the site's proximal term and of the pair constraints."""
    smoothing: float = 1e-6
    """xi: the penalty is quadratic on [0, xi] (smooth at 0, as in the authors' code); 0 = plain SCAD/MCP."""

    def __post_init__(self) -> None:
        require(self.lam >= 0, "lam", self.lam, "lambda >= 0")
        require(self.penalty in PENALTIES, "penalty", self.penalty, f"one of {', '.join(PENALTIES)}")
        require(self.rho > 0, "rho", self.rho, "rho > 0")
        require(self.smoothing >= 0, "smoothing", self.smoothing, "xi >= 0")
        if self.lam == 0:  # the prox is the identity whatever a and xi
            return
        if self.penalty == "scad":
            require(self.a > 1 + 1 / self.rho, "a", self.a, f"a > 1 + 1/rho = {1 + 1 / self.rho:g} (SCAD: a convex server step)")
            require(self.smoothing < self.lam, "smoothing", self.smoothing, f"xi < lambda = {self.lam:g}")
        else:
            require(self.a > 1 / self.rho, "a", self.a, f"a > 1/rho = {1 / self.rho:g} (MCP: a convex server step)")
            require(self.smoothing < self.a * self.lam, "smoothing", self.smoothing, f"xi < a lambda = {self.a * self.lam:g}")


@dataclass
class FedAMPOptions:
    """The ``strategy.fedamp`` group."""
    variant: str = "exponential"
    """"exponential" (the paper's A(t) = 1 - exp(-t/sigma)) or "heuristic" (cosine softmax, for deep nets)."""
    alpha: float = 0.01
    """alpha_k: the server's step on the attention term; also divides lam in the proximal weight."""
    lam: float = 0.01
    """lambda: weight of the attention term; the site's proximal weight is lam / (2 alpha)."""
    sigma: float = 1.0
    """A's scale (exponential variant), in the units of squared parameter distances."""
    self_weight: float = 0.5
    """xi_ii of the heuristic variant."""
    cosine_scale: float = 10.0
    """The heuristic variant's sigma: multiplies the cosine similarities inside the softmax."""

    def __post_init__(self) -> None:
        require(self.variant in VARIANTS, "variant", self.variant, f"one of {', '.join(VARIANTS)}")
        require(self.alpha > 0, "alpha", self.alpha, "alpha > 0")
        require(self.lam >= 0, "lam", self.lam, "lambda >= 0")
        require(self.sigma > 0, "sigma", self.sigma, "sigma > 0")
        require(0.0 <= self.self_weight <= 1.0, "self_weight", self.self_weight, "a weight in [0, 1]")
        require(self.cosine_scale >= 0, "cosine_scale", self.cosine_scale, "a scale >= 0")


@dataclass
class APPLEOptions:
    """The ``strategy.apple`` group."""
    dr_lr: float = 1e-3
    """eta_2: SGD step of the DR vector p_i (eq. 6)."""
    mu: float = 0.1
    """Weight of the proximal DR penalty (eq. 7); 0 disables it."""
    scheduler: str = "cosine"
    """Loss scheduler lambda(r): "cosine" or "exponential" (appendix A.1)."""
    scheduler_rounds: int = 32
    """L: lambda(r) = 0 from round r = L on (the paper uses 10-30% of its 160 rounds)."""
    scheduler_eps: float = 1e-3
    """eps of the exponential scheduler eps^(r/L)."""
    download_budget: int | None = None
    """M: core models a site downloads per round; null = all N - 1 (no limit)."""

    def __post_init__(self) -> None:
        require(self.dr_lr >= 0, "dr_lr", self.dr_lr, "eta_2 >= 0")
        require(self.mu >= 0, "mu", self.mu, "mu >= 0")
        require(self.scheduler in SCHEDULERS, "scheduler", self.scheduler, f"one of {', '.join(SCHEDULERS)}")
        require(self.scheduler_rounds >= 1, "scheduler_rounds", self.scheduler_rounds, "L >= 1")
        require(0 < self.scheduler_eps < 1, "scheduler_eps", self.scheduler_eps, "eps in (0, 1)")
        require(
            self.download_budget is None or self.download_budget >= 1,
            "download_budget",
            self.download_budget,
            "null or M >= 1",
        )


@dataclass
class PGFedOptions:
    """The ``strategy.pgfed`` group."""
    mu: float = 0.1
    """Weight of the auxiliary (other sites') risk in each site's objective (eq. 5)."""
    alpha_lr: float = 0.01
    """eta_2: step of the learned weights a_ij (Algorithm 1, line 10)."""

    def __post_init__(self) -> None:
        require(self.mu >= 0, "mu", self.mu, "mu >= 0")
        require(self.alpha_lr >= 0, "alpha_lr", self.alpha_lr, "eta_2 >= 0")


@dataclass
class PGFedMoOptions(PGFedOptions):
    """The ``strategy.pgfedmo`` group."""
    beta: float = 0.5
    """Momentum on the auxiliary gradient; 0 gives PGFed exactly."""

    def __post_init__(self) -> None:
        super().__post_init__()
        require(0.0 <= self.beta < 1.0, "beta", self.beta, "a momentum in [0, 1)")


@dataclass
class PFedNetOptions:
    """The ``strategy.pfednet`` group."""
    lam: float = 0.1
    """Strength of the graph penalty: a fraction of the fusion threshold (lam_scale=fusion: 1 fuses
    each connected component into one personal part, and tight groups fuse well below 1; see the
    module docstring and the distinct_personal metric), or lambda in the paper's units
    (lam_scale=absolute). 0 = independent personal parts.
    0.1 was best on the validation split of brats_lack0 and luna16_delta4 among 0, 0.1,
    0.3, 1 (p = 2, 30 rounds, seed 0; benchmarks/pfednet_lambda_path.py)."""
    lam_scale: str = "fusion"
    """"fusion" (lam relative to the round's fusion threshold) or "absolute"."""
    server_lr: float = 0.015
    """eta_s: weight 1/(2 eta_s) of the proximal term around the sites' trained z~.
    Matters only with lam_scale=absolute (lam * eta_s is the per-edge shrinkage in parameter units)."""
    p: str = "2"
    """Column norm of the penalty: "1", "2" or "inf"."""
    graph_space: str = "data"
    """Similarity of sites measured in "data", "feature" or "model" space."""
    knn_k: int = 2
    """Neighbours per site (k = 2 at 5 sites leaves 5-8 of the 10 possible edges)."""
    knn_rule: str = "union"
    """"union" (i-j if either is among the other's k nearest) or "mutual" (both)."""
    edge_weights: str = "gaussian"
    """"gaussian" (exp(-d^2 / 2 sigma^2), sigma = median edge distance) or "uniform" (1)."""
    graph_standardize: bool = False
    """z-score sketch features across sites before measuring distances (data/feature spaces)."""
    graph_refresh_rounds: int = 5
    """Model space: rebuild the graph every this many rounds (0 = build once, at round 1)."""
    min_sketch_samples: int = 16
    """A site with fewer training samples refuses to send a (data/feature) sketch."""
    kernel_features: int = 256
    """Random Fourier features of the data-space sketch."""
    kernel_bandwidth: float | None = None
    """sigma of the data-space Gaussian kernel; null = sqrt(channels + classes)."""
    rho: float | None = None
    """ADMM penalty; default 1 / server_lr (then adapted by residual balancing)."""
    admm_max_iter: int = 500
    admm_abs_tol: float = 1e-6
    admm_rel_tol: float = 1e-5
    schedule: str | None = None
    """"joint": one phase whose one plan trains shared and personal parts together for all of
    trainer.local_epochs, after which the server averages x and solves the network lasso on z from the
    same replies (the paper's Algorithm 2 with local steps); "alternating": a shared phase, then a
    personal phase (each trains its part only); null: the preset's (equal: joint, the better of the
    two at equal budget on brats_lack0, docs/pfednet.md; published: alternating), alternating where
    full_epoch_per_phase is true."""
    preset: str = "equal"
    """"equal": joint, or the two alternating phases share trainer.local_epochs; "published": alternating,
    each phase trains all of it (with schedule joint the one plan trains trainer.local_epochs either way)."""
    full_epoch_per_phase: bool | None = None
    """True: each phase trains all of trainer.local_epochs (the paper's setting: twice a
    one-phase baseline's local steps per round); False: each phase takes half of them (all of
    them when the other part is empty), so a round takes the local steps a FedAvg round takes;
    null: the preset's (False or True). Alternating schedule only: null or false with joint."""

    def __post_init__(self) -> None:
        check_preset(self.preset)
        if self.schedule is None:
            self.schedule = "alternating" if self.full_epoch_per_phase else by_preset(self.preset, "joint", "alternating")
        require(self.schedule in SCHEDULES, "schedule", self.schedule, f"null or one of {', '.join(SCHEDULES)}")
        if self.schedule == "joint":
            require(
                not self.full_epoch_per_phase, "full_epoch_per_phase", self.full_epoch_per_phase,
                "null or false with schedule joint (its one plan trains trainer.local_epochs)",
            )
            self.full_epoch_per_phase = False
        if self.full_epoch_per_phase is None:
            self.full_epoch_per_phase = by_preset(self.preset, False, True)
        require(self.lam >= 0, "lam", self.lam, "lambda >= 0")
        require(self.lam_scale in LAM_SCALES, "lam_scale", self.lam_scale, "one of fusion, absolute")
        require(self.server_lr > 0, "server_lr", self.server_lr, "eta_s > 0")
        require(str(self.p) in P_NORMS, "p", self.p, "one of 1, 2, inf")
        require(self.graph_space in GRAPH_SPACES, "graph_space", self.graph_space, "one of data, feature, model")
        require(self.knn_k >= 1, "knn_k", self.knn_k, "k >= 1")
        require(self.knn_rule in KNN_RULES, "knn_rule", self.knn_rule, "one of union, mutual")
        require(self.edge_weights in EDGE_WEIGHTINGS, "edge_weights", self.edge_weights, "one of gaussian, uniform")
        require(self.graph_refresh_rounds >= 0, "graph_refresh_rounds", self.graph_refresh_rounds, "an integer >= 0")
        require(self.min_sketch_samples >= 2, "min_sketch_samples", self.min_sketch_samples, "an integer >= 2")
        require(self.kernel_features >= 1, "kernel_features", self.kernel_features, "an integer >= 1")
        require(
            self.kernel_bandwidth is None or self.kernel_bandwidth > 0,
            "kernel_bandwidth", self.kernel_bandwidth, "null or sigma > 0",
        )
        require(self.rho is None or self.rho > 0, "rho", self.rho, "null or rho > 0")
        require(self.admm_max_iter >= 1, "admm_max_iter", self.admm_max_iter, ">= 1")


@dataclass(frozen=True)
class StrategySpec:
    """A strategy's identity, declared once and torch-free: its registration line in :data:`STRATEGY_SPECS`.

    Everything that names, lists, configures or smoke-tests a strategy reads it
    from here: ``python -m medfed strategies`` and the generated tables, the
    ``strategy`` config group, compare grids, and the tests' per-strategy
    options; the class at ``implementation`` takes its ``name``, ``spec`` and
    ``Options`` from it when it is defined
    (:class:`~medfed.federated.strategies.base.Strategy`).

    Attributes:
        name: the ``strategy.name`` value (lower case, digits, underscores).
        implementation: ``"module:Class"``, the Strategy subclass (imported only by :meth:`load`).
        summary: one line for the CLI list and the README's table.
        reference: the paper the implementation follows ("" for none).
        options: the ``strategy.<name>`` group's dataclass (torch-free: defined in a module that imports no torch).
        smoke: option values under which the strategy's loss reads all its declared state on a tiny federation
            (a few sites, rounds and steps): what the registry-driven tests run it with.
    """

    name: str
    implementation: str
    summary: str
    reference: str = ""
    options: type = NoOptions
    smoke: dict[str, Any] = field(default_factory=dict)

    def load(self) -> type:
        """The Strategy subclass at :attr:`implementation` (imports its module, and torch).

        Raises:
            ImportError: naming the spec, where the module or the class is missing or the class was not bound to
                this spec (it is defined at another path than ``implementation`` says).
        """
        module_name, _, attribute = self.implementation.partition(":")
        cls = getattr(importlib.import_module(module_name), attribute, None)
        if cls is None or getattr(cls, "spec", None) is not self:
            raise ImportError(f"strategy {self.name!r}: {self.implementation} is not a Strategy subclass defined at that path")
        return cls


#: Every registered strategy, in the order they are listed: one line each (adding one: docs/strategies.md).
STRATEGY_SPECS: tuple[StrategySpec, ...] = (
    StrategySpec(
        "local", "medfed.federated.strategies.local:Local", "every site trains its own model alone; nothing is exchanged (the lower reference)",
    ),
    StrategySpec(
        "fedavg", "medfed.federated.strategies.fedavg:FedAvg", "one global model, sample-weighted averaging of parameters and buffers",
        "McMahan et al., Communication-efficient learning of deep networks from decentralized data, AISTATS 2017",
    ),
    StrategySpec(
        "fedbn", "medfed.federated.strategies.fedbn:FedBN", "FedAvg with every BatchNorm layer (affine and running statistics) kept at its site",
        "Li et al., FedBN: Federated learning on non-IID features via local batch normalization, ICLR 2021",
    ),
    StrategySpec(
        "fedprox", "medfed.federated.strategies.fedprox:FedProx", "FedAvg whose local objective adds mu/2 ||w - w_global||^2",
        "Li, Sahu, Zaheer, Sanjabi, Talwalkar, Smith, Federated optimization in heterogeneous networks, MLSys 2020",
        FedProxOptions, {"mu": 0.5},
    ),
    StrategySpec(
        "fedper", "medfed.federated.strategies.fedper:FedPer",
        "shared base layers averaged (FedAvg), personalisation layers (the split's personal part) never leave the site",
        "Arivazhagan, Aggarwal, Singh, Choudhary, Federated learning with personalization layers, arXiv:1912.00818, 2019",
    ),
    StrategySpec(
        "lgfedavg", "medfed.federated.strategies.lgfedavg:LGFedAvg",
        "each site keeps its local representation (the body); the global model on top (the head) is averaged",
        "Liang et al., Think locally, act globally: federated learning with local and global representations, arXiv:2001.01523, 2020",
    ),
    StrategySpec(
        "fedrep", "medfed.federated.strategies.fedrep:FedRep",
        "each round trains the personal head (body frozen), then the shared body (head frozen); bodies averaged",
        "Collins, Hassani, Mokhtari, Shakkottai, Exploiting shared representations for personalized federated learning, ICML 2021",
        FedRepOptions,
    ),
    StrategySpec(
        "fedrod", "medfed.federated.strategies.fedrod:FedRoD",
        "body + generic head trained with the balanced softmax and averaged; a personal head adds its logits at each site",
        "Chen and Chao, On bridging generic and personalized federated learning for image classification, ICLR 2022",
        FedRoDOptions,
    ),
    StrategySpec(
        "fedbabu", "medfed.federated.strategies.fedbabu:FedBABU",
        "body trained and averaged with the head (last layer) frozen at its initialisation; the head fine-tuned at each site to evaluate",
        "Oh, Kim and Yun, FedBABU: Towards enhanced representation for federated image classification, ICLR 2022",
        FedBABUOptions,
    ),
    StrategySpec(
        "ditto", "medfed.federated.strategies.ditto:Ditto", "a FedAvg global model, and a personal model per site trained near it (lambda/2 ||v - w||^2)",
        "Li, Hu, Beirami, Smith, Ditto: fair and robust federated learning through personalization, ICML 2021",
        DittoOptions,
    ),
    StrategySpec(
        "apfl", "medfed.federated.strategies.apfl:APFL", "each site evaluates alpha v + (1 - alpha) w, its own model mixed with the FedAvg one, alpha learned",
        "Deng, Kamani, Mahdavi, Adaptive personalized federated learning, arXiv 2003.13461 (2020)",
        APFLOptions,
    ),
    StrategySpec(
        "l2gd", "medfed.federated.strategies.l2gd:L2GD", "local models trained alone, then each moved part of the way (theta) towards their mean every round",
        "Hanzely and Richtarik, Federated learning of a mixture of global and local models, arXiv 2002.05516 (2020)",
        L2GDOptions,
    ),
    StrategySpec(
        "pfedme", "medfed.federated.strategies.pfedme:PFedMe",
        "personalised models as proximal points of each site's loss (Moreau envelopes) around a global model",
        "Dinh, Tran and Nguyen, Personalized federated learning with Moreau envelopes, NeurIPS 2020",
        PFedMeOptions, {"lam": 1.0},  # eta lam < 1 with a toy SGD step of 0.5 (lam = 15 overshoots w)
    ),
    StrategySpec(
        "superfed", "medfed.federated.strategies.superfed:SuPerFed",
        "federated and local models trained as the ends of a low-loss line (random mixtures, orthogonality, proximal term)",
        "Hahn, Jeong and Lee, Connecting low-loss subspace for personalized federated learning, KDD 2022",
        SuPerFedOptions, {"start_round": 2},  # mixtures from round 2 on: both regimes in a few rounds
    ),
    StrategySpec(
        "ifca", "medfed.federated.strategies.ifca:IFCA", "k cluster models: each site trains, and is evaluated with, the one with the lowest loss on its data",
        "Ghosh, Chung, Yin and Ramchandran, An efficient framework for clustered federated learning, NeurIPS 2020 / "
        "IEEE Trans. Inf. Theory 2022",
        IFCAOptions,
    ),
    StrategySpec(
        "fpfc", "medfed.federated.strategies.fpfc:FPFC",
        "personalised models fused into clusters by a concave (SCAD/MCP) pairwise penalty, ADMM with the pair variables on the server",
        "Yu, Liu, Wang and Sun, Clustered federated learning based on nonconvex pairwise fusion, arXiv 2211.04218",
        FPFCOptions,
    ),
    StrategySpec(
        "fedamp", "medfed.federated.strategies.fedamp:FedAMP", "attentive message passing: each site trains near a cloud model of similar sites' models",
        "Huang et al., Personalized cross-silo federated learning on non-IID data, AAAI 2021",
        FedAMPOptions, {"lam": 0.01, "alpha": 0.5, "sigma": 5.0},
    ),
    StrategySpec(
        "apple", "medfed.federated.strategies.apple:APPLE", "each site mixes every site's core model with directed relationships it learns",
        "Luo and Wu, Adapt to adaptation: learning personalization for cross-silo federated learning, IJCAI 2022",
        APPLEOptions, {"download_budget": 1, "scheduler_rounds": 4},  # one core downloaded; lambda(r) > 0 for 3 rounds
    ),
    StrategySpec(
        "pgfed", "medfed.federated.strategies.pgfed:PGFed", "each site adds a first-order estimate of the other sites' risks, weighted by learned a_ij",
        "Luo, Chen, Wu, Zhang, PGFed: personalize each client's global objective for federated learning, ICCV 2023",
        PGFedOptions,
    ),
    StrategySpec(
        "pgfedmo", "medfed.federated.strategies.pgfed:PGFedMo", "PGFed with momentum on each site's auxiliary gradient",
        "Luo, Chen, Wu, Zhang, PGFed: personalize each client's global objective for federated learning, ICCV 2023",
        PGFedMoOptions,
    ),
    StrategySpec(
        "pfednet", "medfed.federated.strategies.pfednet:PFedNet",
        "graph-coupled personalisation: shared part averaged, personal parts fused over a site similarity network",
        "Zhao, Liu, Liu, He, Medical federated model with mixture of personalized and sharing components",
        PFedNetOptions,
    ),
    StrategySpec(
        "pooled", "medfed.federated.strategies.pooled:Pooled",
        "one model trained on every site's training data pooled, evaluated at each site (NOT federated: the centralised upper reference)",
        "the pooled (centralised) baseline of du Terrail et al., FLamby: datasets and benchmarks for cross-silo federated learning in "
        "realistic healthcare settings, NeurIPS 2022",
    ),
)
STRATEGY_OPTIONS: dict[str, type] = {spec.name: spec.options for spec in STRATEGY_SPECS}
"""Every registered strategy's ``Options``, by name, in the registry's order."""


def strategy_spec(name: str) -> StrategySpec:
    """The spec registered as ``name``.

    Raises:
        KeyError: no strategy is registered as ``name``.
    """
    for spec in STRATEGY_SPECS:
        if spec.name == name:
            return spec
    raise KeyError(f"no strategy is registered as {name!r}")


def spec_at(implementation: str) -> StrategySpec | None:
    """The spec whose class is defined at ``implementation`` (``"module:Class"``), or None."""
    return next((spec for spec in STRATEGY_SPECS if spec.implementation == implementation), None)


def parse_strategy_group(group: dict[str, Any]) -> tuple[str, Any, dict[str, Any]]:
    """The ``strategy`` config group checked: the chosen name, its options, and every subgroup given, validated.

    The group names the algorithm and may hold options for any strategy under
    its own name (``strategy.pfednet.lam``); every subgroup is validated, so a
    typo is caught even in one the run does not use.

    Returns:
        ``(name, options, given)``: ``strategy.name``, its ``Options`` instance
        (its subgroup, or the defaults), and ``{strategy name: its Options}``
        for every subgroup in ``group``.

    Raises:
        ConfigError: naming ``strategy.name``, an unknown ``strategy.<key>``,
            or the unknown or bad option.
    """
    name = group.get("name")
    if name not in STRATEGY_OPTIONS:
        close = did_you_mean(name, sorted(STRATEGY_OPTIONS)) if isinstance(name, str) else ""
        raise ConfigError(f"config key 'strategy.name' = {name!r}: expected one of {', '.join(sorted(STRATEGY_OPTIONS))}{close}")
    unknown = [key for key in group if key != "name" and key not in STRATEGY_OPTIONS]
    if unknown:
        raise ConfigError(
            f"unknown config key 'strategy.{unknown[0]}'{did_you_mean(unknown[0], ['name', *sorted(STRATEGY_OPTIONS)], 'strategy.')} "
            f"(expected 'name' or a strategy's options: {', '.join(sorted(STRATEGY_OPTIONS))})"
        )
    given = {
        key: parse_options(STRATEGY_OPTIONS[key], values or {}, f"strategy.{key}") for key, values in group.items() if key != "name"
    }
    return name, given.get(name, STRATEGY_OPTIONS[name]()), given
