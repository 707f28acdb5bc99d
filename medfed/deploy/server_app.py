"""The ServerApp: a medfed strategy's server half and the loop's round logic, the sites on Flower SuperNodes.

Run config (``[tool.flwr.app.config]`` in pyproject.toml, ``flwr run
--run-config``): ``config`` (a medfed config file or bundled name),
``overrides`` (space-separated ``key=value``, as the CLI's), ``run-name``
(the sites key their state by it), ``output-dir`` (the server's
results.json and checkpoints), ``resume`` (continue from the newest
checkpoint there), ``reply-timeout-s``.

The round logic is :class:`~medfed.federated.loop.FederatedLoop`'s, the
simulator's own; :class:`FlowerSites` is its executor: it codes every
message with the server's end of each site's
:class:`~medfed.federated.link.Link` and sends it to the node that
identified itself as that site. Sites are matched to Flower node ids by a
query each node answers with its ``site-index``; a node that appears later
(a SuperNode restarted after a crash gets a new id) is asked too, and the
messages still waiting for its site are sent to it.
"""

from __future__ import annotations

import shlex
import time
from pathlib import Path
from typing import Any

import torch
from flwr.app import Context, Message, RecordDict
from flwr.serverapp import Grid, ServerApp
from lightning.fabric import Fabric

from medfed.checkpoint import FOLDER, resume_state, save_checkpoint
from medfed.components import resolve
from medfed.config import load_config, to_yaml
from medfed.deploy.records import from_record, to_record
from medfed.federated.executor import PhaseWork, SiteResult
from medfed.federated.link import Link, Wire
from medfed.federated.loop import FederatedLoop
from medfed.federated.strategies.base import Payload
from medfed.models.split import PARTS
from medfed.results import communication_totals, write_json_atomic

app = ServerApp()
POLL_S = 0.5


