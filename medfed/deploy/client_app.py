"""The ClientApp: one hospital's site, run by its SuperNode on its own data.

The node's identity and data come from the SuperNode's ``--node-config``,
never from the server: ``site-index`` (0-based), ``data-root`` (the folder
the task's ``build_site`` reads) and, optionally, ``state-dir`` (where the
site keeps its state between messages; default
``<data-root>/../medfed-state/site<index>``). The server sends the run's
config with the setup request; every request is answered by
:class:`~medfed.deploy.worker.SiteWorker`.
"""

from __future__ import annotations

from pathlib import Path

from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp

from medfed.deploy.records import from_record, to_record
from medfed.deploy.worker import SiteWorker

app = ClientApp()


def _node(context: Context) -> tuple[int, Path, Path]:
    """(site index, data root, state folder of this run) from the node config."""
    config = context.node_config
    index = int(config["site-index"])
    root = Path(str(config["data-root"]))
    state = Path(str(config.get("state-dir", root.parent / "medfed-state" / f"site{index}")))
    return index, root, state / str(context.run_config["run-name"])


@app.query()
def identify(message: Message, context: Context) -> Message:
    """Which site this node is (the server maps sites to Flower node ids with it)."""
    index, _, _ = _node(context)
    return Message(RecordDict({"site": ConfigRecord({"site-index": index})}), reply_to=message)


@app.train()
def train(message: Message, context: Context) -> Message:
    """Setup, a phase's work or a delivery (``fields["kind"]``), answered by the site's worker."""
    index, root, state = _node(context)
    fields, wire = from_record(message.content)
    worker = SiteWorker(fields.pop("config"), index, root, state)
    reply, reply_wire = worker.handle(fields, wire)
    return Message(to_record({**reply, "site_index": index}, reply_wire), reply_to=message)
