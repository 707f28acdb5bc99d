"""Secure aggregation in a deployment: a phase's replies reach the server only as their sum, with Flower's SecAgg+.

With ``deploy.secure_aggregation: true`` every phase a strategy declares in
``secure_sums`` (:class:`~medfed.federated.protocol.SecureSum`:
FedAvg's fit reply, its model vectors weighted by its sample count) runs as
one round of Flower's SecAgg+ (:class:`flwr.server.workflow.SecAggPlusWorkflow`
on the server, :func:`flwr.client.mod.secaggplus_mod` in medfed's ClientApp):

1. *setup* and *share keys*: each site makes two key pairs; its secrets are
   split into ``num_shares`` Shamir shares, encrypted for its neighbours
   (the server relays ciphertexts it cannot read);
2. *collect masked vectors*: the server's medfed request rides with the
   forwarded shares; the site trains (:mod:`medfed.deploy.worker`) and hands
   Flower its reply's vectors x_i and its weight n_i. SecAgg+ multiplies
   x_i by n_i / max_weight (max_weight: the largest training-set size the
   participants declared when they joined), clips every entry to
   [-``clipping_range``, ``clipping_range``], quantises it to
   ``quantization_range`` levels (stochastic rounding, the site's numpy
   generator seeded from the run's seed, the site, the round and the phase),
   prepends the quantised weight and adds a private mask and one pairwise
   mask per neighbour (mod ``modulus_range``). The server receives only
   those masked integers and the site's plain fields (training losses,
   compute, time; its sample count n_i, which it declared when it joined);
3. *unmask*: the surviving sites send the shares the server needs to remove
   the masks of the sum; the server obtains sum_i q(n_i/max x_i) and
   sum_i q(n_i/max), and Flower hands it their ratio, the weighted mean.

:class:`FlowerSecAgg` runs those four stages for one phase; the server half
then receives one reply, the weighted mean under each vector key and the
total weight (:meth:`~medfed.federated.strategies.base.ServerHalf.aggregate_summed`),
never a site's own vector.

*Sites that drop out* (an error, no reply within ``reply-timeout-s``) are
what SecAgg+'s threshold is for. One that drops before its masked vector came
(setup, share keys, or its work failed: a site refuses to send a vector that
is not finite or that SecAgg+ would clip) is not in the sum: the server
rebuilds and removes the pairwise masks its neighbours added for it from
``reconstruction_threshold`` of their shares. One that drops after (unmask)
is in the sum; its own private mask is rebuilt from its neighbours' shares.
Either way the round goes on if every participant still has at least
``reconstruction_threshold`` answering neighbours (and at least 2 sites
sent a vector); otherwise SecAgg+ halts, nothing is aggregated and every
participant fails the phase (the server keeps its model; the sites are put
back to the round's start).

*A hostile site is a dropout.* At the collect stage, before any vector is
added, the server checks each reply's clear parts: its plain fields (one
JSON text, its own site index), its plain weight (a whole number, at most
the training-set size the site declared when it joined; 1 where the phase
is unweighted), the vector keys it declared (one of the key sets the server
half expects, :meth:`~medfed.federated.strategies.base.ServerHalf.reply_keys`),
each declared shape (the flat size of the model vector the server knows
for that key) and the shapes of the masked arrays themselves (read from
their headers: the weight's one entry, then the declared shapes). A reply
that fails is treated as if it had never come: the site is left out of the
sum as a dropout, its pairwise masks are rebuilt from its neighbours'
shares and removed, the others' round completes, and the site fails the
phase with the reason (:meth:`FlowerSecAgg.run`'s ``screen``). (The server
then learns the refused site's mask key, never its vector, which it drops.)

What the server can no longer check (it never sees one vector): the update
norms (``federation.update_norm_limit`` does not apply to a summed phase,
nor does a robust ``aggregation``) and whether the weight inside a site's
masked vector is the count it sent in plain; SecAgg+'s clipping bounds every
weighted entry a site adds to [-clipping_range, clipping_range].
"""

from __future__ import annotations

