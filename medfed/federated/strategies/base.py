"""The default halves and :class:`Strategy`: what a new algorithm subclasses.

The contract itself (the life cycle of a run, the round context, the site
view, payloads, training plans, auxiliary parameters, declared state, secure
sums, the compute budget) is :mod:`medfed.federated.protocol`; the framework
imports that and never this folder. The defaults here describe local training
of the site's one model with nothing exchanged: a server that keeps and sends
nothing (:class:`ServerHalf`), a site half that trains its model on its own
loss (:class:`SiteHalf`), and a strategy of one ``fit`` phase and one model
slot (:class:`Strategy`). A proximal term weight/2 ||w - centre||^2 is
written once (:mod:`medfed.federated.strategies.proximal`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import torch

from medfed.federated.aggregate import Aggregation
from medfed.federated.protocol import (
    MODEL, SUMMED, Auxiliary, DeclaredState, Payload, RoundContext, SecureSum, ServerHalfProtocol, SiteHalfProtocol,
    SiteView, StrategyProtocol, TrainingPlan,
)
from medfed.models.split import ParameterSplit
from medfed.options.strategies import NoOptions, StrategySpec, spec_at

if TYPE_CHECKING:
    from medfed.models.base import FederatedModule


class ServerHalf(DeclaredState, ServerHalfProtocol):
    """The server's half (:class:`~medfed.federated.protocol.ServerHalfProtocol`): by default it keeps and sends nothing.

    Args:
        options: the strategy's validated ``Options``.
        split: names and sizes of the model's parts (the server knows the
            architecture, not the weights).
        n_sites: number of sites in the federation.
        seed: the run's seed, for any randomness the server needs.
    """

    #: the run's rule for the parts this half averages (the ``aggregation`` group, :mod:`medfed.federated.aggregate`;
    #: set by :class:`~medfed.assembly.RunAssembly`): a half that averages calls it where it would take a weighted mean
    aggregation: Aggregation = Aggregation()

    def __init__(self, options: Any, split: ParameterSplit, n_sites: int, seed: int) -> None:
        self.options = options
        self.split = split
        self.n_sites = n_sites
        self.seed = seed

    def setup(self, ctx: RoundContext, initial: Payload, replies: dict[int, Payload]) -> None:
        """Default: nothing to set up."""

    def message(self, ctx: RoundContext, site_index: int) -> Payload:
        """Default: an empty message."""
        return {}

    def aggregate(self, ctx: RoundContext, replies: dict[int, Payload]) -> None:
        """Default: nothing to combine."""

    def aggregate_summed(self, ctx: RoundContext, summed: Payload) -> None:
        """Default: :meth:`aggregate` of the one summed reply, under the key
        :data:`~medfed.federated.protocol.SUMMED` that no site has: right for every server step that is a
        weighted mean of the replies (one reply of weight W is its own mean)."""
        self.aggregate(ctx, {SUMMED: summed})

    def reply_keys(self, ctx: RoundContext, site_index: int) -> tuple[frozenset[str], ...]:
        """Default: an empty reply, as the default site half sends."""
        return (frozenset(),)

    def reply_fault(self, ctx: RoundContext, site_index: int, reply: Payload) -> str | None:
        """Default: nothing to refuse."""
        return None

    def deliver(self, ctx: RoundContext, site_index: int) -> Payload:
        """Default: nothing delivered."""
        return {}

    def metrics(self) -> dict[str, float]:
        """Default: none."""
        return {}

    def figures(self) -> dict[str, Any]:
        """Default: none."""
        return {}


class SiteHalf(DeclaredState, SiteHalfProtocol):
    """One site's half (:class:`~medfed.federated.protocol.SiteHalfProtocol`): by default local training of the
    site's one model with nothing exchanged.

    Args:
        options, split, n_sites, seed: as for :class:`ServerHalf`.
        index: the site this half runs at.
    """

    loss_state: ClassVar[tuple[str, ...]] = ()
    batchable: ClassVar[str | None] = None

    def __init__(self, options: Any, split: ParameterSplit, n_sites: int, seed: int, index: int) -> None:
        self.options = options
        self.split = split
        self.n_sites = n_sites
        self.seed = seed
        self.index = index
        for name in self.loss_state:  # every declared loss state starts unset; the half's hooks set it
            setattr(self, name, None)

    def auxiliary(self, ctx: RoundContext, plan: TrainingPlan) -> dict[str, Auxiliary]:
        """Default: none."""
        return {}

    def setup(self, site: SiteView, ctx: RoundContext) -> Payload:
        """Default: nothing sent."""
        return {}

    def receive(self, site: SiteView, ctx: RoundContext, payload: Payload) -> None:
        """Default: nothing loaded."""

    def deliver(self, site: SiteView, ctx: RoundContext, payload: Payload) -> None:
        """Default: nothing loaded."""

    def plan(self, ctx: RoundContext) -> tuple[TrainingPlan, ...]:
        """Default: the site's one model, all of it, for the round's whole budget."""
        return (TrainingPlan(),)

    def loss(self, site: SiteView, ctx: RoundContext, plan: TrainingPlan, batch: Any) -> torch.Tensor:
        """Default: the slot's own training loss plus :meth:`regularizer`."""
        loss = site.module(plan.slot).training_step(batch, 0)
        regularizer = self.regularizer(site, ctx, plan)
        return loss if regularizer is None else loss + regularizer

    def regularizer(self, site: SiteView, ctx: RoundContext, plan: TrainingPlan) -> torch.Tensor | None:
        """A term added to every local step's loss (e.g. a proximal term), or ``None``."""
        return None

    def reply(self, site: SiteView, ctx: RoundContext) -> Payload:
        """Default: nothing sent."""
        return {}

    def adapt(self, ctx: RoundContext) -> tuple[TrainingPlan, ...]:
        """Default: no adapt step."""
        return ()