class FlowerSites:
    """The loop's site executor for a deployment: every site on its own SuperNode.

    Args:
        grid: the run's Grid (messages to and from the SuperNodes).
        n_sites: the federation's sites; this many nodes must identify themselves.
        config_yaml: the resolved run config, sent with every request.
        timeout_s: how long one exchange may wait for a site's reply.
    """

    def __init__(self, grid: Grid, n_sites: int, config_yaml: str, timeout_s: float) -> None:
        self.grid = grid
        self.names = [f"site{index}" for index in range(n_sites)]
        self.config_yaml = config_yaml
        self.timeout_s = timeout_s
        self.links: list[Link] = []
        self.node_of_site: dict[int, int] = {}
        self._known_nodes: set[int] = set()
        self.seq = [0] * n_sites
        self._waiting: dict[int, dict[str, Wire]] = {}
        self._setup_wires: dict[int, dict[str, Wire]] = {}
        self._restore: set[int] = set()

    # ------------------------------------------------------------------ before the loop
    def handshake(self) -> dict[str, Any]:
        """Find every site's node, send the setup request; returns the sites' common description.

        Returns:
            ``{"input_shape", "num_classes"}`` as the sites report them.

        Raises:
            RuntimeError: the sites describe different models, or not every
                site answered within ``timeout_s``.
        """
        deadline = time.monotonic() + self.timeout_s
        while len(self.node_of_site) < len(self.names):
            self._identify_new_nodes()
            if time.monotonic() > deadline:
                missing = sorted(set(range(len(self.names))) - set(self.node_of_site))
                raise RuntimeError(f"sites {missing} did not join within {self.timeout_s} s")
            time.sleep(POLL_S)
        replies = self._exchange({index: ({"kind": "setup"}, {}) for index in range(len(self.names))}, round_index=0)
        descriptions = {index: (tuple(fields["input_shape"]), fields["num_classes"]) for index, (fields, _) in replies.items()}
        if len(set(descriptions.values())) != 1:
            raise RuntimeError(f"the sites describe different models (input shape, classes): {descriptions}")
        self._setup_wires = {index: wire for index, (_, wire) in replies.items()}
        shape, classes = descriptions[0]
        return {"input_shape": shape, "num_classes": classes}

    # ------------------------------------------------------------------ SiteExecutor
    def setup(self) -> dict[int, Payload]:
        wires, self._setup_wires = self._setup_wires, {}
        return {index: self.links[index].decode("up", wire) for index, wire in wires.items()}

    def open_round_starts(self, directory: Path | None) -> None:
        """Nothing here: each site keeps its own start-of-round state."""

    def close_round_starts(self) -> None:
        """Nothing here: each site keeps its own start-of-round state."""

    def save_round_start(self, participants: list[int]) -> None:
        self._restore.clear()

    def restore_round_start(self, index: int) -> None:
        self._restore.add(index)  # told with the round's delivery

    def work(self, work: PhaseWork, messages: dict[int, Payload], timing: dict[str, float]) -> dict[int, SiteResult]:
        request = {"kind": "work", "round": work.round_index, "phase_index": work.phase_index, "phase": work.phase,
                   "local_epochs": work.local_epochs, "norms": work.norms}
        wires = {index: self.links[index].encode("down", payload) for index, payload in messages.items()}
        replies = self._exchange({index: (request, wire) for index, wire in wires.items()}, work.round_index)
        results = {}
        for index, (fields, wire) in replies.items():
            if "error" in fields:
                results[index] = SiteResult(error=fields["error"])
                continue
            timing["train_s"] += fields["train_s"]
            losses = {(label or None): loss for label, loss in fields["losses"].items()}
            results[index] = SiteResult(losses=losses, non_finite=fields["non_finite"], norms=fields["norms"])
            self._waiting[index] = wire
        return results

    def replies(self, accepted: list[int]) -> dict[int, Payload]:
        waiting, self._waiting = self._waiting, {}
        return {index: self.links[index].decode("up", waiting[index]) for index in accepted}

    def deliver(
        self, round_index: int, payloads: dict[int, Payload], evaluate: bool, timing: dict[str, float] | None
    ) -> dict[str, dict[str, float]]:
        tic = time.perf_counter()
        requests = {
            index: ({"kind": "deliver", "restore": index in self._restore, "evaluate": evaluate}, self.links[index].encode("down", payload))
            for index, payload in payloads.items()
        }
        replies = self._exchange(requests, round_index)
        if not evaluate:
            return {}
        if timing is not None:
            timing["eval_s"] = time.perf_counter() - tic
        return {self.names[index]: replies[index][0]["metrics"] for index in sorted(replies)}

    def state_dict(self) -> list[dict[str, Any]]:
        """Each site's message count (the sites keep their own state)."""
        return [{"seq": seq} for seq in self.seq]

    def load_state_dict(self, state: list[dict[str, Any]]) -> None:
        self.seq = [entry["seq"] for entry in state]

    # ------------------------------------------------------------------ messages
    def _identify_new_nodes(self) -> None:
        """Ask every node not seen before which site it is; a site's newest node replaces its old one."""
        new = set(self.grid.get_node_ids()) - self._known_nodes
        if not new:
            return
        queries = [Message(RecordDict(), dst_node_id=node, message_type="query") for node in sorted(new)]
        for reply in self.grid.send_and_receive(queries, timeout=self.timeout_s):
            if reply.has_error():
                continue
            self._known_nodes.add(reply.metadata.src_node_id)
            self.node_of_site[int(reply.content["site"]["site-index"])] = reply.metadata.src_node_id

    def _exchange(
        self, requests: dict[int, tuple[dict[str, Any], dict[str, Wire]]], round_index: int
    ) -> dict[int, tuple[dict[str, Any], dict[str, Wire]]]:
        """Send each site its request and wait for every reply, resending to a site's new node if one appears.

        Raises:
            RuntimeError: a site did not answer within ``timeout_s``, or answered with a Flower error.
        """
        content = {}
        for index, (fields, wire) in requests.items():
            self.seq[index] += 1
            content[index] = to_record({**fields, "seq": self.seq[index], "config": self.config_yaml}, wire)
        sent: dict[int, tuple[int, str]] = {}  # site -> (node, message id)

        def push(indices: list[int]) -> None:
            messages = [
                Message(content[index], dst_node_id=self.node_of_site[index], message_type="train", group_id=str(round_index))
                for index in indices
            ]
            for index, message_id in zip(indices, self.grid.push_messages(messages), strict=True):
                sent[index] = (self.node_of_site[index], message_id)

        push(sorted(requests))
        replies: dict[int, tuple[dict[str, Any], dict[str, Wire]]] = {}
        deadline = time.monotonic() + self.timeout_s
        while len(replies) < len(requests):
            site_of_message = {message_id: index for index, (_, message_id) in sent.items() if index not in replies}
            for reply in self.grid.pull_messages(list(site_of_message)):
                index = site_of_message[reply.metadata.reply_to_message_id]
                if reply.has_error():
                    raise RuntimeError(f"{self.names[index]}: {reply.error.reason}")
                replies[index] = from_record(reply.content)
            if len(replies) == len(requests):
                break
            self._identify_new_nodes()
            moved = [index for index, (node, _) in sent.items() if index not in replies and self.node_of_site[index] != node]
            if moved:
                push(moved)
            if time.monotonic() > deadline:
                missing = [self.names[index] for index in requests if index not in replies]
                raise RuntimeError(f"no reply from {', '.join(missing)} within {self.timeout_s} s (round {round_index})")
            time.sleep(POLL_S)
        return replies


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Build the server half from the run config, run the rounds, write results.json and a checkpoint per round."""
    run_config = context.run_config
    cfg = load_config(str(run_config["config"]), shlex.split(str(run_config["overrides"])))
    resolved = resolve(cfg)
    config, run = resolved.config, resolved.run
    trainer = run.trainer
    if trainer.num_threads is not None:
        torch.set_num_threads(trainer.num_threads)
    output_dir = Path(str(run_config["output-dir"]))
    resumed = resume_state(output_dir, config) if bool(run_config["resume"]) else None
    started = time.perf_counter()

    sites = FlowerSites(grid, run.federation.n_sites, to_yaml(config), float(run_config["reply-timeout-s"]))
    described = sites.handshake()
    with torch.random.fork_rng():
        torch.manual_seed(trainer.seed)
        prototype = resolved.model_cls(described["input_shape"][0], described["num_classes"], resolved.model_options)
    strategy = resolved.strategy_cls(resolved.strategy_options, prototype.parameter_split, run.federation.n_sites, trainer.seed)
    fabric = Fabric(accelerator=trainer.device, devices=1)
    initial = {part: prototype.get_vector(part).to(fabric.device) for part in PARTS}
    sites.links = [
        Link(run.codec.spec("up"), run.codec.spec("down"), strategy.coded_keys, initial, fabric.device) for _ in sites.names
    ]
    loop = FederatedLoop(
        fabric, [], strategy, sites.links, initial, local_epochs=trainer.local_epochs,
        participation=run.federation.participation, seed=trainer.seed,
        save_checkpoint=lambda state: save_checkpoint(output_dir / FOLDER, {**state, "config": config}, trainer.keep_checkpoints),
        on_site_failure=run.federation.on_site_failure, update_norm_limit=run.federation.update_norm_limit,
        max_consecutive_failures=run.federation.max_consecutive_failures, executor=sites,
    )
    if resumed is not None:
        loop.load_state_dict(resumed)
    loop.fit(trainer.rounds, progress=lambda record: print(f"medfed round {record['round']}: {record['mean']}", flush=True))
    results = {
        "strategy": strategy.name,
        "seed": trainer.seed,
        "engine": "flower-deployment",
        "final": loop.history[-1]["metrics"],
        "communication": communication_totals(sites.links),
        "wall_s": time.perf_counter() - started,
        "config": config,
        "history": loop.history,
    }
    write_json_atomic(output_dir / "results.json", results)
    print(f"medfed: wrote {output_dir / 'results.json'}", flush=True)
