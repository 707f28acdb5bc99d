"""The contract between the framework and a federated algorithm: every type a strategy author writes against.

A strategy is three classes (the defaults: :mod:`medfed.federated.strategies.base`):

* a :class:`StrategyProtocol`, its registry entry: the phases of a round,
  which message keys carry model vectors (``coded_keys``), the model slots a
  site holds and the one it is evaluated with, what privacy mechanisms it
  admits, and its two halves;
* a :class:`ServerHalfProtocol`: the server's state and steps; it sees only
  the payloads sites send;
* a :class:`SiteHalfProtocol`, one per site: the site's own state and local
  work; it sees its site through a :class:`SiteView` (model slots, sample
  counts, step and full-pass helpers, seeded random streams), the payloads
  the server sends, and in every hook a :class:`RoundContext` (round, phase).

The halves share the options and nothing else; every :data:`Payload`
crosses a :class:`~medfed.federated.link.Link`, which encodes it to real
bytes, so the rule "the server sees only what sites send" holds by
construction, and the same halves run in one process (the simulator) or on
different machines (:mod:`medfed.deploy`). The framework (loop, sites,
links, faults, privacy) imports this module and never the algorithms.

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
        for every site i: site_i.deliver(view_i, deliver, server.deliver(deliver, i))
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
deliver nothing.

*The compute budget.* ``trainer.local_epochs`` = E is the budget of
training passes per site and round, in epochs of the site's training split
(E = 0.5: half a pass), the same for every strategy: the forward and
backward passes of its training plans, counted as ``train/*`` in the round
record's ``compute`` (:mod:`medfed.federated.compute`), sum to E epochs,
cut at whole mini-batches (the round's plans are cut along one axis, so
together they are within a mini-batch of E epochs; APFL's steps of two
passes within two). A strategy states in its docstring how its plans split
E (:attr:`TrainingPlan.share`): FedRep's head and body 2/3 + 1/3, Ditto's
global and personal models 1/2 + 1/2, pFedNet's shared and personal phases
1/2 + 1/2 (all of it to the personal phase where the shared part is empty),
APFL's steps (two passes each: w's and v_bar's) 1/2, pFedMe's passes all
of it (:attr:`TrainingPlan.passes_per_step` = K: about E B / K local rounds of K
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

*The local objective.* A step's loss (:meth:`SiteHalfProtocol.loss`) is a
pure function of the slots' parameters and buffers (read through
``site.module``), the batch, ``ctx``, the plan, the options and the half's
declared per-site tensors, :attr:`SiteHalfProtocol.loss_state` (anchors,
centres, auxiliary gradients), which the other hooks set and the loss never
changes; it calls no ``backward``, steps no optimiser and registers no hook:
the executor differentiates it. Extra trainable tensors of a half (APFL's
alpha, APPLE's relationship vector) are auxiliary parameters
(:meth:`SiteHalfProtocol.auxiliary`), which the executor differentiates with
the slot and steps after its optimiser (:class:`Auxiliary`); further slots
trained by the same loss are a plan's ``also_steps``. A half whose loss
cannot be written so (pFedMe's inner solve, SuPerFed's per-step draw) names
the reason in :attr:`SiteHalfProtocol.batchable` and trains one site at a
time (``tests/test_pure_loss.py`` checks the rest under ``torch.func.vmap``).

*Model slots.* A site holds one model per name in ``slots`` (parameters,
buffers and optimiser state together, e.g. Ditto's ``global`` and
``personal``), all initialised from the run's seeded prototype (and adapted
by ``prepare_slot``, e.g. given an extra head). A training plan names the
slot it trains; ``evaluated_slot`` is the one evaluated, saved for
``predict`` and shown in figures (``site.module`` is its module).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import torch

from medfed.data.federation import SiteData
from medfed.models.base import FederatedModule

#: What crosses the site boundary: named flat tensors.
Payload = dict[str, torch.Tensor]

#: the phase of a site half's ``setup`` (before round 1)
SETUP = "setup"
#: the phase of the end-of-round delivery (and of round 0's first one)
DELIVER = "deliver"
#: the phase of the adapt step, after the delivery and before the round's evaluation
ADAPT = "adapt"

#: The slot of a strategy that declares no other: the site's one model.
MODEL = "model"

#: The payload key under which a site reports its training-set size (one value: :func:`num_samples`).
NUM_SAMPLES = "num_samples"

#: The key under which :meth:`ServerHalfProtocol.aggregate_summed` hands its one summed reply to ``aggregate`` (no site's index).
SUMMED = -1


@dataclass(frozen=True)
class RoundContext:
    """The round and the phase a hook is called in (Flower's ``Strategy`` passes ``server_round`` the same way).

    Attributes:
        round: 1-based round index; 0 before round 1 (``setup`` and the first delivery).
        phase: one of the strategy's ``phases``, or :data:`SETUP` / :data:`DELIVER` / :data:`ADAPT`.
    """

    round: int
    phase: str


class SiteView(Protocol):
    """One site as its strategy half sees it: never the site itself, its loaders, optimisers or Fabric.

    It offers exactly what an algorithm's local work needs: the model slots
    (a slot's module, for its forward pass and the live parameters of a loss
    term, and get/set of its parts as flat vectors,
    :data:`~medfed.models.split.PARTS`); the sample counts and the site's own
    data splits (sketches, class counts); :meth:`step`, one optimiser step of a
    slot on a loss the half computed (pFedMe's inner steps, which is why pFedMe
    is not batchable); :meth:`full_pass`, the batches of a whole split in a
    fixed order (PGFed's gradient estimate, IFCA's cluster losses); and
    :meth:`global_rng`, the site's seeded random streams. Every forward and
    backward pass the helpers make is counted (samples, in epochs of the site's
    training split, :mod:`medfed.federated.compute`; from batch shapes only).

    Attributes:
        index: the site's 0-based position in the federation.
        name: its name (``site0``, ...).
        n_train: training samples (the unit of compute: one epoch).
        n_test: samples of the evaluated split.
        batch_size: mini-batch size of local training.
        eval_batch_size: batch size of evaluation passes (no gradients).
        data: the site's own splits (``train``, ``test``, ``validation``).
    """

    index: int
    name: str
    data: SiteData

    @property
    def n_train(self) -> int: ...

    @property
    def n_test(self) -> int: ...

    @property
    def batch_size(self) -> int: ...

    @property
    def eval_batch_size(self) -> int: ...

    def module(self, slot: str) -> FederatedModule:
        """The module of model slot ``slot`` (Fabric-wrapped; forward, ``training_step``, live parameters)."""
        ...

    def get(self, slot: str, part: str) -> torch.Tensor:
        """``part`` of ``slot``'s model as a detached flat vector (``get_vector``)."""
        ...

    def set(self, slot: str, part: str, vector: torch.Tensor) -> None:
        """Load ``vector`` into ``part`` of ``slot``'s model (``set_vector``)."""
        ...

    def learning_rate(self, slot: str) -> float:
        """The learning rate of ``slot``'s optimiser (its first parameter group)."""
        ...

    def step(
        self,
        slot: str,
        loss: torch.Tensor,
        batch: Any,
        optimizer: torch.optim.Optimizer | None = None,
        stop_if: Callable[[], bool] | None = None,
    ) -> bool:
        """One optimiser step on ``loss``, a loss of ``batch`` computed by the half; counted as a pass of its samples.

        Frees ``slot``'s gradients, back-propagates ``loss`` (every tensor it
        depends on gets its gradient, e.g. a mixing weight), steps the
        optimiser and frees the gradients again.

        Args:
            slot: whose optimiser steps.
            loss: a scalar.
            batch: the device batch ``loss`` was computed on (its size is counted).
            optimizer: a half's own optimiser over the slot's parameters
                instead of the slot's (pFedMe's plain inner steps).
            stop_if: called after the backward pass: True skips the step
                (pFedMe's tolerance on the gradient norm).

        Returns:
            Whether the optimiser stepped.
        """
        ...

    def full_pass(
        self, split: str, name: str, backward: bool, batch_size: int | None = None
    ) -> Iterator[tuple[Any, int]]:
        """The device batches of a whole split, in order, each with its number of samples.

        The order is fixed (no shuffling), and neither the site's data order
        nor torch's global generator moves. Counted as ``aux/<name>``
        (forward and backward passes, ``backward``) or ``forward/<name>``.

        Args:
            split: ``"train"``, ``"test"`` or ``"validation"``.
            name: what the pass is for (its compute label).
            backward: whether the caller back-propagates each batch's loss.
            batch_size: None: the training batch size.
        """
        ...

    def global_rng(self, *stream: int) -> AbstractContextManager[None]:
        """Torch's, NumPy's and Python's global generators seeded from (run seed, site, ``*stream``) inside the block.

        The loop runs every phase of round r in stream ``(r, phase index)``;
        other streams (e.g. ``(0,)``, SuPerFed's local initialisation) are
        the half's to name.
        """
        ...


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
            :meth:`SiteView.step` (pFedMe: its K inner steps per mini-batch;
            the outer step's loss has no forward pass).
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


@dataclass(frozen=True)
class SecureSum:
    """A phase whose replies the server half needs only summed, so that secure aggregation can hide each one.

    Every vector of the phase's reply is multiplied by the reply's ``weight``
    entry (one count, such as :data:`NUM_SAMPLES`; None: 1 per site) and
    summed over the sites, and the weights are summed too; the server half
    receives one reply holding ``sum_i w_i x_i / sum_i w_i`` under each vector
    key and ``sum_i w_i`` under ``weight`` (:meth:`ServerHalfProtocol.aggregate_summed`).

    Attributes:
        weight: the reply key of the site's weight w_i, or None (unweighted).
    """

    weight: str | None = NUM_SAMPLES


def num_samples(site: SiteView) -> torch.Tensor:
    """The site's training-set size as a payload entry, under :data:`NUM_SAMPLES` (for sample-weighted averaging)."""
    return torch.tensor([float(site.n_train)], device="cpu")  # one number; the link carries it to the server's device


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
    :func:`~medfed.checkpoint.state_on_device` (floats on the run's device,
    counters and generator states on the CPU).

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


class ServerHalfProtocol(Protocol):
    """The server's half as the loop calls it; every round hook gets the :class:`RoundContext` it runs in.

    Its state is checkpointed through ``state_dict`` / ``load_state_dict`` (:class:`DeclaredState`).
    """

    def setup(self, ctx: RoundContext, initial: Payload, replies: dict[int, Payload]) -> None:
        """Called once before round 1 (``ctx`` = round 0, ``"setup"``) with the initial model vectors and the sites' setup payloads.

        ``replies`` holds every site whose setup reply the server accepted
        (:meth:`reply_keys`, :mod:`medfed.federated.faults`); a site missing
        from it is excluded from the run: it never takes part, and is
        delivered to and evaluated like a site that skips every round.
        """
        ...

    def message(self, ctx: RoundContext, site_index: int) -> Payload:
        """What the server sends to a participating site before it trains in ``ctx.phase``."""
        ...

    def aggregate(self, ctx: RoundContext, replies: dict[int, Payload]) -> None:
        """Combine the replies of the sites that took part in ``ctx.phase`` (keys: site indices).

        The dict is the server's to consume: it may pop the replies as it
        reads them, releasing their memory before a large server step.
        """
        ...

    def aggregate_summed(self, ctx: RoundContext, summed: Payload) -> None:
        """Combine a phase's replies that the server holds only as their sum (secure aggregation, ``Strategy.secure_sums``).

        ``summed`` stands for the replies of every site that came through:
        under each vector key their weighted mean ``sum_i w_i x_i / sum_i w_i``
        and under the :class:`SecureSum`'s weight key the total ``sum_i w_i``.
        """
        ...

    def reply_keys(self, ctx: RoundContext, site_index: int) -> tuple[frozenset[str], ...]:
        """The payload keys site ``site_index``'s reply in ``ctx`` holds (setup included): exactly one of these sets.

        The server refuses any other reply (a key missing or extra) before
        :meth:`setup` or :meth:`aggregate` reads it, so they may index the
        declared keys. Called after the phase's :meth:`message` and before
        its :meth:`aggregate`: it may read the server state the message was
        made from. Several sets where the site chooses (IFCA: the keys of the
        cluster it trained).
        """
        ...

    def reply_fault(self, ctx: RoundContext, site_index: int, reply: Payload) -> str | None:
        """Why a reply with the declared keys is still refused, or None: a value the server reads as an
        index or a choice that is not one (IFCA's cluster index, and the cluster whose keys it sent).

        Called on each reply that passed :meth:`reply_keys`, before :meth:`setup` or :meth:`aggregate`
        reads it; the values are finite (the link refuses others).
        """
        ...

    def deliver(self, ctx: RoundContext, site_index: int) -> Payload:
        """What a site receives at the end of round ``ctx.round`` (0: before round 1), to be evaluated with."""
        ...

    def metrics(self) -> dict[str, float]:
        """Diagnostics of the last server step, logged each round (e.g. ADMM iterations)."""
        ...

    def figures(self) -> dict[str, Any]:
        """Figures of the server's state to save with the run (``{file stem: matplotlib Figure}``)."""
        ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class SiteHalfProtocol(Protocol):
    """One site's half as its site calls it; every hook gets the site's :class:`SiteView` and the :class:`RoundContext`.

    Per-site state lives on the half (one per site) and is checkpointed with
    the site through ``state_dict`` / ``load_state_dict`` (:class:`DeclaredState`);
    the site's models live in its slots (``site.module(name)``, ``site.get(name, part)``).
    """

    #: the attributes (tensors, or None) :meth:`loss` reads besides the slots, the batch, ``ctx``, ``plan`` and the
    #: options: the half's declared per-site loss state (anchors, centres, auxiliary gradients, auxiliary
    #: parameters), set by its other hooks and never by ``loss``; a batched executor stacks them across sites
    loss_state: ClassVar[tuple[str, ...]]
    #: None where :meth:`loss` is a pure function of the declared state (it can run under ``torch.func.vmap``
    #: over sites), else the one-line reason it cannot (the site then trains sequentially)
    batchable: ClassVar[str | None]

    def setup(self, site: SiteView, ctx: RoundContext) -> Payload:
        """Sent once before training, in round 0's ``"setup"`` context (e.g. a data sketch that reveals no sample)."""
        ...

    def receive(self, site: SiteView, ctx: RoundContext, payload: Payload) -> None:
        """Take the server's message of ``ctx.phase`` (a participant, before it plans and trains): load it into
        the site's slots, set the loss state it carries."""
        ...

    def deliver(self, site: SiteView, ctx: RoundContext, payload: Payload) -> None:
        """Take the server's delivery at the end of round ``ctx.round`` (0: before round 1; ``ctx.phase``
        ``"deliver"``), participant or not: what the site is evaluated with (and adapts, and trains from next)."""
        ...

    def plan(self, ctx: RoundContext) -> tuple[TrainingPlan, ...]:
        """The local training of ``ctx.phase``, in order (empty: the phase trains nothing)."""
        ...

    def auxiliary(self, ctx: RoundContext, plan: TrainingPlan) -> dict[str, Auxiliary]:
        """The auxiliary parameters ``plan``'s steps train, ``{attribute: Auxiliary}`` (each also in :attr:`loss_state`)."""
        ...

    def loss(self, site: SiteView, ctx: RoundContext, plan: TrainingPlan, batch: Any) -> torch.Tensor:
        """The loss of one local step of ``plan``.

        A pure function of the slots' parameters and buffers (read through ``site.module``), ``batch``,
        ``ctx``, ``plan``, the options and the attributes :attr:`loss_state` declares: no backward pass,
        optimiser step, gradient hook or change to any attribute in here (the executor differentiates it).
        """
        ...

    def reply(self, site: SiteView, ctx: RoundContext) -> Payload:
        """What the site sends back after training in ``ctx.phase``."""
        ...

    def adapt(self, ctx: RoundContext) -> tuple[TrainingPlan, ...]:
        """The adapt step: plans trained after the round's delivery, before every evaluation (``ctx.phase`` ``"adapt"``).

        Run at every site, participant or not, as the loop runs training
        (each step's loss is :meth:`loss` with this ``ctx``), with the site's
        global generators seeded from its own stream of the round; each plan
        gives ``epochs`` or ``steps`` and should draw from a ``data_order`` of
        its own, so adapting leaves the training batches alone. A step that
        raises puts the plans' slots back to what the delivery left and
        counts as the site failing the round; it is then evaluated unadapted.
        """
        ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class StrategyProtocol(Protocol):
    """A registered algorithm as the framework uses it: its round shape, its wire and slots, and its halves.

    An instance wires the halves for one run: ``strategy.server`` and ``strategy.site_half(i)``.
    """

    name: ClassVar[str]
    phases: ClassVar[tuple[str, ...]]
    #: payload keys carrying model-sized vectors, the only ones a codec compresses, mapped to the initial vector
    #: their first message is coded against ("zeros" for gradients); "key/..." matches the prefix "key"
    coded_keys: ClassVar[dict[str, str]]
    #: the model slots every site holds, and the one each site is evaluated with
    slots: ClassVar[tuple[str, ...]]
    evaluated_slot: ClassVar[str]
    #: the pooled (centralised) reference only: the run gives one site the union of every site's training data
    pools_data: ClassVar[bool]
    #: privacy compatibility (``docs/privacy.md``): None where the mechanism fits the strategy, else why not
    dp_sgd_refusal: ClassVar[str | None]
    client_dp_refusal: ClassVar[str | None]
    secure_aggregation_refusal: ClassVar[str | None]
    #: the phases whose replies the server half needs only as a weighted sum, ``{phase: SecureSum}``
    secure_sums: ClassVar[dict[str, SecureSum]]
    server: ServerHalfProtocol

    def site_half(self, index: int) -> SiteHalfProtocol:
        """The half that runs at site ``index``."""
        ...

    def initial_values(self, model: Payload) -> Payload:
        """The vectors both ends of every link hold before any message (from the initial model's parts)."""
        ...

    @classmethod
    def prepare_slot(cls, slot: str, module: FederatedModule) -> None:
        """Adapt ``slot``'s fresh copy of the seeded prototype, before its optimiser is made."""
        ...

    @classmethod
    def dp_sgd_refused(cls, options: Any) -> str | None:
        """Why DP-SGD cannot run with ``options`` (None: it can)."""
        ...
