"""The ServerApp: a medfed strategy's server half and the loop's round logic, the sites on Flower SuperNodes.

Run config (``[tool.flwr.app.config]`` in pyproject.toml, ``flwr run
--run-config``): ``config`` (a medfed config file or bundled name, read by
the ServerApp), ``overrides`` (space-separated ``key=value``, as the CLI's),
``run-name`` (the sites key their state by it), ``output-dir`` (the server's
checkpoints and results.json), ``reply-timeout-s`` (how long the server
waits for a site), ``resume`` (continue the run of this ``run-name`` and
``output-dir``). A bad run config or medfed config (an unknown key, a wrong
value, a ``federation.label_ratio``, the pooled reference), or a resume
refused (no checkpoint, a config
changed other than ``trainer.rounds`` raised or ``trainer.keep_checkpoints``,
a fresh run over an earlier run's checkpoints) ends the run before any site
is contacted, with one line ``medfed: error: ...`` in the run's log; the
run is marked failed with that line as its reason. ``python -m medfed
deploy submit`` (:mod:`medfed.deploy.submit`) makes the same check before it
submits a run, and exits with status 2 instead.

*Checkpoints and resume.* After every round the loop's state (round,
history, the server half, the server's end of every link with its byte
counters, failure streaks and exclusions, each site's message count) and
the config go into ``<output-dir>/checkpoints/round-<r>.ckpt``
(:mod:`medfed.checkpoint`, as the simulator's). With ``resume=true`` the
newest intact one, round r, is loaded and every site is told to go back to
its own end of round r (:mod:`medfed.deploy.worker` keeps those snapshots):
sites that had trained further (the server died before it checkpointed a
round they finished) undo it, so the resumed rounds are the uninterrupted
run's. A site that cannot go back ends the run with one line naming the
site and the round.

The round logic is :class:`~medfed.federated.loop.FederatedLoop`'s, the
simulator's own; :class:`FlowerSites` is its executor: it codes every
message with the server's end of each site's
:class:`~medfed.federated.link.Link` and sends it to the node that
identified itself as that site. Sites are matched to Flower node ids by a
query each node answers with its ``site-index`` (and its model's input
shape and class count); a node that appears later (a SuperNode restarted
after a crash gets a new id) is asked too, and the message still waiting for
its site is sent to it again.

*Hostile replies.* The server reads every reply as bytes from a machine it
does not control (:func:`~medfed.deploy.records.from_record`, then
:meth:`~medfed.federated.link.Link.decode` against the model it holds, and
:func:`~medfed.deploy.records.expect` for the fields). A reply to a phase's
work that is malformed, or that the ClientApp answered with a Flower error,
fails that site in that round, as in the simulator: the loop leaves it out
of the round and it is put back (:mod:`medfed.federated.faults`); the run
goes on. Update norms and sample counts are the server's own checks on what
it decoded; a site declares its training-set size once, when it identifies
itself, and may report no more. A node whose description is malformed is
ignored (never a site). A site that does not answer within
``reply-timeout-s`` fails the same way (its late reply is never read); one
whose setup reply is an error, malformed or late is excluded from the run
from the start (one warning line; the run goes on with the others, and
ends with one line when none is left); one whose delivery reply is fails
that round, its metrics of the round missing (NaN, ``null`` in
results.json). A site that cannot go back to a resumed run's round ends the
run with one line naming it.

*Secure aggregation* (``deploy.secure_aggregation``): a phase the strategy
declares in ``secure_sums`` runs as one round of Flower's SecAgg+
(:mod:`medfed.deploy.secure_aggregation`): the work requests ride inside it,
each site's plain fields come back per site, its vectors only as the
participants' weighted sum, which the loop hands to the server half's
``aggregate_summed`` (:meth:`FlowerSites.summed_replies`). A site that drops
out of the protocol fails the phase with the stage named; one whose clear
parts (keys, shapes, weight: :func:`summed_reply_fault`) are refused at the
collect stage is such a dropout, so the others' sum goes on; what a site
sent in SecAgg+'s records (keys, shares, masked vector) is its up traffic.

Round trips are what a deployment waits for (a SuperNode looks for messages
every 3 s when idle): one per phase and one per round's delivery and
evaluation, plus the query and the setup; the delivery of round 0, which
needs no answer, rides with each site's first message of round 1.
"""

from __future__ import annotations

import json
import math
import shlex
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flwr.app import Context, Message
from flwr.common.constant import ErrorCode
from flwr.serverapp import Grid, ServerApp

from medfed.assembly import RunAssembly, federated_loop, make_fabric
from medfed.checkpoint import FOLDER, checkpoints, resume_state, round_checkpoints
from medfed.components import ResolvedRun, resolve
from medfed.config import load_config, to_yaml
from medfed.deploy.client_app import run_folder
from medfed.deploy.records import expect, from_record, to_record
from medfed.deploy.secure_aggregation import FlowerSecAgg, refuse_secure_aggregation
from medfed.errors import ConfigError, DataError, MessageError, SiteFailure, warn
from medfed.federated.site_work import PhaseWork, SiteEvaluation, SiteResult
from medfed.federated.link import Link, Wire
from medfed.federated.protocol import Payload, SecureSum
from medfed.federated.sites import SummedReplies
from medfed.output_dir import hold_output_dir
from medfed.results import run_results, timing_summary, write_results
from medfed.tasks.label_imbalance import refuse_label_ratio

