"""A deployed site's half of the work, one message at a time (the ClientApp's logic, without flwr).

A :class:`SiteWorker` builds the site from the run's config and the node's
own data (``build_site`` of the task: :mod:`medfed.tasks`), loads the site's
state from its state folder if one is there, and then answers message after
message: it does what the message asks and saves the state again
(atomically) before it replies. The ClientApp keeps the worker in memory
between the messages of a run (:mod:`medfed.deploy.runner` keeps one process
alive for them); the state folder stays the source of truth: a worker whose
state file another process has replaced since (:meth:`SiteWorker.current`)
is built again from it, and a SuperNode killed and restarted with the same
node config (``--node-config state-dir=...``) finds it and rejoins where it
stopped. A message it has already answered (the server resends when a node
goes away) is answered again from the saved reply, never worked twice.

*End-of-round snapshots.* After each round's delivery (and evaluation) the
worker writes the site's whole state, its modules, optimisers, data-order
generators and strategy half, and its end of the link (codec known values
and residuals), as ``<state folder>/rounds/round-<r>.ckpt`` with
:func:`~medfed.checkpoint.save_checkpoint` (atomic, SHA-256 trailer), keeping
the newest ``trainer.keep_checkpoints + 1``: the rounds the server keeps
checkpoints of, and one more, for a server that died after the sites
finished a round but before it checkpointed it. The start of round r is the
end of round r - 1, so the same files put a site that fails in round r
back (its link to where it stood before its reply). A resumed server
(:mod:`medfed.deploy.server_app`, ``resume=true``) sends a ``rewind`` to its
checkpoint's round r: the site loads its snapshot of round r and forgets the
later ones; a site without an intact snapshot of round r (or one written
with another config) answers with an error naming the round.

What the site sends back: codec streams of its strategy half's replies
(coded by its own end of the :class:`~medfed.federated.link.Link`; in a
securely aggregated phase its reply's vectors instead, which medfed's
ClientApp hands to SecAgg+ to be masked:
:mod:`medfed.deploy.secure_aggregation`), its
training losses, the names of non-finite reply keys (a reply it refuses to
send), the samples it passed (compute, in epochs of its training data), its
test metrics (and validation metrics, where it has a validation split), and, once, its model's input shape, class count and
training-set size (the bound of the sample counts it may report), the size
of the split it evaluates on and whether its data are generated (what
results.json says of the federation). Never a path, a record or a sample. The server checks all of it (:mod:`medfed.deploy.server_app`); the
site reports no update norm: the server measures them on what it decoded.

Requests and replies are plain dicts (``kind`` and scalars) plus wires
(``{key: (shape, bytes)}``); :mod:`medfed.deploy.records` carries them in
Flower records.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader

from medfed.assembly import RunAssembly, make_fabric
from medfed.atomic import atomic_write
from medfed.checkpoint import checkpoints, config_differences, read_checkpoint, save_checkpoint
from medfed.components import resolve
from medfed.config import load_config
from medfed.errors import DataError
from medfed.federated.site_work import PhaseWork, site_delivery, site_evaluation, site_phase, site_setup
from medfed.federated.link import Wire
from medfed.federated.protocol import Payload

STATE_FILE = "site-state.pt"
SNAPSHOTS = "rounds"
"""The folder of the site's end-of-round snapshots inside its state folder."""