class Strategy(StrategyProtocol):
    """A registered algorithm: its round shape, wire, slots and halves.

    Subclasses set the class attributes; an instance wires the halves for
    one run (``strategy.server`` and ``strategy.site_half(i)``). A class's
    identity is its registration line (:class:`~medfed.options.strategies.StrategySpec`,
    found by the path the class is defined at): ``name``, ``spec`` and
    ``Options`` are set from it when the class is defined; a subclass that is
    not registered keeps its parent's.

    Args:
        options: the validated ``Options`` instance.
        split: the model's parts.
        n_sites: number of sites.
        seed: the run's seed.
    """

    #: the registration line (name, summary, reference, options, smoke preset)
    spec: ClassVar[StrategySpec]
    name: ClassVar[str]
    #: the ``strategy.<name>`` group's dataclass, declared in the torch-free :mod:`medfed.options.strategies`
    Options: ClassVar[type] = NoOptions
    phases: ClassVar[tuple[str, ...]] = ("fit",)
    #: payload keys carrying model-sized vectors, the only ones a codec compresses, mapped to the
    #: initial vector their first message is coded against ("zeros" for gradients); "key/..."
    #: matches the prefix "key" (e.g. ``{"core": "all"}`` covers "core/0", "core/1", ...). A
    #: model-sized tensor under any other key is refused by the link.
    coded_keys: ClassVar[dict[str, str]] = {"all": "all", "shared": "shared", "personal": "personal"}
    #: the model slots every site holds
    slots: ClassVar[tuple[str, ...]] = (MODEL,)
    #: the slot each site is evaluated with
    evaluated_slot: ClassVar[str] = MODEL
    #: the pooled (centralised) reference only: the run gives site ``medfed.data.pooling.POOL_SITE`` the
    #: union of every site's training data, deliberately breaking the rule that data stay at their site
    pools_data: ClassVar[bool] = False
    #: privacy compatibility (``docs/privacy.md``, :func:`medfed.components.privacy_table`): None where the
    #: mechanism fits the strategy, else why not. DP-SGD at the sites (:mod:`medfed.federated.privacy`)
    #: fits where every data-dependent thing a site sends comes out of its DP-SGD steps, one step per
    #: sampled batch; client-level DP (clipped updates, noise at aggregation) and secure aggregation fit
    #: where the server step needs only the (weighted) sum of the sites' vectors.
    dp_sgd_refusal: ClassVar[str | None] = None
    client_dp_refusal: ClassVar[str | None] = "not declared"
    secure_aggregation_refusal: ClassVar[str | None] = "not declared"
    #: robust aggregation (``aggregation.name`` other than ``mean``, :mod:`medfed.federated.aggregate`): None where
    #: the server half passes the parts it averages through :attr:`ServerHalf.aggregation`, else why it cannot
    robust_aggregation_refusal: ClassVar[str | None] = "not declared"
    #: what secure aggregation may hide, ``{phase: SecureSum}``: the phases whose replies the server half needs only
    #: as a weighted sum (:meth:`ServerHalf.aggregate_summed`); a deployment with ``deploy.secure_aggregation``
    #: masks those replies with SecAgg+ (:mod:`medfed.deploy.secure_aggregation`). Every other phase must reply
    #: with nothing; declared where ``secure_aggregation_refusal`` is None
    secure_sums: ClassVar[dict[str, SecureSum]] = {}
    Server: ClassVar[type[ServerHalf]] = ServerHalf
    Site: ClassVar[type[SiteHalf]] = SiteHalf

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        spec = spec_at(f"{cls.__module__}:{cls.__qualname__}")
        if spec is not None:
            cls.spec, cls.name, cls.Options = spec, spec.name, spec.options

    def __init__(self, options: Any, split: ParameterSplit, n_sites: int, seed: int) -> None:
        self.options = options
        self.split = split
        self.n_sites = n_sites
        self.seed = seed
        self.server = self.server_half()

    @classmethod
    def prepare_slot(cls, slot: str, module: FederatedModule) -> None:
        """Adapt ``slot``'s fresh copy of the seeded prototype, before its optimiser is made; default: nothing.

        Called wherever a slot's module is built (each site's slots, and the
        model ``predict`` loads a saved evaluated slot into), so anything it
        adds to the module (e.g. FedRoD's personal head) is in the optimiser,
        the checkpoints and the saved model alike.
        """

    @classmethod
    def dp_sgd_refused(cls, options: Any) -> str | None:
        """Why DP-SGD cannot run with ``options`` (None: it can); default: :attr:`dp_sgd_refusal`."""
        return cls.dp_sgd_refusal

    def server_half(self) -> ServerHalf:
        """The server's half of the run (``strategy.server``)."""
        return self.Server(self.options, self.split, self.n_sites, self.seed)

    def site_half(self, index: int) -> SiteHalf:
        """The half that runs at site ``index``."""
        return self.Site(self.options, self.split, self.n_sites, self.seed, index)

    def initial_values(self, model: Payload) -> Payload:
        """The vectors both ends of every link hold before any message: by default the initial model's parts.

        A strategy that sends vectors both ends can derive from the seeded
        initial model and the run's seed (IFCA's seeded cluster models) adds
        them under the payload key they travel as; a link codes a key's first
        message against the vector of the key's own name where there is one,
        else against its ``coded_keys`` part (:mod:`medfed.federated.link`).
        The server half's ``setup`` receives the same vectors.

        Args:
            model: ``{part: vector}``, the initial model (every part of :data:`~medfed.models.split.PARTS`).
        """
        return model