app = ServerApp()
POLL_S = 0.1
"""Seconds between the server's looks for replies (and for new nodes) while it waits."""
RUN_CONFIG = {"config": str, "overrides": str, "run-name": str, "output-dir": str, "reply-timeout-s": float, "resume": bool}
"""The run config's keys and types (``[tool.flwr.app.config]``)."""
Request = tuple[dict[str, Any], dict[str, Wire]]
"""One request to a site's worker, or its reply: fields and wire (:mod:`medfed.deploy.worker`)."""
DESCRIPTION = {"site_index": int, "input_shape": list, "num_classes": int, "num_samples": int, "num_evaluated": int, "generated": bool}
"""The fields of a node's answer to the query: which site it is, its model's input and classes, its training-set size,
the size of the split it evaluates on and whether its data are generated (the last two for results.json alone)."""
WORK_REPLY = {"losses": dict, "non_finite": list, "compute": dict, "train_s": float}
"""The fields of a site's reply to a phase's work (or ``{"error": str}`` alone)."""


class FlowerSites:
    """A deployment's :class:`~medfed.federated.sites.Sites`: every site on its own SuperNode.

    Args:
        grid: the run's Grid (messages to and from the SuperNodes).
        n_sites: the federation's sites; this many nodes must identify themselves.
        config_yaml: the resolved run config, sent with every message.
        timeout_s: how long one exchange may wait for a site's reply.
        secure: SecAgg+ for the phases in ``secure_sums`` (None: every reply in the clear).
        secure_sums: the strategy's securely summable phases (``Strategy.secure_sums``).
    """

    def __init__(
        self, grid: Grid, n_sites: int, config_yaml: str, timeout_s: float, secure: FlowerSecAgg | None = None,
        secure_sums: dict[str, SecureSum] | None = None,
    ) -> None:
        self.grid = grid
        self.secure = secure
        self.secure_sums = secure_sums or {}
        self.device = torch.device("cpu")  # where a summed reply's vectors go (the run's device: serve sets it)
        self._summed: SummedReplies | None = None
        self._summing = False  # the phase under way is securely summed: no reply of its own per site
        self.names = [f"site{index}" for index in range(n_sites)]
        self.config_yaml = config_yaml
        self.timeout_s = timeout_s
        self.links: list[Link] = []
        self.node_of_site: dict[int, int] = {}
        self.descriptions: dict[int, tuple[tuple[int, ...], int]] = {}
        self.declared_samples = [0] * n_sites
        self.declared_evaluated = [0] * n_sites
        self.declared_generated = [False] * n_sites
        self._known_nodes: set[int] = set()
        self.seq = [0] * n_sites
        self._pending: dict[int, list[Request]] = {}  # requests that ride with the site's next message
        self._waiting: dict[int, dict[str, Wire]] = {}
        self._restore: set[int] = set()
        self._before_reply: dict[int, dict[str, Any]] = {}  # server link states before this phase's decoded replies
        self.delivered = 0  # the last round whose delivery every site has received
        self.validation: dict[str, dict[str, float]] = {}  # the last evaluation's validation metrics of the sites that have the split

    # ------------------------------------------------------------------ before the loop
    def handshake(self) -> dict[str, Any]:
        """Find every site's node; returns the sites' common description of the model's input and output.

        Returns:
            ``{"input_shape", "num_classes"}`` as the sites report them.

        Raises:
            RuntimeError: the sites describe different models, a node could
                not build its site, or not every site joined within ``timeout_s``.
        """
        deadline = time.monotonic() + self.timeout_s
        while len(self.node_of_site) < len(self.names):
            self._identify_new_nodes()
            if len(self.node_of_site) == len(self.names):
                break
            if time.monotonic() > deadline:
                missing = sorted(set(range(len(self.names))) - set(self.node_of_site))
                raise RuntimeError(f"sites {missing} did not join within {self.timeout_s} s")
            time.sleep(POLL_S)
        if len(set(self.descriptions.values())) != 1:
            raise RuntimeError(f"the sites describe different models (input shape, classes): {self.descriptions}")
        shape, classes = self.descriptions[0]
        return {"input_shape": shape, "num_classes": classes}

    def federation_summary(self, task: str, holdout: str) -> dict[str, Any]:
        """results.json's ``federation`` section (:mod:`medfed.results`), from what each site declared when it identified itself.

        Args:
            task: the ``data.task`` of the run.
            holdout: the split the sites evaluate on (``federation.holdout``).
        """
        generated = [name for name, flag in zip(self.names, self.declared_generated) if flag]
        shape, classes = self.descriptions[0]
        description = f"{task} data of {len(self.names)} sites on Flower SuperNodes, each reading its own"
        if generated:
            description = f"GENERATED {description} (generated at {', '.join(generated)}, as the sites declared)"
        return {
            "task": task,
            "description": description,
            "generated": bool(generated),
            "holdout": holdout,
            "input_shape": list(shape),
            "num_classes": classes,
            "sites": [
                {"name": name, "n_train": n_train, f"n_{holdout}": n_evaluated}
                for name, n_train, n_evaluated in zip(self.names, self.declared_samples, self.declared_evaluated)
            ],
        }

    # ------------------------------------------------------------------ Sites
    def setup(self) -> tuple[dict[int, Payload], dict[int, str]]:
        """Every site's setup reply, decoded, and why each other site has none (an error, malformed, late): the loop excludes those."""
        replies = self._exchange({index: ({"kind": "setup"}, {}) for index in range(len(self.names))}, round_index=0)
        received, refused = {}, {}
        for index, reply in sorted(replies.items()):
            if isinstance(reply, str):
                refused[index] = reply
                continue
            try:
                expect(reply[0], {}, "setup reply")
                received[index] = self.links[index].decode("up", reply[1])
            except MessageError as error:
                refused[index] = f"malformed reply: {error.about(self.names[index])}"
        return received, refused

    def open_round_starts(self, directory: Path | None) -> None:
        """Nothing here: each site's start of a round is its own snapshot of the previous round's end (:mod:`medfed.deploy.worker`)."""

    def close_round_starts(self) -> None:
        """Nothing here: the sites keep their snapshots."""

    def save_round_start(self, participants: list[int]) -> None:
        self._restore.clear()

    def restore_round_start(self, index: int) -> None:
        self._restore.add(index)  # told with the round's delivery
        if index in self._before_reply:
            self.links[index].load_state_dict(self._before_reply.pop(index))

    def work(self, work: PhaseWork, messages: dict[int, Payload], timing: dict[str, float]) -> dict[int, SiteResult]:
        """Send the phase's messages, wait for every reply; a reply that is an error or malformed is that site's failure."""
        self._before_reply = {}
        request = {"kind": "work", "round": work.round_index, "phase_index": work.phase_index, "phase": work.phase,
                   "local_epochs": work.local_epochs}
        wires = {index: self.links[index].encode("down", payload) for index, payload in messages.items()}
        if self.secure is not None and work.phase in self.secure_sums and wires:
            return self._secure_work(work, request, wires, timing)
        replies = self._exchange({index: (request, wire) for index, wire in wires.items()}, work.round_index)
        results = {}
        for index, reply in replies.items():
            if isinstance(reply, str):
                results[index] = SiteResult(error=reply)
                continue
            fields, wire = reply
            try:
                results[index] = _work_result(fields, self.names[index])
            except MessageError as error:
                results[index] = SiteResult(error=f"malformed reply: {error}")
                continue
            if results[index].error is None:
                timing["train_s"] += fields["train_s"]
                self._waiting[index] = wire
        return results

    def _secure_work(self, work: PhaseWork, request: dict[str, Any], wires: dict[int, dict[str, Wire]], timing: dict[str, float]) -> dict[int, SiteResult]:
        """A securely summed phase: the requests ride inside a round of SecAgg+; each site's plain fields, the sum kept
        for :meth:`summed_replies`. What each site sent in SecAgg+'s records counts as its up traffic."""
        self._summing = True
        max_weight = max(self.declared_samples[index] for index in wires)
        request = {**request, "secure": True, "max_weight": max_weight, "clipping_range": self.secure.options.clipping_range}
        records = {index: self._content(index, (request, wire))[0] for index, wire in wires.items()}
        weight_key = self.secure_sums[work.phase].weight

        def screen(index: int, plain: dict[str, Any]) -> str | None:
            fault = summed_reply_fault(plain, self.links[index], work.reply_keys.get(index, ()), weight_key, self.declared_samples[index])
            return None if fault is None else f"refused before the sum: {self.names[index]}: {fault}"

        outcome = self.secure.run(records, self.node_of_site, work.round_index, max_weight, screen)
        results = {index: SiteResult(error=reason) for index, reason in outcome.dropped.items()}
        layouts = set()
        for index, plain in outcome.plain.items():
            link = self.links[index]  # SecAgg+'s bytes (keys, shares, masked vector) are the site's up traffic; dense: float32
            link.bytes_sent["up"] += plain["secagg_bytes"]
            link.dense_bytes["up"] += 4 * (sum(math.prod(shape) for shape in plain["shapes"]) + (weight_key is not None))
            try:
                reply = dict(plain["reply"])
                train_s = reply.get("train_s")
                results[index] = _work_result(reply, self.names[index])
            except MessageError as error:
                results[index] = SiteResult(error=f"malformed reply: {error} (its masked vector is in the sum: none can be taken out)")
                continue
            timing["train_s"] += train_s
            layouts.add(json.dumps([plain["keys"], plain["shapes"]]))
        self._summed = None
        if outcome.mean is not None:
            fault = _sum_fault(outcome.mean, outcome.weight, layouts)
            if fault is not None:
                for index in outcome.plain:
                    results[index] = SiteResult(error=f"secure aggregation: {fault}")
                return results
            keys, _ = json.loads(layouts.pop())
            reply = {key: torch.as_tensor(vector, dtype=torch.float32).to(self.device) for key, vector in zip(keys, outcome.mean)}
            if weight_key is not None:
                reply[weight_key] = torch.tensor([outcome.weight], dtype=torch.float32, device=self.device)
            self._summed = SummedReplies(reply, outcome.in_sum)
        return results

    def summed_replies(self) -> SummedReplies | None:
        """The last securely summed phase's sum (once), or None where the phase's replies came in the clear."""
        summed, self._summed = self._summed, None
        return summed

    def replies(self, candidates: list[int]) -> tuple[dict[int, Payload], dict[int, str]]:
        """The candidates' replies, decoded; none in a securely summed phase (the server holds only their sum)."""
        if self._summing:
            self._summing = False
            return {}, {}
        waiting, self._waiting = self._waiting, {}
        received, refused = {}, {}
        for index in candidates:
            before = self.links[index].state_dict()  # K is replaced, never written to: no copy
            try:
                received[index] = self.links[index].decode("up", waiting[index])
            except MessageError as error:  # the link is left as it was
                refused[index] = f"malformed reply: {error}"
                continue
            self._before_reply[index] = before
        return received, refused

    def deliver(
        self, round_index: int, payloads: dict[int, Payload], evaluate: bool, timing: dict[str, float] | None
    ) -> dict[str, SiteEvaluation]:
        """Code each site's delivery now; without ``evaluate`` (round 0's) it waits to ride with the site's next message."""
        tic = time.perf_counter()
        requests = {
            index: (
                {"kind": "deliver", "round": round_index, "restore": index in self._restore, "evaluate": evaluate},
                self.links[index].encode("down", payload),
            )
            for index, payload in payloads.items()
        }
        if not evaluate:
            for index, request in requests.items():
                self._pending.setdefault(index, []).append(request)
            return {}
        replies = self._exchange(requests, round_index)
        self.delivered = round_index
        if timing is not None:
            timing["eval_s"] = time.perf_counter() - tic
        evaluations, self.validation = {}, {}
        for index, reply in sorted(replies.items()):
            name = self.names[index]
            try:
                if isinstance(reply, str):
                    raise MessageError(reply)
                fields, validation = _validation(reply[0], name)
                evaluations[name] = _evaluation(fields, name)
            except MessageError as error:  # the site fails the round; its metrics are missing
                evaluations[name] = SiteEvaluation({}, error=str(error))
                continue
            if validation:
                self.validation[name] = validation
        return evaluations

    def on_round_end(self, loop: Any, record: dict[str, Any]) -> None:
        """A Fabric callback: the round's validation metrics into its record (``record["validation"][site][metric]``),
        as the simulator's :class:`~medfed.evaluation.rounds.ValidationEvaluation` puts them."""
        if self.validation:
            record["validation"] = self.validation

    def state_dict(self) -> list[dict[str, Any]]:
        """Each site's message count and the round its state is at (the sites keep their own state)."""
        return [{"seq": seq, "round": self.delivered} for seq in self.seq]

    def load_state_dict(self, state: list[dict[str, Any]]) -> None:
        """Tell every site to go back to its own state at the end of the checkpoint's round.

        Raises:
            SiteFailure: a site cannot (one line per site: the site and the
                round, and why: no snapshot of that round kept, a damaged
                one, or one written with another config).
        """
        self.seq = [entry["seq"] for entry in state]
        self.delivered = state[0]["round"]
        rewind = ({"kind": "rewind", "round": self.delivered}, {})
        replies = self._all_replied(self._exchange({index: rewind for index in range(len(self.names))}, self.delivered))
        errors = []
        for index, (fields, _) in sorted(replies.items()):
            if fields != {}:
                try:
                    errors.append(expect(fields, {"error": str}, "rewind reply")["error"])
                except MessageError as error:
                    errors.append(str(error.about(self.names[index])))
        if errors:
            raise SiteFailure("; ".join(errors))

    # ------------------------------------------------------------------ messages
    def _identify_new_nodes(self) -> None:
        """Ask every node not seen before which site it is; a site's newest node replaces its old one.

        A node the SuperLink reports unavailable (one that stopped, e.g. a
        SuperNode restarted under a new node id, not yet expired) is skipped.

        A node whose answer is malformed (not medfed's record, a description
        missing a field or of the wrong kind, a site index the federation does
        not have) is ignored, with a warning: it never becomes a site.

        Raises:
            RuntimeError: a node could not build its site (the reason its ClientApp gave).
        """
        new = set(self.grid.get_node_ids()) - self._known_nodes
        if not new:
            return
        content = to_record({"config": self.config_yaml}, [])
        queries = [Message(content, dst_node_id=node, message_type="query") for node in sorted(new)]
        for reply in self.grid.send_and_receive(queries, timeout=self.timeout_s):
            node = reply.metadata.src_node_id
            if reply.has_error() and reply.error.code == ErrorCode.NODE_UNAVAILABLE:
                self._known_nodes.add(node)  # a node gone (e.g. killed and restarted under a new id): never a site
                continue
            if reply.has_error():
                raise RuntimeError(f"node {node} could not build its site: {reply.error.reason}")
            self._known_nodes.add(node)
            try:
                fields = _description(from_record(reply.content, f"node {node}")[0], len(self.names))
            except MessageError as error:
                warn(f"node {node} ignored: {error}")
                continue
            index = fields["site_index"]
            self.node_of_site[index] = node
            self.descriptions[index] = (tuple(fields["input_shape"]), fields["num_classes"])
            self.declared_samples[index] = fields["num_samples"]
            self.declared_evaluated[index] = fields["num_evaluated"]
            self.declared_generated[index] = fields["generated"]

    def _exchange(self, requests: dict[int, Request], round_index: int) -> dict[int, Request | str]:
        """Send each site its request (after any waiting to ride with it), wait for every reply; resend to a site's new node.

        Returns:
            Each site's reply to its request (the replies to the requests
            that rode along are dropped), or why there is none: the Flower
            error its ClientApp answered with, why its reply is malformed, or
            that none came within ``timeout_s`` (its late reply is never read).
        """
        content, carried_count = {}, {}
        for index, request in requests.items():
            content[index], carried_count[index] = self._content(index, request)
        sent: dict[int, tuple[int, str]] = {}  # site -> (node, message id)

        def push(indices: list[int]) -> None:
            messages = [
                Message(content[index], dst_node_id=self.node_of_site[index], message_type="train", group_id=str(round_index))
                for index in indices
            ]
            for index, message_id in zip(indices, self.grid.push_messages(messages), strict=True):
                sent[index] = (self.node_of_site[index], message_id)

        push(sorted(requests))
        replies: dict[int, Request | str] = {}
        deadline = time.monotonic() + self.timeout_s
        while len(replies) < len(requests):
            site_of_message = {message_id: index for index, (_, message_id) in sent.items() if index not in replies}
            for reply in self.grid.pull_messages(list(site_of_message)):
                index = site_of_message[reply.metadata.reply_to_message_id]
                if reply.has_error():
                    replies[index] = f"{self.names[index]}: {reply.error.reason}"
                    continue
                try:
                    replies[index] = self._last_reply(reply, index, carried_count[index])
                except MessageError as error:
                    replies[index] = f"malformed reply: {error}"
            if len(replies) == len(requests):
                break
            self._identify_new_nodes()
            moved = [index for index, (node, _) in sent.items() if index not in replies and self.node_of_site[index] != node]
            if moved:
                push(moved)
            if time.monotonic() > deadline:
                for index in requests:
                    replies.setdefault(index, f"no reply within reply-timeout-s = {self.timeout_s:g} s")
                break
            time.sleep(POLL_S)
        return replies

    def _content(self, index: int, request: Request) -> tuple[Any, int]:
        """Site ``index``'s next message: ``request`` after the requests waiting to ride with it; and how many it carries."""
        carried = [*self._pending.pop(index, []), request]
        self.seq[index] += 1
        fields = {"seq": self.seq[index], "config": self.config_yaml, "requests": [fields for fields, _ in carried]}
        return to_record(fields, [wire for _, wire in carried]), len(carried)

    def _last_reply(self, reply: Message, index: int, count: int) -> Request:
        """The reply to the last of the ``count`` requests site ``index`` was sent, from its message.

        Raises:
            MessageError: the message is not one reply per request from that site.
        """
        fields, wires = from_record(reply.content, self.names[index])
        try:
            expect(fields, {"site_index": int, "replies": list}, "reply")
            if fields["site_index"] != index or len(fields["replies"]) != count or len(wires) != count:
                raise MessageError(f"reply: expected site-index {index} and {count} replies, got {fields['site_index']} and "
                                   f"{len(fields['replies'])} with {len(wires)} wires")
        except MessageError as error:
            raise error.about(self.names[index]) from None
        return fields["replies"][-1], wires[-1]

    def _all_replied(self, replies: dict[int, Request | str]) -> dict[int, Request]:
        """``replies`` if every site replied.

        Raises:
            RuntimeError: naming the first site whose reply is an error or malformed.
        """
        for index, reply in sorted(replies.items()):
            if isinstance(reply, str):
                raise RuntimeError(reply if reply.startswith(self.names[index]) else f"{self.names[index]}: {reply}")
        return replies


