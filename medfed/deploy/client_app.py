"""The ClientApp: one hospital's site, run by its SuperNode on its own data.

The node's identity and data come from the SuperNode's ``--node-config``,
never from the server: ``site-index`` (0-based), ``data-root`` (the folder
the task's ``build_site`` reads) and, optionally, ``state-dir`` (where the
site keeps its state between messages and its snapshots of the last
rounds' ends, which a resumed server asks it to go back to; default
``<data-root>/../medfed-state/site<index>``). The server sends the run's
config with every message; the site's
:class:`~medfed.deploy.worker.SiteWorker` answers them, and this process
keeps it for the run's next message (a process Flower starts per message
builds it each time; :mod:`medfed.deploy.runner` keeps one process for all
of them).

Two message types: a query (``identify``: which site this node is, and the
shape of its model's input and its class count; it builds the site) and
train messages (one or more requests for the site's worker, answered in
order). Under secure aggregation (``deploy.secure_aggregation``) the train
messages of a summed phase are SecAgg+'s: Flower's ``secaggplus_mod`` answers
its key stages itself and hands the work message, whose request rides in a
FitIns config, to the worker; the reply's vectors go back to the mod to be
masked (:mod:`medfed.deploy.secure_aggregation`).

A hospital that wants its updates to leave only masked sets
``require-secure-aggregation=true`` in its node config: the site then
refuses to join a run without secure aggregation (the run ends at the
handshake with one line naming the site) and refuses any non-empty reply
asked for in the clear.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

from flwr.app import Context, Message
from flwr.client.mod import secaggplus_mod
from flwr.clientapp import ClientApp
from flwr.clientapp.typing import ClientAppCallable
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS

from medfed.deploy.records import from_record, to_record
from medfed.deploy.secure_aggregation import FIT_CONFIG, fit_reply, from_fit_config
from medfed.deploy.worker import SiteWorker

NodeOf = Callable[[Context], tuple[int, Path, Path]]
"""Maps a message's context to the node's (site index, data root, state folder of this run)."""

_WORKERS: dict[tuple[int, int], SiteWorker] = {}
"""This process's sites by (run id, site index), the newest run's only."""
RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")
"""A run name: a folder name in each site's state folder, never a path."""


def run_folder(name: str) -> str:
    """``name`` if it is a valid run name (the folder a site keeps the run's state in).

    Raises:
        ValueError: a name that is not letters, digits, ``.``, ``_``, ``-``
            (first a letter or digit, at most 100): the server could
            otherwise point a site outside its state folder.
    """
    if not RUN_NAME.fullmatch(name):
        raise ValueError(f"run name {name!r}: expected letters, digits, '.', '_' or '-' (first a letter or digit, at most 100)")
    return name


def _node(context: Context) -> tuple[int, Path, Path]:
    """(site index, data root, state folder of this run) from the node config."""
    config = context.node_config
    index = int(config["site-index"])
    root = Path(str(config["data-root"]))
    state = Path(str(config.get("state-dir", root.parent / "medfed-state" / f"site{index}")))
    return index, root, state / run_folder(str(context.run_config["run-name"]))


def _worker(context: Context, node_of: NodeOf, config: str) -> SiteWorker:
    """The site's worker: this process's, unless none is here yet or another process answered since (then built anew)."""
    index, root, state = node_of(context)
    key = (context.run_id, index)
    worker = _WORKERS.get(key)
    if worker is None or not worker.current():
        for other in [other for other in _WORKERS if other[0] != context.run_id or other == key]:
            del _WORKERS[other]
        require = str(context.node_config.get("require-secure-aggregation", "false")).lower() == "true"
        _WORKERS[key] = worker = SiteWorker(config, index, root, state, require_secure=require)
    return worker


def secure_aggregation_mod(message: Message, context: Context, call_next: ClientAppCallable) -> Message:
    """Flower's SecAgg+ client mod for the messages of a securely aggregated phase (they carry its record); the
    other messages pass to medfed's handler as they are."""
    if RECORD_KEY_CONFIGS in message.content.config_records:
        return secaggplus_mod(message, context, call_next)
    return call_next(message, context)


def serving(app: ClientApp, node_of: NodeOf) -> ClientApp:
    """``app`` with medfed's two handlers, the node's identity and data taken from the context by ``node_of``."""

    @app.query()
    def identify(message: Message, context: Context) -> Message:
        """Which site this node is and what its model takes (the server maps sites to node ids with it)."""
        fields, _ = from_record(message.content, "the server")
        worker = _worker(context, node_of, fields["config"])
        return Message(to_record({"site_index": worker.site.index, **worker.description}, []), reply_to=message)

    @app.train(mods=[secure_aggregation_mod])
    def train(message: Message, context: Context) -> Message:
        """The server's requests to this site, answered in order by its worker (inside SecAgg+ where the phase is summed)."""
        secure = FIT_CONFIG in message.content.config_records
        fields, wires = from_record(from_fit_config(message.content.config_records[FIT_CONFIG]) if secure else message.content, "the server")
        worker = _worker(context, node_of, fields["config"])
        replies = worker.handle(fields["seq"], list(zip(fields["requests"], wires, strict=True)))
        if secure:  # the work's vectors go to SecAgg+'s mod, to be masked; an error is the site dropping out of the sum
            reply, vectors = replies[-1]
            if "error" in reply:
                raise RuntimeError(reply["error"])
            reply = dict(reply)
            return fit_reply(message, worker.site.index, reply, vectors, reply.pop("weight"))
        reply_fields = {"site_index": worker.site.index, "replies": [reply for reply, _ in replies]}
        return Message(to_record(reply_fields, [wire for _, wire in replies]), reply_to=message)

    return app


app = serving(ClientApp(), _node)
"""medfed's ClientApp on a SuperNode (``[tool.flwr.app.components] clientapp``)."""


def simulation_app(data_roots: list[Path], state_root: Path) -> ClientApp:
    """medfed's ClientApp for Flower's simulation engine (one machine, no ``--node-config``).

    The engine's virtual node with ``partition-id`` i is site i, reading
    ``data_roots[i]`` and keeping its state in ``state_root/site<i>``.
    """

    def node_of(context: Context) -> tuple[int, Path, Path]:
        """Site ``partition-id``, its folder and its state folder."""
        index = int(context.node_config["partition-id"])
        return index, data_roots[index], state_root / f"site{index}"

    return serving(ClientApp(), node_of)
