"""Simulated hostile sites, FOR EVALUATION ONLY: the ``attack`` config group, to measure an ``aggregation`` rule.

A hospital that wants to spoil a federation sends plausible updates of the
right shape: scaled up, sign-flipped, or noise of an honest norm. medfed's
simulator can play such a site so that a robust rule
(:mod:`medfed.federated.aggregate`) can be measured against it, seeded and
declared in the run's config (and so in its results.json): with
``attack.sites: [4]``, site 4 trains honestly, then replaces the update
``u = x - r`` of each model vector it replies with (a key of the strategy's
``coded_keys``; ``r`` is the value it last received under that key, the
model it started from) by

* ``scale``: ``factor * u`` (Bagdasaryan et al.'s model replacement, AISTATS 2020, without the backdoor);
* ``sign_flip``: ``-u``, of the honest norm (norm bounding cannot tell it);
* ``gaussian``: ``||u|| z / ||z||``, z ~ N(0, I) drawn from (run seed, site, round, phase): noise of the honest norm.

Sample counts, buffers and every other entry are left as they are. Only the
simulator plays it (:class:`~medfed.federated.executor.InProcessSites`); a
deployment's sites are real hospitals and a run config with hostile sites
is refused there. Nothing here is a defence: it is the adversary the tables
of docs/robust.md are measured against.
"""

from __future__ import annotations

import numpy as np
import torch

from medfed.config import AttackConfig
from medfed.federated.link import coded_prefix
from medfed.federated.protocol import DELIVER, Payload, RoundContext, ServerHalfProtocol

ATTACK_STREAM = 0xA77AC
"""The stream tag of the ``gaussian`` attack's draws, beside the site's other draws from (seed, site, round, phase)."""


class Attack:
    """The hostile sites of a simulated run: each remembers what it received, and alters its replies (module docstring).

    Args:
        config: the run's ``attack`` group.
        coded_keys: the strategy's model-vector keys (``Strategy.coded_keys``): the replies' entries that are altered.
        seed: the run's seed (the ``gaussian`` draws').
    """

    def __init__(self, config: AttackConfig, coded_keys: dict[str, str], seed: int) -> None:
        self.config = config
        self.coded_keys = coded_keys
        self.seed = seed
        self.received: dict[int, dict[str, torch.Tensor]] = {index: {} for index in config.sites}

    def receive(self, index: int, payload: Payload) -> None:
        """A hostile site ``index`` received ``payload`` (a phase's message or a delivery): its model vectors are the
        references its next updates are taken from."""
        if index in self.received:
            self.received[index].update({key: value.detach().clone() for key, value in payload.items() if self._model_vector(key)})

    def resume(self, server: ServerHalfProtocol, round_index: int) -> None:
        """After a resume from round ``round_index``'s checkpoint: each hostile site's references are what the server
        delivered at that round's end (as client-level DP measures its next updates; exact under a lossless codec)."""
        ctx = RoundContext(round_index, DELIVER)
        for index in self.received:
            self.receive(index, server.deliver(ctx, index))

    def reply(self, index: int, round_index: int, phase_index: int, reply: Payload) -> Payload:
        """Site ``index``'s reply as it sends it: altered where the site is hostile.

        Raises:
            ValueError: a model vector in a hostile reply with no received value to take the update from (the attack
                would otherwise silently be none).
        """
        if index not in self.received:
            return reply
        altered = dict(reply)
        for key, value in reply.items():
            if not self._model_vector(key) or value.numel() == 0:
                continue
            reference = self.received[index].get(key)
            if reference is None or reference.shape != value.shape:
                raise ValueError(f"attack: site{index}'s reply {key!r} has no value received under that key to take its update from")
            update = value - reference.to(value.device)
            altered[key] = reference.to(value.device) + self._altered(update, index, round_index, phase_index)
        return altered

    def _altered(self, update: torch.Tensor, index: int, round_index: int, phase_index: int) -> torch.Tensor:
        kind = self.config.kind
        if kind == "scale":
            return update * self.config.factor
        if kind == "sign_flip":
            return -update
        generator = torch.Generator(device="cpu").manual_seed(
            int(np.random.SeedSequence([self.seed, index, round_index, phase_index, ATTACK_STREAM]).generate_state(1)[0])
        )
        direction = torch.randn(update.shape, generator=generator, dtype=torch.float64, device="cpu")
        scale = torch.linalg.vector_norm(update.double().cpu()) / torch.linalg.vector_norm(direction)
        return (direction * scale).to(update.dtype).to(update.device)

    def _model_vector(self, key: str) -> bool:
        return coded_prefix(key, self.coded_keys) is not None