def summed_reply_fault(
    plain: dict[str, Any], link: Link, reply_keys: tuple[frozenset[str], ...], weight_key: str | None, declared_samples: int,
) -> str | None:
    """Why one site's securely summed reply is refused before the sum, from its clear parts; None: it may be summed.

    Args:
        plain: its plain fields (``keys`` and ``shapes`` of its vectors, ``weight``).
        link: the server's end of the site's link (the sizes of the model vectors it knows).
        reply_keys: the key sets the server half expects of this site (``ServerHalf.reply_keys``).
        weight_key: the phase's weight key (``SecureSum.weight``; None: every site weighs 1).
        declared_samples: the training-set size the site declared when it joined.

    Refused: vector keys that are not one of ``reply_keys`` (less the weight key), a vector
    whose shape is not the flat size the server knows for its key (or of a key whose size it
    cannot know), and a weight that is not a whole number from 0 to ``declared_samples`` (1
    where unweighted): a sum cannot take a site out again, and one site's vector of another
    shape, or weight of 10^9, would spoil every site's round.
    """
    keys, weight = plain["keys"], plain["weight"]
    expected = [sorted(keys_ - {weight_key}) for keys_ in reply_keys]
    if sorted(keys) not in expected:
        return f"vector keys {sorted(keys)}, expected {' or '.join(map(str, expected)) or 'none'}"
    for key, shape in zip(keys, plain["shapes"]):
        size = link.vector_size(key)
        if size is None:
            return f"vector {key!r}: the server knows no size for it, which a sum needs"
        if shape != [size]:
            return f"vector {key!r} declared of shape {shape}, expected [{size}] (the model vector's size)"
    allowed = range(1, 2) if weight_key is None else range(declared_samples + 1)
    if weight not in allowed:
        return f"plain weight {weight}, expected a whole number from {allowed.start} to {allowed.stop - 1} (the training samples it declared)"
    return None