import io
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.common import Code, FitIns, FitRes, Parameters, Status, ndarrays_to_parameters, parameters_to_ndarrays
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS
from flwr.common.secure_aggregation.secaggplus_constants import Key as SecAggKey
from flwr.compat.common.recorddict_compat import fitres_to_recorddict, recorddict_to_fitres
from flwr.server.client_manager import ClientManager
from flwr.server.client_proxy import ClientProxy
from flwr.server.compat.grid_client_proxy import GridClientProxy
from flwr.server.compat.legacy_context import LegacyContext
from flwr.server.strategy import Strategy as FlowerStrategy
from flwr.server.workflow import SecAggPlusWorkflow
from flwr.server.workflow.constant import MAIN_CONFIGS_RECORD, MAIN_PARAMS_RECORD
from flwr.server.workflow.constant import Key as WorkflowKey
from flwr.serverapp import Grid

from medfed.config import DeployConfig
from medfed.deploy.records import MAX_JSON_CHARS, STYPE, expect
from medfed.errors import ConfigError, MessageError

if TYPE_CHECKING:
    from medfed.components import ResolvedRun

STAGES = ("setup", "share keys", "collect masked vectors", "unmask")
"""SecAgg+'s stages, in the order the server runs them (one round trip each)."""
FIT_CONFIG = "fitins.config"
"""The record of a SecAgg+ work message that carries medfed's request (Flower's FitIns config)."""
WIRE_PREFIX = "wire:"
"""The config keys of the request's codec streams: ``wire:<wire index>:<payload key>``."""
COLLECT = STAGES.index("collect masked vectors")

Screen = Callable[[int, dict[str, Any]], "str | None"]
"""The server's own check of a site's plain reply at the collect stage (site index, :func:`_plain_reply`'s fields):
why the site is refused, or None."""


def refuse_secure_aggregation(resolved: ResolvedRun) -> None:
    """Refuse a run asking for secure aggregation that it cannot have, before any site is contacted.

    Raises:
        ConfigError: one line naming the key: a robust ``aggregation`` (its rule
            reads each site's own vector), a strategy whose server step
            needs each site's own vector (its ``secure_aggregation_refusal``),
            a compressing ``codec.up`` (SecAgg+ masks dense vectors), or a
            federation too small or too large for SecAgg+'s settings.
    """
    run = resolved.run
    deploy = run.deploy
    if not deploy.secure_aggregation:
        return
    strategy = resolved.strategy_cls
    if run.aggregation.name != "mean":
        raise ConfigError(
            f"config key 'aggregation.name' = {run.aggregation.name!r}: a robust rule needs each site's own reply, which "
            "secure aggregation hides (the server sees only their sum); use aggregation.name=mean, or deploy.secure_aggregation=false"
        )
    if strategy.secure_aggregation_refusal is not None:
        raise ConfigError(
            f"config key 'deploy.secure_aggregation': strategy {strategy.name!r} cannot be securely aggregated: "
            f"{strategy.secure_aggregation_refusal} (secure aggregation shows the server only a sum; docs/privacy.md)"
        )
    if run.codec.up != "dense":
        raise ConfigError(
            f"config key 'codec.up' = {run.codec.up!r}: secure aggregation masks dense vectors (SecAgg+ adds a mask to "
            "every entry), which a sparse or change-coded stream is not; use codec.up=dense (codec.down may be any codec)"
        )
    n_sites = run.federation.n_sites
    participants = max(1, math.ceil(run.federation.participation * n_sites - 1e-9))
    if participants < 2:
        raise ConfigError(
            f"config key 'deploy.secure_aggregation': {participants} site(s) take part in a round "
            f"(federation.n_sites = {n_sites}, participation = {run.federation.participation:g}); a sum hides a site "
            "only among at least 2"
        )
    if n_sites * deploy.quantization_range > deploy.modulus_range:
        raise ConfigError(
            f"config key 'deploy.quantization_range' = {deploy.quantization_range}: the sum of {n_sites} sites' quantised "
            f"entries could pass deploy.modulus_range = {deploy.modulus_range} (expected n_sites x quantization_range "
            "<= modulus_range)"
        )