class SiteWorker:
    """One deployed site, built from its own data and its saved state, answering the server's messages.

    Args:
        config_yaml: the run's resolved config (YAML text, from the server).
        site_index: this node's site (its ``--node-config site-index``).
        data_root: this node's data (``data-root``), read by the task's ``build_site``.
        state_dir: where this node keeps the site's state for this run (created).
        require_secure: the hospital's ``require-secure-aggregation``: the site joins only runs with
            ``deploy.secure_aggregation`` and sends no non-empty reply outside SecAgg+.

    Raises:
        ConfigError: the config is invalid, or no site can build itself alone under it (a ``federation.label_ratio``).
        ValueError: ``require_secure`` and a run without secure aggregation.
        DataError: the site's data (from the task's reader).
    """

    def __init__(self, config_yaml: str, site_index: int, data_root: Path, state_dir: Path, require_secure: bool = False) -> None:
        Path(state_dir).mkdir(parents=True, exist_ok=True)
        config_path = Path(state_dir) / "config.yaml"
        with atomic_write(config_path) as handle:
            handle.write(config_yaml)
        resolved = resolve(load_config(config_path))
        run = resolved.run
        if require_secure and not run.deploy.secure_aggregation:
            raise ValueError(f"site{site_index} takes part only in runs with secure aggregation (its node config "
                             "require-secure-aggregation=true); this run has deploy.secure_aggregation=false")
        if run.trainer.num_threads is not None:
            torch.set_num_threads(run.trainer.num_threads)
        federation = resolved.task.build_site(
            resolved.data_options, run.federation, run.trainer.seed, site_index, Path(data_root), progress=False,
            **resolved.task_inputs,
        )
        assembly = RunAssembly.from_config(resolved, federation.input_shape, federation.num_classes, run.federation.n_sites)
        fabric = make_fabric(run.trainer)
        self.site = assembly.site(fabric, site_index, federation.sites[0])
        validation = self.site.data.validation  # evaluated as the simulator's ValidationEvaluation does (medfed.evaluation.rounds)
        self.validation_loader = None if validation is None else DataLoader(validation, batch_size=self.site.test_loader.batch_size, shuffle=False)
        self.link = assembly.link(assembly.initial_values(fabric.device), fabric.device, peer=f"site{site_index}")
        self.config = resolved.config
        self.secure_sums = resolved.strategy_cls.secure_sums
        self.require_secure = require_secure
        self.snapshots = Path(state_dir) / SNAPSHOTS
        self.keep = run.trainer.keep_checkpoints + 1
        self.description = {
            "input_shape": list(federation.input_shape), "num_classes": federation.num_classes, "num_samples": self.site.n_train,
            "num_evaluated": self.site.n_test, "generated": federation.generated,
        }
        self.state_path = Path(state_dir) / STATE_FILE
        self.state: dict[str, Any] = {"seq": -1}
        if self.state_path.is_file():
            self.state = torch.load(self.state_path, map_location="cpu", weights_only=True)
            self.site.load_state_dict(self.state["site"])
            self.link.load_state_dict(self.state["link"])
        self._stamp = _stamp(self.state_path)

    def current(self) -> bool:
        """Whether the state file is still the one this worker last read or wrote (no other process answered since)."""
        return _stamp(self.state_path) == self._stamp

    def handle(self, seq: int, requests: list[tuple[dict[str, Any], dict[str, Wire]]]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
        """Answer one message's requests in order: each one's ``(reply fields, reply wire)``; the state is saved once, before returning.

        (A securely aggregated phase's work reply holds its plain vectors in place of the wire: :meth:`_unmasked`.)

        A request's ``kind``: ``setup`` (the strategy half's setup reply),
        ``work`` (a phase: receive, train, reply), ``deliver`` (receive the
        round's delivery, evaluate if asked, snapshot the round's end) or
        ``rewind`` (back to the end of a round, alone in its message).
        ``seq`` numbers the server's messages to this site: the last one
        answered again (the server resent it to this site's new node) is
        answered from the saved replies. A rewind is answered whatever its
        ``seq``: a resumed server numbers its messages from its checkpoint,
        and the site may have answered later ones; it counts on from there.

        Raises:
            ValueError: an unknown ``kind``, or a message older than the last answered.
        """
        rewind = requests[0][0]["kind"] == "rewind"
        if seq == self.state["seq"] and not rewind:
            return self.state["replies"]
        if seq < self.state["seq"] and not rewind:
            raise ValueError(f"message {seq} to site {self.site.index} is older than the last one it answered ({self.state['seq']})")
        replies = []
        for request, wire in requests:
            kind = request["kind"]
            if kind == "rewind":
                replies.append((self._rewind(request["round"]), {}))
            elif kind == "setup":
                replies.append(({}, self.link.encode("up", site_setup(self.site))))
            elif kind == "work":
                replies.append(self._work(request, wire))
            elif kind == "deliver":
                replies.append((self._deliver(request, wire), {}))
            else:
                raise ValueError(f"unknown request kind {kind!r}")
        self.state.update(seq=seq, replies=replies, site=self.site.state_dict(), link=self.link.state_dict())
        with atomic_write(self.state_path, "wb") as handle:
            torch.save(self.state, handle)
        self._stamp = _stamp(self.state_path)
        return replies

    def _work(self, request: dict[str, Any], wire: dict[str, Wire]) -> tuple[dict[str, Any], dict[str, Any]]:
        """Receive, train, reply; the reply is coded now (the server decodes it only if it accepts it), or, for a
        securely aggregated phase (``request["secure"]``), kept as plain vectors for SecAgg+ to mask (:meth:`_unmasked`)."""
        fields, reply = self._train(request, wire)
        if reply is None:
            return fields, {}
        if fields["non_finite"]:  # refused: in the clear the server names the keys; in a sum the site drops out
            return ({"error": f"site{self.site.index}: non-finite reply {fields['non_finite']}"} if request.get("secure") else fields), {}
        if request.get("secure"):
            return self._unmasked(request, fields, reply)
        if self.require_secure and reply:
            return {"error": f"site{self.site.index} sends its replies only under secure aggregation "
                             "(its node config require-secure-aggregation=true), and this one was asked in the clear"}, {}
        return fields, self.link.encode("up", reply)

    def _train(self, request: dict[str, Any], wire: dict[str, Wire]) -> tuple[dict[str, Any], Payload | None]:
        """Receive the server's message, train the phase; the reply's fields and its payload (None: the work raised)."""
        work = PhaseWork(request["round"], request["phase_index"], request["phase"], request["local_epochs"])
        message = self.link.decode("down", wire)
        self.state["link_before_reply"] = copy.deepcopy(self.link.state_dict())
        timing: dict[str, float] = {}
        result, reply = site_phase(self.site, work, message, timing)
        if result.error is not None:  # whatever it is, it happened at the site: the site fails
            return {"error": result.error}, None
        fields = {
            "losses": {("" if label is None else label): loss for label, loss in result.losses.items()},
            "non_finite": result.non_finite,
            "compute": result.compute,
            "train_s": timing["train_s"],
        }
        return fields, reply

    def _unmasked(self, request: dict[str, Any], fields: dict[str, Any], reply: Payload) -> tuple[dict[str, Any], dict[str, Any]]:
        """A securely aggregated phase's reply for SecAgg+ (:mod:`medfed.deploy.secure_aggregation`): its vectors as
        float32 CPU tensors, its weight in ``fields["weight"]``; never coded by the link (masking needs dense values).

        A site whose weighted vector SecAgg+ would clip (an entry of ``weight / max_weight * x`` outside
        ``[-clipping_range, clipping_range]``) sends an error instead: a clipped vector would bias the sum unseen.
        Seeds numpy's global generator, which SecAgg+'s stochastic rounding draws from, from the run's seed, the site,
        the round and the phase.
        """
        summed = self.secure_sums[request["phase"]]
        weight = 1 if summed.weight is None else int(float(reply.pop(summed.weight).reshape(-1)[0]))
        vectors = {key: value.detach().to("cpu", torch.float32) for key, value in reply.items()}
        largest = max((float(vector.abs().max()) for vector in vectors.values() if vector.numel()), default=0.0)
        reach = largest * weight / request["max_weight"]
        if reach > request["clipping_range"]:
            return {"error": f"site{self.site.index}: its weighted reply reaches {reach:.4g}, outside SecAgg+'s clipping range "
                             f"+-{request['clipping_range']:g} (deploy.clipping_range); it sends no clipped vector"}, {}
        entropy = [self.config["trainer"]["seed"], self.site.index, request["round"], request["phase_index"], 0x5EC]
        np.random.seed(np.random.SeedSequence(entropy).generate_state(1)[0])
        return {**fields, "weight": weight}, vectors

    def _deliver(self, request: dict[str, Any], wire: dict[str, Wire]) -> dict[str, Any]:
        """Put the site back to the round's start first if it failed this round, receive the delivery, adapt and evaluate
        if asked (on its validation split too, where it has one), snapshot the end of the round."""
        round_index = request["round"]
        if request["restore"]:
            self.site.load_state_dict(read_checkpoint(self._snapshot(round_index - 1))["sites"][0])
            self.link.load_state_dict(self.state["link_before_reply"])
        site_delivery(self.site, round_index, self.link.decode("down", wire))
        fields = {}
        if request["evaluate"]:  # the adapt step, then the evaluation
            evaluation = site_evaluation(self.site, round_index)
            fields = {
                "metrics": evaluation.metrics,
                "compute": evaluation.compute,
                "adapt_losses": {("" if label is None else label): loss for label, loss in evaluation.adapt_losses.items()},
                "adapt_error": evaluation.adapt_error,
                "validation": {} if self.validation_loader is None else self.site.evaluate(self.validation_loader),
            }
        snapshot = {"round": round_index, "config": self.config, "sites": [self.site.state_dict()], "links": [self.link.state_dict()]}
        save_checkpoint(self.snapshots, snapshot, self.keep)
        return fields

    def _rewind(self, round_index: int) -> dict[str, Any]:
        """Put the site and its end of the link back to the end of round ``round_index``, forget the later snapshots.

        Returns:
            ``{}``, or ``{"error": ...}`` (naming the site and the round) when
            the site has no intact snapshot of that round written with this
            config; the site is then left as it was.
        """
        path = self._snapshot(round_index)
        cannot = f"site{self.site.index} cannot go back to the end of round {round_index}"
        found = {int(file.stem.split("-")[1]): file for file in checkpoints(self.snapshots)}
        kept = list(found)
        if not path.is_file():
            return {"error": f"{cannot}: its state folder keeps the ends of rounds {kept or 'none'}"}
        try:
            snapshot = read_checkpoint(path)
        except DataError:
            return {"error": f"{cannot}: its snapshot of that round is damaged (it fails its SHA-256 check or cannot be read)"}
        changed = config_differences(snapshot["config"], self.config)
        if changed:
            return {"error": f"{cannot}: its snapshot was written with another config (at {', '.join(changed)})"}
        self.site.load_state_dict(snapshot["sites"][0])
        self.link.load_state_dict(snapshot["links"][0])
        for number, file in found.items():
            if number > round_index:
                file.unlink()
        self.state = {"seq": -1}
        return {}

    def _snapshot(self, round_index: int) -> Path:
        """The file of the site's snapshot of the end of round ``round_index``."""
        return self.snapshots / f"round-{round_index}.ckpt"


def _stamp(path: Path) -> tuple[int, int, int] | None:
    """(inode, size, modification time) of ``path``, None if it does not exist: an atomic write always changes it."""
    try:
        stat = path.stat()
    except FileNotFoundError:
        return None
    return stat.st_ino, stat.st_size, stat.st_mtime_ns