def _sum_fault(mean: list[Any], weight: float, layouts: set[str]) -> str | None:
    """Why a securely aggregated sum cannot be used, or None: the sites in it declared different vector keys or
    shapes, or shapes other than the sum's, its total weight is not positive, or it holds non-finite values."""
    if len(layouts) != 1:
        return f"the sites in the sum declared {len(layouts)} different layouts of vector keys and shapes, expected one"
    keys, shapes = json.loads(next(iter(layouts)))
    if shapes != [list(vector.shape) for vector in mean] or len(set(map(str, keys))) != len(keys):
        return "the sum's vectors do not have the keys and shapes the sites declared"
    if not weight > 0 or not all(np.isfinite(vector).all() for vector in mean):
        return f"the sum's total weight {weight:g} is not positive, or it holds non-finite values"
    return None


def _description(fields: Any, n_sites: int) -> dict[str, Any]:
    """A node's answer to the query, checked (:data:`DESCRIPTION`).

    Raises:
        MessageError: a missing or extra field, a site index outside ``0..n_sites - 1``, an input shape that is
            not positive whole numbers, or a class count or training-set size below 1.
    """
    expect(fields, DESCRIPTION, "description")
    if not 0 <= fields["site_index"] < n_sites:
        raise MessageError(f"description: site-index {fields['site_index']}; this federation has sites 0..{n_sites - 1}")
    shape = fields["input_shape"]
    if not shape or len(shape) > 8 or not all(isinstance(size, int) and not isinstance(size, bool) and size > 0 for size in shape):
        raise MessageError(f"description: input_shape must be up to 8 positive whole numbers, got {str(shape)[:80]}")
    if fields["num_classes"] < 1 or fields["num_samples"] < 1:
        raise MessageError("description: num_classes and num_samples must be at least 1")
    if fields["num_evaluated"] < 0:
        raise MessageError("description: num_evaluated must be at least 0")
    return fields