def fit_config(record: RecordDict) -> dict[str, str | bytes]:
    """A medfed message (:func:`~medfed.deploy.records.to_record`'s record) as the flat config of a Flower FitIns."""
    config: dict[str, str | bytes] = {"json": record["fields"]["json"]}
    config.update({WIRE_PREFIX + name: array.data for name, array in record["wire"].items()})
    return config


def from_fit_config(config: ConfigRecord) -> RecordDict:
    """The inverse of :func:`fit_config`: the record :func:`~medfed.deploy.records.from_record` reads (and checks).

    Raises:
        MessageError: a config entry that is neither the JSON text nor a codec stream.
    """
    if not isinstance(config.get("json"), str):
        raise MessageError("secure aggregation request: no JSON text of fields")
    arrays = {}
    for key, value in config.items():
        if key == "json":
            continue
        if not key.startswith(WIRE_PREFIX) or not isinstance(value, bytes):
            raise MessageError(f"secure aggregation request: unexpected entry {key[:80]!r}")
        arrays[key[len(WIRE_PREFIX):]] = Array(dtype="uint8", shape=(len(value),), stype=STYPE, data=value)
    return RecordDict({"fields": ConfigRecord({"json": config.get("json")}), "wire": ArrayRecord(arrays)})


def fit_reply(message: Message, site_index: int, fields: dict[str, Any], vectors: dict[str, Any], weight: int) -> Message:
    """A site's reply to a securely aggregated phase, as SecAgg+'s client mod takes it: a FitRes of the vectors
    (key order), the weight as its example count and the plain fields as one JSON metric."""
    keys = sorted(vectors)
    plain = {"site_index": site_index, "reply": fields, "keys": keys, "shapes": [list(vectors[key].shape) for key in keys]}
    fitres = FitRes(
        status=Status(Code.OK, ""),
        parameters=ndarrays_to_parameters([vectors[key].numpy() for key in keys]),
        num_examples=weight,
        metrics={"json": json.dumps(plain)},
    )
    return Message(fitres_to_recorddict(fitres, keep_input=False), reply_to=message)


@dataclass
class SecureOutcome:
    """What one securely aggregated phase left the server with.

    Attributes:
        plain: per site whose masked vector is in the sum, its plain reply
            (fields, the vector keys and shapes it declared, its weight) and the
            bytes it sent in SecAgg+'s records (``secagg_bytes``).
        dropped: per site that is not in the sum, why (the stage it dropped
            out in and the reason; a reply refused at the collect stage is a dropout).
        mean: the unmasked weighted mean of the vectors, in the sites' key
            order, or None where SecAgg+ halted (too few sites answered).
        weight: the total weight of the sum (the plain weights of the sites in it).
        in_sum: the sites whose masked vectors are in the sum.
    """

    plain: dict[int, dict[str, Any]] = field(default_factory=dict)
    dropped: dict[int, str] = field(default_factory=dict)
    mean: list[np.ndarray] | None = None
    weight: float = 0.0
    in_sum: list[int] = field(default_factory=list)


