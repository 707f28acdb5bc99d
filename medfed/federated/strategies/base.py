"""The life cycle every federated algorithm follows: a server half and a site half that share only messages.

A strategy is three classes registered under one name:

* :class:`Strategy`, the registry entry: the name, the options
  (the ``strategy.<name>`` config group), the phases of a round, which
  message keys carry model vectors (``coded_keys``), the model slots a site
  holds and the one it is evaluated with;
* :class:`ServerHalf`: the server's state and steps; it sees only the
  payloads sites send;
* :class:`SiteHalf`: one per site, the site's own state and local work; it
  sees its site through a :class:`~medfed.federated.site_view.SiteView`
  (model slots, sample counts, step and full-pass helpers, seeded random
  streams), the payloads the server sends, and in every hook a
  :class:`~medfed.federated.site_view.RoundContext` (round, phase).

The halves share the options and nothing else; every payload
(``dict[str, Tensor]``) crosses a :class:`~medfed.federated.link.Link`,
which encodes it to real bytes, so the rule "the server sees only what sites
send" holds by construction, and the same halves run in one process (the
simulator) or on different machines (:mod:`medfed.deploy`).

One run, as :class:`~medfed.federated.loop.FederatedLoop` drives it::

    replies = {i: site_i.setup(view_i, (0, "setup"))}         # e.g. a data sketch
    server.setup((0, "setup"), initial, replies)              # initial = {"shared", "personal", "all"} vectors
    deliver to every site                                     # round 0: ctx (0, "deliver")
    for round in 1..R:
        for phase in phases:                                  # ctx = RoundContext(round, phase)
            messages = {i: server.message(ctx, i)}            # for each participating site i
            for each participating site i:
                site_i.receive(view_i, ctx, messages[i])
                for plan in site_i.plan(ctx):                 # TrainingPlan: slot, part, how long
                    train plan.part of slot plan.slot on site_i.loss(view_i, ctx, plan, batch)
                replies[i] = site_i.reply(view_i, ctx)
            server.aggregate(ctx, replies)                    # not called when no reply came through
        deliver = RoundContext(round, "deliver")
        for every site i: site_i.receive(view_i, deliver, server.deliver(deliver, i))
        for every site i: for plan in site_i.adapt((round, "adapt")): train ...   # e.g. fine-tune a head
        every site evaluates its model slot ``evaluated_slot`` on its own test split

(The server's messages of a phase are all made before any site trains, as
they would be with sites training at the same time: ``message`` may depend
only on server state, and must not change it. A participant that fails in a
phase, see :mod:`medfed.federated.faults`, is missing from that phase's
replies and takes no part in the rest of the round; it is put back to its
start-of-round state (slots, data order and site-half state) and gets the
delivery, so the server must treat it as a site that did not take part from
that phase on: whatever it learns about a site, it learns from the replies.)

"Deliver" hands each site what it is evaluated with (FedAvg: the global
model; pFedNet: M x + N z_i); strategies whose model never leaves the site
deliver nothing (``delivered = None``).

*The compute budget.* ``trainer.local_epochs`` = E is the budget of
training passes per site and round, in epochs of the site's training split
(E = 0.5: half a pass), the same for every strategy: the forward and
backward passes of its training plans, counted as ``train/*`` in the round
record's ``compute`` (:mod:`medfed.federated.compute`), sum to E epochs,
cut at whole mini-batches (the round's plans are cut along one axis, so
together they are within a mini-batch of E epochs; APFL's steps of two
passes within two). A strategy states in its docstring how its plans split
E (``TrainingPlan.share``): FedRep's head and body 2/3 + 1/3, Ditto's
global and personal models 1/2 + 1/2, pFedNet's shared and personal phases
1/2 + 1/2 (all of it to the personal phase where the shared part is empty),
APFL's steps (two passes each: w's and v_bar's) 1/2, pFedMe's passes all
of it (``TrainingPlan.passes_per_step`` = K: about E B / K local rounds of K
inner passes, the last ones the samples left).
Passes outside the training plans are reported, not charged: ``aux/*``
(PGFed's gradient estimate over the training split), ``adapt/*``
(FedBABU's fine-tuning before each evaluation) and ``forward/*`` (IFCA's
cluster losses, no backward pass). Equal budget is about the training a
method gets, and those passes are not training a site could spend on its
model instead: they are a fixed cost of the method's protocol (PGFed's
estimate is one epoch whatever E, so charging it would leave PGFed no budget
below one epoch and none of its own at E = 1), or of how often a run is
evaluated (FedBABU fine-tunes at every evaluation, and each fine-tuning
starts again from the delivered model); the compare tables show them beside
the budget. A strategy whose published protocol trains more than E (FedRep,
Ditto, APFL, pFedMe, pFedNet) keeps it as ``strategy.<name>.preset:
published`` (:mod:`medfed.options.presets`).

*The local objective.* A step's loss (:meth:`SiteHalf.loss`, with
:meth:`SiteHalf.regularizer`) is a pure function of the slots' parameters
and buffers (read through ``site.module``), the batch, ``ctx``, the plan,
the options and the half's declared per-site tensors,
:attr:`SiteHalf.loss_state` (anchors, centres, auxiliary gradients), which
the other hooks set and the loss never changes; it calls no ``backward``,
steps no optimiser and registers no hook: the executor differentiates it.
Extra trainable tensors of a half (APFL's alpha, APPLE's relationship
vector) are auxiliary parameters (:meth:`SiteHalf.auxiliary`), which the
executor differentiates with the slot and steps after its optimiser
(:class:`Auxiliary`); further slots trained by the same loss are a plan's
``also_steps``. A proximal term weight/2 ||w - centre||^2 is written once
(:mod:`medfed.federated.strategies.proximal`). A half whose loss cannot be
written so (pFedMe's inner solve, SuPerFed's per-step draw) names the reason
in :attr:`SiteHalf.batchable` and trains one site at a time
(``tests/test_pure_loss.py`` checks the rest under ``torch.func.vmap``).

*Model slots.* A site holds one model per name in ``slots`` (parameters,
buffers and optimiser state together, e.g. Ditto's ``global`` and
``personal``), all initialised from the run's seeded prototype (and adapted
by ``Strategy.prepare_slot``, e.g. given an extra head). A training
plan names the slot it trains; ``evaluated_slot`` is the one evaluated,
saved for ``predict`` and shown in figures (``site.module`` is its module).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from medfed.federated.site_view import ADAPT, DELIVER, SETUP, RoundContext, SiteView
from medfed.models.split import ParameterSplit
from medfed.options.strategies import NoOptions

if TYPE_CHECKING:
    from medfed.models.base import FederatedModule

__all__ = ["ADAPT", "Auxiliary", "DELIVER", "MODEL", "NUM_SAMPLES", "SETUP", "Payload", "RoundContext", "ServerHalf", "SiteHalf", "SiteView", "Strategy", "TrainingPlan"]

#: What crosses the site boundary: named flat tensors.
Payload = dict[str, torch.Tensor]

#: The slot of a strategy that declares no other: the site's one model.
MODEL = "model"


@dataclass(frozen=True)
class TrainingPlan:
    """One stretch of local training in a phase: which model slot, which part of it, for how long.

    The length is ``steps`` optimiser steps if given, else ``epochs`` passes
    over the training split if given, else ``share`` of the trainer's
    ``local_epochs`` (the default: all of them). Epochs are cut at whole
    steps by :meth:`~medfed.federated.site.Site.steps`, after the epochs the
    site's earlier plans of the round took (whatever data order they drew
    from), so plans that split a round's epochs (shares summing to 1) take
    together the steps one plan with all of them would.

    Attributes:
        slot: the model slot trained (one of the strategy's ``slots``).
        part: ``"all"``, ``"shared"`` or ``"personal"``.
        share: fraction of ``trainer.local_epochs`` (> 0), when neither
            ``epochs`` nor ``steps`` is given.
        epochs: passes over the training split (> 0), or None.
        steps: optimiser steps (>= 1), or None.
        name: how the plan's mean loss is labelled in a phase with several
            plans (``train_loss/<phase>/<name>``); default: the slot.
        data_order: where the batches come from. ``None``: the site's shuffled
            data order, which every plan naming no other continues; a name:
            a data order of its own, seeded as the site's is and continued
            only by the plans naming it, so its passes are those a site that
            trained nothing else would draw (Ditto's personal model draws the
            batches a Local run's model draws).
        also_steps: other slots whose optimisers step after ``slot``'s on
            every step, on the gradients the same loss gives their
            parameters (SuPerFed's local model, trained through the mixture).
        data_pass: how many times each step's loss passes its batch forward
            and backward (counted per step): 1 (True), or 2 where the loss runs
            two models on it (APFL: w's loss and the mixture's); 0 (False)
            where the loss's passes are those the half makes through
            :meth:`~medfed.federated.site_view.SiteView.step` (pFedMe: its K
            inner steps per mini-batch; the outer step's loss has no forward pass).
        passes_per_step: where a step passes its batch up to this many times
            (pFedMe's K inner steps): the plan's length counts those passes,
            and its steps are its mini-batches / ``passes_per_step``, rounded
            up; the loop hands the loss the plan with ``pass_budget`` set, so
            that the half can spend exactly that many samples (1: each step
            passes its batch once).
        pass_budget: the plan's length in samples (its epochs x the training
            samples), set by the loop where ``passes_per_step`` > 1 (None
            otherwise; not for a half to set).
    """

    slot: str = MODEL
    part: str = "all"
    share: float = 1.0
    epochs: float | None = None
    steps: int | None = None
    name: str | None = None
    data_order: str | None = None
    also_steps: tuple[str, ...] = ()
    data_pass: int = 1
    passes_per_step: int = 1
    pass_budget: int | None = None

    def __post_init__(self) -> None:
        if self.passes_per_step < 1:
            raise ValueError(f"a training plan passes its batch at least once a step, got {self}")
        if self.share <= 0 or (self.epochs is not None and self.epochs <= 0) or (self.steps is not None and self.steps < 1):
            raise ValueError(f"a training plan needs share > 0, epochs > 0 and steps >= 1 where given, got {self}")
        if self.epochs is not None and self.steps is not None:
            raise ValueError(f"a training plan gives epochs or steps, not both: {self}")

    def epochs_of(self, local_epochs: float) -> float | None:
        """The plan's epochs given the trainer's ``local_epochs`` (None: the plan counts steps)."""
        if self.steps is not None:
            return None
        return self.epochs if self.epochs is not None else local_epochs * self.share

    @property
    def label(self) -> str:
        return self.name or self.slot


class DeclaredState:
    """A half whose checkpointed state is declared, not written out: :attr:`state_fields` names its attributes.

    ``state_dict()`` is ``{field: value}`` for every declared field, in the
    declared order (the checkpoint's layout); ``load_state_dict`` sets them
    back. A value is plain data ``torch.load(weights_only=True)`` reads: a
    tensor (a generator's state is a byte tensor), a number, ``None``, or
    dicts, lists and tuples of them. The half's tensors go in as they are,
    not copied (a half may go on to change them in place, e.g. APPLE's core
    models: save the state, or clone it, before the half runs again); its
    dicts, lists and tuples are copied on the way out and in, so the half and
    a state taken of it never share a container. A loaded state comes through
    :func:`state_on_device` (floats on the run's device, counters and
    generator states on the CPU).

    A half with state that is not plain data (objects, sets) overrides both
    methods; one with scratch that must not outlive a restore (a round's
    pending requests) extends ``load_state_dict``.
    """

    #: the attributes the half must remember across rounds (checkpointed), in checkpoint order
    state_fields: ClassVar[tuple[str, ...]] = ()

    def state_dict(self) -> dict[str, Any]:
        """``{field: value}`` for every one of :attr:`state_fields` (the half's tensors themselves, its containers copied)."""
        return {name: _plain_copy(getattr(self, name)) for name in self.state_fields}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Set every one of :attr:`state_fields` from ``state`` (which holds exactly those keys).

        Raises:
            ValueError: naming the half and the keys, where ``state`` holds other fields than the half declares.
        """
        if set(state) != set(self.state_fields):
            raise ValueError(
                f"{type(self).__name__}: the state holds {sorted(state)}, the half checkpoints {sorted(self.state_fields)}"
            )
        for name in self.state_fields:
            setattr(self, name, _plain_copy(state[name]))


def _plain_copy(value: Any) -> Any:
    """``value`` with its dicts, lists and tuples copied (recursively); tensors and scalars are the same objects."""
    if isinstance(value, dict):
        return {key: _plain_copy(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_plain_copy(item) for item in value)
    return value


class ServerHalf(DeclaredState):
    """The server's half: defaults describe a server that keeps and sends nothing.

    Every round hook gets the :class:`~medfed.federated.site_view.RoundContext`
    it runs in (as Flower's ``Strategy`` gets ``server_round``).

    Args:
        options: the strategy's validated ``Options``.
        split: names and sizes of the model's parts (the server knows the
            architecture, not the weights).
        n_sites: number of sites in the federation.
        seed: the run's seed, for any randomness the server needs.
    """

    def __init__(self, options: Any, split: ParameterSplit, n_sites: int, seed: int) -> None:
        self.options = options
        self.split = split
        self.n_sites = n_sites
        self.seed = seed

    def setup(self, ctx: RoundContext, initial: Payload, replies: dict[int, Payload]) -> None:
        """Called once before round 1 (``ctx`` = round 0, ``"setup"``) with the initial model vectors and the sites' setup payloads.

        ``replies`` holds every site whose setup reply the server accepted
        (:meth:`reply_keys`, :mod:`medfed.federated.faults`); a site missing
        from it is excluded from the run: it never takes part, and is
        delivered to and evaluated like a site that skips every round.
        """

    def message(self, ctx: RoundContext, site_index: int) -> Payload:
        """What the server sends to a participating site before it trains in ``ctx.phase``."""
        return {}

    def aggregate(self, ctx: RoundContext, replies: dict[int, Payload]) -> None:
        """Combine the replies of the sites that took part in ``ctx.phase`` (keys: site indices).

        The dict is the server's to consume: it may pop the replies as it
        reads them, releasing their memory before a large server step.
        """

    def reply_keys(self, ctx: RoundContext, site_index: int) -> tuple[frozenset[str], ...]:
        """The payload keys site ``site_index``'s reply in ``ctx`` holds (setup included): exactly one of these sets.

        The server refuses any other reply (a key missing or extra) before
        :meth:`setup` or :meth:`aggregate` reads it, so they may index the
        declared keys. Called after the phase's :meth:`message` and before
        its :meth:`aggregate`: it may read the server state the message was
        made from. Several sets where the site chooses (IFCA: the keys of the
        cluster it trained). Default: an empty reply, as the default site half sends.
        """
        return (frozenset(),)

    def reply_fault(self, ctx: RoundContext, site_index: int, reply: Payload) -> str | None:
        """Why a reply with the declared keys is still refused, or None: a value the server reads as an
        index or a choice that is not one (IFCA's cluster index, and the cluster whose keys it sent).

        Called on each reply that passed :meth:`reply_keys`, before :meth:`setup` or :meth:`aggregate`
        reads it; the values are finite (the link refuses others). Default: nothing to refuse.
        """
        return None

    def deliver(self, ctx: RoundContext, site_index: int) -> Payload:
        """What a site receives at the end of round ``ctx.round`` (0: before round 1), to be evaluated with."""
        return {}

    def metrics(self) -> dict[str, float]:
        """Diagnostics of the last server step, logged each round (e.g. ADMM iterations)."""
        return {}

    def figures(self) -> dict[str, Any]:
        """Figures of the server's state to save with the run (``{file stem: matplotlib Figure}``)."""
        return {}


@dataclass(frozen=True)
class Auxiliary:
    """How an auxiliary parameter of a site half (a trainable tensor outside the model slots) is stepped.

    The executor differentiates the step's loss in the half's attribute too and,
    after the slot's optimiser stepped, sets it to ``project(a - learning_rate * grad)``
    (plain projected gradient descent; ``project`` None: none).

    Attributes:
        learning_rate: the step size (> 0).
        project: maps the stepped tensor back onto its feasible set (APFL's alpha: [0, 1]), or None.
    """

    learning_rate: float
    project: Callable[[torch.Tensor], torch.Tensor] | None = None

    def step(self, value: torch.Tensor, gradient: torch.Tensor) -> torch.Tensor:
        """``project(value - learning_rate * gradient)``, a new tensor (no gradient history; ``value``'s shape and dtype).

        Every executor steps an auxiliary parameter through this, so its update is written once.
        """
        with torch.no_grad():
            stepped = value - self.learning_rate * gradient
            return stepped if self.project is None else self.project(stepped)


class SiteHalf(DeclaredState):
    """One site's half: defaults describe local training of the site's one model with nothing exchanged.

    Per-site state lives on the instance (one instance per site) and is
    checkpointed as its :attr:`~DeclaredState.state_fields` declare; the site's models live in its
    slots (``site.module(name)``, ``site.get(name, part)``). Every hook gets
    the site's :class:`~medfed.federated.site_view.SiteView` and the
    :class:`~medfed.federated.site_view.RoundContext` it is called in.

    Args:
        options, split, n_sites, seed: as for :class:`ServerHalf`.
        index: the site this half runs at.
    """

    #: the attributes (tensors, or None) :meth:`loss` reads besides the slots, the batch, ``ctx``, ``plan`` and the
    #: options: the half's declared per-site loss state (anchors, centres, auxiliary gradients, auxiliary
    #: parameters), set by its other hooks and never by ``loss``; a batched executor stacks them across sites
    loss_state: ClassVar[tuple[str, ...]] = ()
    #: None where :meth:`loss` is a pure function of the declared state (it can run under ``torch.func.vmap``
    #: over sites), else the one-line reason it cannot (the site then trains sequentially)
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
        """The auxiliary parameters ``plan``'s steps train, ``{attribute: Auxiliary}`` (each also in :attr:`loss_state`); default none."""
        return {}

    def setup(self, site: SiteView, ctx: RoundContext) -> Payload:
        """Sent once before training, in round 0's ``"setup"`` context (e.g. a data sketch that reveals no sample)."""
        return {}

    def receive(self, site: SiteView, ctx: RoundContext, payload: Payload) -> None:
        """Load what the server sent into the site's slots (``ctx.phase`` ``"deliver"`` included)."""

    def plan(self, ctx: RoundContext) -> tuple[TrainingPlan, ...]:
        """The local training of ``ctx.phase``, in order (empty: the phase trains nothing)."""
        return (TrainingPlan(),)

    def loss(self, site: SiteView, ctx: RoundContext, plan: TrainingPlan, batch: Any) -> torch.Tensor:
        """The loss of one local step of ``plan``: the slot's own training loss plus :meth:`regularizer`.

        A pure function of the slots' parameters and buffers (read through ``site.module``), ``batch``,
        ``ctx``, ``plan``, the options and the attributes :attr:`loss_state` declares: no backward pass,
        optimiser step, gradient hook or change to any attribute in here (the executor differentiates it).
        """
        loss = site.module(plan.slot).training_step(batch, 0)
        regularizer = self.regularizer(site, ctx, plan)
        return loss if regularizer is None else loss + regularizer

    def regularizer(self, site: SiteView, ctx: RoundContext, plan: TrainingPlan) -> torch.Tensor | None:
        """A term added to every local step's loss (e.g. a proximal term), or ``None``."""
        return None

    def reply(self, site: SiteView, ctx: RoundContext) -> Payload:
        """What the site sends back after training in ``ctx.phase``."""
        return {}

    def adapt(self, ctx: RoundContext) -> tuple[TrainingPlan, ...]:
        """The adapt step: plans trained after the round's delivery, before every evaluation (``ctx.phase`` ``"adapt"``).

        Run at every site, participant or not, as the loop runs training
        (each step's loss is :meth:`loss` with this ``ctx``), with the site's
        global generators seeded from its own stream of the round; each plan
        gives ``epochs`` or ``steps`` and should draw from a ``data_order`` of
        its own, so adapting leaves the training batches alone. A step that
        raises puts the plans' slots back to what the delivery left and
        counts as the site failing the round; it is then evaluated unadapted.
        Default: none.
        """
        return ()


class Strategy:
    """A registered algorithm: its name, options, round shape and halves.

    Subclasses set the class attributes; an instance wires the halves for
    one run (``strategy.server`` and ``strategy.site_half(i)``).

    Args:
        options: the validated ``Options`` instance.
        split: the model's parts.
        n_sites: number of sites.
        seed: the run's seed.
    """

    name: ClassVar[str]
    #: one line for ``python -m medfed strategies`` and the README's list
    summary: ClassVar[str]
    #: the paper the implementation follows
    reference: ClassVar[str] = ""
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
    #: the part of the model in ``delivered_slot`` the server's delivery sets at the end of every round
    #: (None: the delivery never replaces any part of the evaluated model, so a site that skips a round keeps it)
    delivered: ClassVar[str | None] = None
    #: the slot the delivery sets (None: the evaluated slot); another one where the evaluated model is
    #: derived from the delivered one (APFL evaluates a mixture of its own model and the delivered global one)
    delivered_slot: ClassVar[str | None] = None
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
    Server: ClassVar[type[ServerHalf]] = ServerHalf
    Site: ClassVar[type[SiteHalf]] = SiteHalf

    #: the ``strategy.<name>`` group's dataclass, declared in the torch-free :mod:`medfed.options.strategies`
    Options: ClassVar[type] = NoOptions

    def __init__(self, options: Any, split: ParameterSplit, n_sites: int, seed: int) -> None:
        self.options = options
        self.split = split
        self.n_sites = n_sites
        self.seed = seed
        self.server = self.Server(options, split, n_sites, seed)

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


def state_on_device(state: Any, device: torch.device) -> Any:
    """``state`` (nested dicts, lists, tuples) with every floating-point tensor moved to ``device``.

    A checkpoint is read onto the CPU; a half's state goes through this before
    its ``load_state_dict``, so a resumed run on cuda computes with its
    models, duals and mixing weights where a fresh run has them. Integer and
    byte tensors (counters, generator states, indices) stay where they are:
    medfed keeps those on the CPU on purpose.
    """
    if isinstance(state, torch.Tensor):
        return state.to(device) if state.is_floating_point() else state
    if isinstance(state, dict):
        return {key: state_on_device(value, device) for key, value in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(state_on_device(value, device) for value in state)
    return state


#: The payload key under which a site reports its training-set size (one value: :func:`num_samples`).
NUM_SAMPLES = "num_samples"


def num_samples(site: SiteView) -> torch.Tensor:
    """The site's training-set size as a payload entry, under :data:`NUM_SAMPLES` (for sample-weighted averaging)."""
    return torch.tensor([float(site.n_train)], device="cpu")  # one number; the link carries it to the server's device