def _work_result(fields: Any, name: str) -> SiteResult:
    """A site's reply to a phase's work, checked (:data:`WORK_REPLY`, or ``{"error": str}``).

    Raises:
        MessageError: naming the site: a missing, extra or mistyped field, a loss or time that is not a
            finite number (a time below 0), a non-finite key that is not a string.
    """
    try:
        if isinstance(fields, dict) and "error" in fields:
            return SiteResult(error=str(expect(fields, {"error": str}, "reply")["error"])[:1000])
        expect(fields, WORK_REPLY, "reply")
        losses = {label: expect({"loss": loss}, {"loss": float}, f"reply loss {label!r}")["loss"] for label, loss in fields["losses"].items()}
        if fields["train_s"] < 0 or not all(isinstance(key, str) for key in fields["non_finite"]):
            raise MessageError("reply: train_s below 0, or a non-finite key that is not a string")
        compute = _epochs(fields["compute"], "reply compute")
    except MessageError as error:
        raise error.about(name) from None
    return SiteResult(losses={(label or None): float(loss) for label, loss in losses.items()}, non_finite=fields["non_finite"], compute=compute)


def _epochs(fields: dict[str, Any], what: str) -> dict[str, float]:
    """A compute report ``{key: epochs}``, checked: string keys, finite epochs >= 0.

    Raises:
        MessageError: naming ``what`` and the first bad entry.
    """
    epochs = {}
    for key, value in fields.items():
        if not isinstance(key, str) or not expect({"epochs": value}, {"epochs": float}, f"{what} {key!r}")["epochs"] >= 0:
            raise MessageError(f"{what}: {key!r} is not a count of epochs >= 0")
        epochs[key] = float(value)
    return epochs