class _StageLog:
    """The Grid as SecAgg+ uses it (``send_and_receive``), noting for each stage who was asked and who answered how.

    It waits for the replies as Flower's ``send_and_receive`` does, but looks
    every ``poll_s`` (the ServerApp's :data:`~medfed.deploy.server_app.POLL_S`)
    where Flower's looks every 3 s: each of SecAgg+'s four stages is a round trip.
    """

    def __init__(self, grid: Grid, poll_s: float, screen: Callable[[int, Message], "str | None"]) -> None:
        self.grid = grid
        self.poll_s = poll_s
        self.screen = screen
        self.asked: list[set[int]] = []
        self.answers: list[dict[int, Message]] = []
        self.refused: dict[int, str] = {}

    def send_and_receive(self, messages: Any, *, timeout: float | None = None) -> list[Message]:
        """The replies to ``messages``; at the collect stage only those ``screen`` passes (the others are dropouts)."""
        messages = list(messages)
        self.asked.append({message.metadata.dst_node_id for message in messages})
        waiting = set(self.grid.push_messages(messages))
        deadline = math.inf if timeout is None else time.monotonic() + timeout
        replies: list[Message] = []
        while waiting:
            pulled = list(self.grid.pull_messages(waiting))
            replies.extend(pulled)
            waiting.difference_update(reply.metadata.reply_to_message_id for reply in pulled)
            if not waiting or time.monotonic() > deadline:
                break
            time.sleep(self.poll_s)
        self.answers.append({reply.metadata.src_node_id: reply for reply in replies})
        if len(self.answers) - 1 == COLLECT:
            for reply in replies:
                reason = None if reply.has_error() else self.screen(reply.metadata.src_node_id, reply)
                if reason is not None:
                    self.refused[reply.metadata.src_node_id] = reason
            replies = [reply for reply in replies if reply.metadata.src_node_id not in self.refused]
        return replies

    def dropout(self, node: int, timeout_s: float) -> str | None:
        """Why ``node`` left the protocol (the stage and its error, or that it did not answer in time), or None."""
        for stage, (asked, answers) in enumerate(zip(self.asked, self.answers)):
            if node not in asked:
                return f"secure aggregation, {STAGES[stage]} stage: the site was not asked (it dropped out before)"
            reply = answers.get(node)
            if reply is None:
                return f"secure aggregation, {STAGES[stage]} stage: no reply within reply-timeout-s = {timeout_s:g} s"
            if reply.has_error():
                return f"secure aggregation, {STAGES[stage]} stage: {reply.error.reason}"
            if node in self.refused and stage == COLLECT:
                return (f"secure aggregation, {STAGES[stage]} stage: {self.refused[node]}; left out of the sum as a dropout "
                        "(its masks removed with its neighbours' shares)")
        return None

    def sent_bytes(self, node: int) -> int:
        """The bytes ``node`` sent in SecAgg+'s records: its public keys, encrypted shares, masked vector and unmask shares."""
        total = 0
        for answers in self.answers:
            reply = answers.get(node)
            if reply is None or reply.has_error() or RECORD_KEY_CONFIGS not in reply.content.config_records:
                continue
            for value in reply.content.config_records[RECORD_KEY_CONFIGS].values():
                total += sum(len(item) for item in (value if isinstance(value, list) else [value]) if isinstance(item, bytes))
        return total


class _PhaseStrategy(FlowerStrategy):
    """Flower's side of one securely aggregated phase: SecAgg+ asks it whom to send what (``configure_fit``) and hands
    it the unmasked weighted mean (``aggregate_fit``); nothing else of a Flower strategy is used."""

    def __init__(self, grid: Grid, run_id: int, fit_ins: dict[int, FitIns]) -> None:
        self.grid, self.run_id, self.fit_ins = grid, run_id, fit_ins
        self.results: list[tuple[ClientProxy, FitRes]] = []
        self.aggregated = False

    def configure_fit(self, server_round: int, parameters: Parameters, client_manager: ClientManager) -> list[tuple[ClientProxy, FitIns]]:
        return [(GridClientProxy(node, self.grid, self.run_id), ins) for node, ins in self.fit_ins.items()]

    def aggregate_fit(self, server_round: int, results: list[tuple[ClientProxy, FitRes]], failures: list[Any]) -> tuple[None, dict]:
        self.results, self.aggregated = results, True
        return None, {}

    def initialize_parameters(self, client_manager: ClientManager) -> None:
        return None

    def configure_evaluate(self, server_round: int, parameters: Parameters, client_manager: ClientManager) -> list:
        return []

    def aggregate_evaluate(self, server_round: int, results: list, failures: list) -> tuple[None, dict]:
        return None, {}

    def evaluate(self, server_round: int, parameters: Parameters) -> None:
        return None