@dataclass(frozen=True)
class RunSettings:
    """A checked run config: the resolved medfed config and the ServerApp's own settings."""

    resolved: ResolvedRun
    output_dir: Path
    reply_timeout_s: float
    resume: bool


DELIVERY_REPLY = {"metrics": dict, "compute": dict, "adapt_losses": dict, "adapt_error": str}
"""The fields of a site's reply to an evaluated delivery (``adapt_error`` may also be null)."""


def _evaluation(fields: Any, name: str) -> SiteEvaluation:
    """A site's adapt step and evaluation, from its delivery reply's fields, checked.

    Raises:
        MessageError: naming the site: a missing, extra or mistyped field, a metric, loss or count that is not finite.
    """
    try:
        if isinstance(fields, dict) and fields.get("adapt_error", "") is None:
            fields = {**fields, "adapt_error": ""}
        expect(fields, DELIVERY_REPLY, "delivery reply")
        metrics = {str(metric): float(expect({"value": value}, {"value": float}, f"metric {metric!r}")["value"]) for metric, value in fields["metrics"].items()}
        losses = {(str(label) or None): float(expect({"loss": loss}, {"loss": float}, f"adapt loss {label!r}")["loss"]) for label, loss in fields["adapt_losses"].items()}
        compute = _epochs(fields["compute"], "delivery reply compute")
    except MessageError as error:
        raise error.about(name) from None
    return SiteEvaluation(metrics, compute, losses, fields["adapt_error"][:1000] or None)