class FlowerSecAgg:
    """Runs one phase of a deployment as a round of Flower's SecAgg+ (the module docstring).

    Args:
        grid: the run's Grid.
        run_id: the run's Flower id.
        options: ``deploy``'s SecAgg+ settings.
        timeout_s: how long each of the four stages waits for the sites' replies.
        poll_s: seconds between the server's looks for replies while it waits.
    """

    def __init__(self, grid: Grid, run_id: int, options: DeployConfig, timeout_s: float, poll_s: float) -> None:
        self.grid, self.run_id, self.options, self.timeout_s, self.poll_s = grid, run_id, options, timeout_s, poll_s

    def run(
        self, requests: dict[int, RecordDict], node_of_site: dict[int, int], round_index: int, max_weight: int, screen: Screen,
    ) -> SecureOutcome:
        """Send each site its request inside SecAgg+; the plain replies, the dropouts and the weighted mean.

        Args:
            requests: per site, the medfed message (:func:`~medfed.deploy.records.to_record`) of its work.
            node_of_site: each site's Flower node.
            round_index: the round (Flower's ``group_id`` of the messages).
            max_weight: the largest weight a site may hold (the largest declared training-set size).
            screen: the server's check of each site's plain reply at the collect stage, after this module's own
                (:func:`_collect_fault`); a site either refuses is left out of the sum as a dropout.
        """
        site_of_node = {node_of_site[index]: index for index in requests}
        plain: dict[int, dict[str, Any]] = {}

        def screened(node: int, reply: Message) -> str | None:
            index = site_of_node.get(node)
            if index is None:
                return "secure aggregation reply from a node that was not asked"
            fields, fault = _collect_fault(reply, index)
            fault = fault or screen(index, fields)
            if fault is None:
                plain[index] = fields
            return fault

        fit_ins = {node_of_site[index]: FitIns(Parameters([], ""), fit_config(record)) for index, record in requests.items()}
        strategy = _PhaseStrategy(self.grid, self.run_id, fit_ins)
        state = RecordDict({MAIN_CONFIGS_RECORD: ConfigRecord({WorkflowKey.CURRENT_ROUND: round_index}), MAIN_PARAMS_RECORD: ArrayRecord()})
        context = LegacyContext(Context(run_id=self.run_id, node_id=0, node_config={}, state=state, run_config={}), strategy=strategy)
        options = self.options
        workflow = SecAggPlusWorkflow(
            _flower_count(options.num_shares), _flower_count(options.reconstruction_threshold), max_weight=float(max_weight),
            clipping_range=options.clipping_range, quantization_range=options.quantization_range,
            modulus_range=options.modulus_range, timeout=self.timeout_s,
        )
        log = _StageLog(self.grid, self.poll_s, screened)
        outcome = SecureOutcome()
        try:
            workflow(log, context)
        except Exception as error:  # e.g. a site's masked vector of another shape: the sum cannot be made
            outcome.dropped = {index: f"secure aggregation failed: {type(error).__name__}: {error}"[:1000] for index in requests}
            return outcome
        in_sum = {proxy.node_id: fitres for proxy, fitres in strategy.results}
        for node, index in site_of_node.items():
            if node not in in_sum:
                reason = log.dropout(node, self.timeout_s)
                outcome.dropped[index] = reason or _halted(log, len(requests))
                continue
            outcome.plain[index] = {**plain[index], "secagg_bytes": log.sent_bytes(node)}
        if strategy.aggregated and in_sum:
            outcome.mean = parameters_to_ndarrays(next(iter(in_sum.values())).parameters)
            outcome.weight = float(sum(fitres.num_examples for fitres in in_sum.values()))
            outcome.in_sum = sorted(site_of_node[node] for node in in_sum)
        else:  # halted: nobody's work counts
            for index in outcome.plain:
                outcome.dropped.setdefault(index, _halted(log, len(requests)))
            outcome.plain = {}
        return outcome


def _halted(log: _StageLog, participants: int) -> str:
    """Why SecAgg+ stopped before the sum (too few sites answered a stage)."""
    stage = STAGES[max(len(log.answers) - 1, 0)]
    answered = len([reply for reply in log.answers[-1].values() if not reply.has_error()]) if log.answers else 0
    return (f"secure aggregation halted in the {stage} stage: {answered} of {participants} sites answered, fewer than "
            "SecAgg+ needs (at least 2, and deploy.reconstruction_threshold answering neighbours of every site)")


def _flower_count(value: float) -> int | float:
    """A ``num_shares`` or ``reconstruction_threshold`` as Flower takes it: a fraction (float) or a count (int)."""
    return float(value) if value <= 1 else int(value)