def _validation(fields: Any, name: str) -> tuple[Any, dict[str, float]]:
    """A delivery reply's validation metrics, checked (``{}``: the site has no validation split), and its other fields.

    Raises:
        MessageError: naming the site: no ``validation`` object, or a metric that is not a finite number.
    """
    if not isinstance(fields, dict):
        return fields, {}  # _evaluation refuses it
    fields = dict(fields)
    try:
        validation = fields.pop("validation", None)
        if not isinstance(validation, dict):
            raise MessageError("delivery reply: expected a 'validation' object of metrics")
        metrics = {str(metric): float(expect({"value": value}, {"value": float}, f"validation metric {metric!r}")["value"])
                   for metric, value in validation.items()}
    except MessageError as error:
        raise error.about(name) from None
    return fields, metrics


def run_settings(run_config: dict[str, Any]) -> RunSettings:
    """Check the run config and the medfed config it names, before any site is contacted.

    Raises:
        ConfigError: a run config key missing or of the wrong type, a bad
            medfed config (:func:`~medfed.config.load_config`,
            :func:`~medfed.components.resolve`), a strategy that pools the
            sites' data (the centralised reference), or a
            ``federation.label_ratio`` (its draw needs every site's samples at once).
    """
    for key, kind in RUN_CONFIG.items():
        value = run_config.get(key)
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not (number if kind is float else isinstance(value, kind)):
            raise ConfigError(f"run config key {key!r}: expected a {kind.__name__}, got {value!r} (flwr run --run-config '{key}=...')")
    if not float(run_config["reply-timeout-s"]) > 0:
        raise ConfigError(f"run config key 'reply-timeout-s': expected seconds > 0, got {run_config['reply-timeout-s']!r}")
    try:
        run_folder(run_config["run-name"])
    except ValueError as error:
        raise ConfigError(f"run config key 'run-name': {error}") from None
    if not str(run_config["output-dir"]).strip():
        raise ConfigError("run config key 'output-dir': expected a folder, got an empty string")
    try:
        overrides = shlex.split(str(run_config["overrides"]))
    except ValueError as error:
        raise ConfigError(f"run config key 'overrides': {error}") from None
    resolved = resolve(load_config(str(run_config["config"]), overrides))
    if resolved.strategy_cls.pools_data:
        raise ConfigError(
            f"config key 'strategy.name' = {resolved.strategy_cls.name!r}: it pools every site's training data at one site, "
            "which a deployment never does"
        )
    if resolved.run.privacy.dp.enabled:  # the sites of a deployment are built without it (docs/privacy.md)
        raise ConfigError("config key 'privacy.dp': DP-SGD runs in the simulator only; the Flower deployment does not build it yet")
    if resolved.run.privacy.client_dp.enabled:  # the deployment's loop is built without it (docs/privacy.md)
        raise ConfigError("config key 'privacy.client_dp': client-level DP runs in the simulator only; the Flower deployment does not build it yet")
    if resolved.run.attack.sites:  # the simulator's evaluation of an aggregation rule: a deployment's sites are real
        raise ConfigError(f"config key 'attack.sites' = {resolved.run.attack.sites}: simulated hostile sites are for evaluation in the "
                          "simulator (medfed fit, compare); a deployment's sites are the hospitals' own")
    refuse_label_ratio(resolved.run.federation)
    refuse_secure_aggregation(resolved)
    return RunSettings(resolved, Path(str(run_config["output-dir"])), float(run_config["reply-timeout-s"]), run_config["resume"])


def resumed_state(settings: RunSettings) -> dict[str, Any] | None:
    """The checkpoint a ``resume=true`` run continues from (:func:`~medfed.checkpoint.resume_state`); None for a fresh run.

    Raises:
        ConfigError: a resume without a checkpoint or with a changed config
            (the message names the key), or a fresh run whose
            ``output-dir`` holds an earlier run's checkpoints.
        DataError: the newest checkpoint is damaged (the message names the previous intact one).
    """
    fresh = "start a new run with another output-dir and run-name"
    if settings.resume:
        return resume_state(settings.output_dir, settings.resolved.config, switch="run config resume=true", fresh=fresh)
    if checkpoints(settings.output_dir / FOLDER):
        raise ConfigError(
            f"run config key 'output-dir': {settings.output_dir} holds an earlier run's checkpoints; "
            f"resume=true continues that run, or {fresh}"
        )
    return None


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Build the server half from the run config (resumed from its checkpoint with ``resume``), run the rounds, write results.json.

    The ``output-dir`` is held for the run (:func:`~medfed.output_dir.hold_output_dir`): a second run
    on it, a ServerApp or ``medfed fit``, is refused in one line naming the holder.

    Raises:
        ConfigError: bad input, the output-dir held by another run, or a resume refused (one line
            ``medfed: error: ...`` in the run's log first).
        DataError: a resume whose newest checkpoint is damaged (one line first).
        SiteFailure: a site cannot go back to the checkpoint's round, every site is excluded, or a site fails
            under ``federation.on_site_failure: stop`` (one line first).
        RuntimeError: a site failed to join or to build itself (:class:`FlowerSites`).
    """
    with ExitStack() as held:
        try:
            settings = run_settings(dict(context.run_config))
            held.enter_context(hold_output_dir(settings.output_dir, key=f"run config key 'output-dir' = {str(settings.output_dir)!r}"))
            resumed = resumed_state(settings)
        except (ConfigError, DataError) as error:
            print(f"medfed: error: {error}", flush=True)
            raise
        serve(grid, settings, resumed, context.run_id)


def serve(grid: Grid, settings: RunSettings, resumed: dict[str, Any] | None, run_id: int) -> None:
    """The run itself, the output-dir held: find the sites, run the rounds (from ``resumed``'s round), write results.json."""
    resolved, output_dir = settings.resolved, settings.output_dir
    config, run = resolved.config, resolved.run
    trainer = run.trainer
    if trainer.num_threads is not None:
        torch.set_num_threads(trainer.num_threads)
    started = time.perf_counter()

    secure = FlowerSecAgg(grid, run_id, run.deploy, settings.reply_timeout_s, POLL_S) if run.deploy.secure_aggregation else None
    sites = FlowerSites(
        grid, run.federation.n_sites, to_yaml(config), settings.reply_timeout_s, secure, resolved.strategy_cls.secure_sums
    )
    described = sites.handshake()
    assembly = RunAssembly.from_config(resolved, described["input_shape"], described["num_classes"], run.federation.n_sites)
    fabric = make_fabric(trainer, callbacks=[sites])  # sites.on_round_end: the validation metrics
    initial = assembly.initial_values(fabric.device)
    sites.device = fabric.device
    sites.links = [assembly.link(initial, fabric.device, peer=name) for name in sites.names]
    loop = federated_loop(run, fabric, assembly.strategy, sites, initial, round_checkpoints(output_dir, config, trainer.keep_checkpoints))
    if resumed is not None:
        try:
            loop.load_state_dict(resumed)  # every site goes back to its end of the checkpoint's round
        except SiteFailure as error:
            print(f"medfed: error: run config resume=true: {error}", flush=True)
            raise
        print(f"medfed: resumed after round {loop.round} from {output_dir / FOLDER}", flush=True)
        del resumed
    try:
        loop.fit(trainer.rounds, progress=lambda record: print(f"medfed round {record['round']}: {record['mean']}", flush=True))
    except SiteFailure as error:
        print(f"medfed: error: {error}", flush=True)
        raise
    results = run_results(
        loop,
        engine="flower-deployment",
        federation=sites.federation_summary(resolved.task.name, run.federation.holdout),
        timing={
            **timing_summary(loop.history, time.perf_counter() - started, fabric.device),
            "num_threads_reason": "the ServerApp's torch default (each site's runner keeps its own)",
        },
        config=config,
        executor={"name": "sequential"},  # every SuperNode trains its own site
        device=run.trainer.device,  # each SuperNode resolves it for itself: the configured value, not a device the server saw
    )
    write_results(output_dir / "results.json", results)
    print(f"medfed: wrote {output_dir / 'results.json'}", flush=True)