PLAIN = {"site_index": int, "reply": dict, "keys": list, "shapes": list}
"""The plain fields of a site's reply to a securely aggregated phase."""


def _collect_fault(reply: Message, index: int) -> tuple[dict[str, Any], str | None]:
    """Site ``index``'s reply at the collect stage: its plain fields (:func:`_plain_reply`), and why it is malformed
    (None: its plain fields are well formed and its masked arrays have the weight's one entry and the shapes it declared)."""
    try:
        plain = _plain_reply(recorddict_to_fitres(reply.content, keep_input=True), index)
        masked = reply.content.config_records[RECORD_KEY_CONFIGS][SecAggKey.MASKED_PARAMETERS]
        shapes = [_array_shape(data) for data in (masked if isinstance(masked, list) else [masked])]
        if shapes != [[1], *plain["shapes"]]:
            raise MessageError(f"secure aggregation reply: masked arrays of shapes {_short(shapes[1:])}, "
                               f"but it declared {_short(plain['shapes'])}").about(f"site{index}")
    except MessageError as error:
        return {}, f"malformed reply: {error}"
    except (KeyError, TypeError, ValueError) as error:  # not a SecAgg+ reply at all
        return {}, f"malformed reply: message from site{index}: secure aggregation reply: {type(error).__name__}: {error}"[:500]
    return plain, None


def _array_shape(data: Any) -> list[int]:
    """The shape in one masked array's ``.npy`` header, its length checked against the header (nothing allocated).

    Raises:
        MessageError: not ``.npy`` bytes of a plain integer array, or bytes of another length than its header declares.
    """
    if not isinstance(data, bytes):
        raise MessageError("secure aggregation reply: a masked array that is not bytes")
    stream = io.BytesIO(data)
    try:
        version = np.lib.format.read_magic(stream)
        shape, _, dtype = (np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0)(stream)
    except (ValueError, SyntaxError, TypeError) as error:
        raise MessageError(f"secure aggregation reply: a masked array is not .npy bytes ({error})"[:300]) from None
    if dtype.kind not in "iu" or stream.tell() + math.prod(shape) * dtype.itemsize != len(data):
        raise MessageError(f"secure aggregation reply: a masked array of {dtype} {list(shape)} in {len(data)} bytes")
    return list(shape)


def _short(value: Any) -> str:
    """``value`` as text, cut to 120 characters."""
    text = json.dumps(value)
    return text if len(text) <= 120 else text[:117] + "..."


def _plain_reply(fitres: FitRes, index: int) -> dict[str, Any]:
    """A site's plain reply (:data:`PLAIN`) and its weight, checked.

    Raises:
        MessageError: naming the site: not one JSON text of :data:`PLAIN`, another site's index, vector keys or
            shapes that are not strings and lists of sizes, or a weight that is not a whole number >= 0.
    """
    name = f"site{index}"
    try:
        text = fitres.metrics.get("json") if set(fitres.metrics) == {"json"} else None
        if not isinstance(text, str) or len(text) > MAX_JSON_CHARS:
            raise MessageError("secure aggregation reply: expected one JSON text of plain fields")
        try:
            plain = json.loads(text)
        except (ValueError, RecursionError):
            raise MessageError("secure aggregation reply: its plain fields are not JSON") from None
        expect(plain, PLAIN, "secure aggregation reply")
        if plain["site_index"] != index:
            raise MessageError(f"secure aggregation reply: site-index {plain['site_index']}, expected {index}")
        keys, shapes = plain["keys"], plain["shapes"]
        if (len(keys) != len(shapes) or not all(isinstance(key, str) for key in keys)
                or not all(isinstance(shape, list) and all(isinstance(size, int) and size >= 0 for size in shape) for shape in shapes)):
            raise MessageError("secure aggregation reply: expected vector keys (strings) and one shape (whole numbers >= 0) each")
        weight = fitres.num_examples
        if isinstance(weight, bool) or not isinstance(weight, int) or weight < 0:
            raise MessageError(f"secure aggregation reply: weight {weight!r} is not a whole number >= 0")
    except MessageError as error:
        raise error.about(name) from None
    return {**plain, "weight": weight}
