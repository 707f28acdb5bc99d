"""A run's parts, built one way for every engine: the seeded prototype, the strategy, the sites' slots and the links.

Every engine builds the same parts from a resolved config: the simulator
(:mod:`medfed.experiment`, all sites in one process), a deployed site
(:mod:`medfed.deploy.worker`, one site from its own data), the ServerApp
(:mod:`medfed.deploy.server_app`, no site, one link per site) and the tests'
toy federations. :class:`RunAssembly` holds what they share and builds the
rest, so that a site or a link built by one engine is bit for bit the one
another builds:

* the *prototype*: the model every site copies, initialised under
  ``torch.manual_seed(trainer.seed)`` (the global generator is restored
  afterwards);
* the *strategy* (both halves), told the prototype's shared/personal split,
  its server half the run's ``aggregation`` rule;
* the *Fabric* (:func:`make_fabric`): the device and the precision
  (``trainer.precision``) every site trains and evaluates in;
* a *site*: one copy of the prototype per model slot of the strategy
  (``strategy.prepare_slot``), its forward compiled with ``trainer.compile``,
  each set up with its optimiser by Fabric, and the strategy's site half;
* the *initial values* both ends of every link hold before any message
  (``strategy.initial_values`` of the prototype's ``{"shared", "personal",
  "all"}`` vectors);
* a *link*: the codec pair of ``codec.up`` / ``codec.down`` over the
  strategy's coded keys, starting from the initial values;
* the *loop* (:func:`federated_loop`): the round logic over the run's sites,
  wherever they live, with the config's round, failure and privacy settings.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from lightning.fabric import Fabric

from medfed.components import ResolvedRun
from medfed.config import RunConfig, TrainerConfig
from medfed.data.federation import Federation, SiteData
from medfed.data.pooling import pool_training_data
from medfed.federated import privacy
from medfed.federated.aggregate import Aggregation
from medfed.federated.link import Link
from medfed.federated.loop import FederatedLoop
from medfed.federated.privacy import ClientDP
from medfed.federated.protocol import Payload, StrategyProtocol
from medfed.federated.site import Site, Slot
from medfed.federated.sites import Sites
from medfed.models.base import FederatedModule
from medfed.models.split import PARTS


#: Lightning Fabric's name of each ``trainer.precision``
FABRIC_PRECISION = {"32": "32-true", "bf16-mixed": "bf16-mixed"}


def make_fabric(trainer: TrainerConfig, **kwargs: Any) -> Fabric:
    """The run's Fabric: one ``trainer.device`` in ``trainer.precision`` (``kwargs``: its loggers, callbacks).

    On CUDA at precision ``32``, float32 matrix products and convolutions may use TensorFloat-32 (Ampere and later:
    10-bit mantissas inside, float32 in and out; ``torch.set_float32_matmul_precision("high")``, cuDNN's TF32).
    """
    fabric = Fabric(accelerator=trainer.device, devices=1, precision=FABRIC_PRECISION[trainer.precision], **kwargs)
    if fabric.device.type == "cuda" and trainer.precision == "32":
        torch.set_float32_matmul_precision("high")
        torch.backends.cudnn.allow_tf32 = True
    return fabric


def seeded_prototype(resolved: ResolvedRun, input_shape: tuple[int, ...] | list[int], num_classes: int) -> FederatedModule:
    """The configured model for inputs of ``input_shape`` (channels or features first), initialised from ``trainer.seed``."""
    with torch.random.fork_rng():
        torch.manual_seed(resolved.run.trainer.seed)
        return resolved.model_cls(input_shape[0], num_classes, resolved.model_options, **resolved.task_inputs)


@dataclass
class RunAssembly:
    """What every site and link of one run is built from.

    Attributes:
        prototype: the initial model every site copies.
        strategy: the run's strategy (its site halves and server half).
        codec_up, codec_down: the codec specs of each direction
            (:meth:`~medfed.config.CodecConfig.spec`, e.g. ``{"name": "dense"}``).
        batch_size: the sites' training batch size (``trainer.batch_size``).
        seed: the run's seed (``trainer.seed``): the sites' data orders derive from it.
        model_changes: the layers replaced so that DP-SGD can train the prototype (one line per kind; empty without DP).
        compile: whether each slot module's forward is compiled (``trainer.compile``: ``nn.Module.compile``, in place).
    """

    prototype: FederatedModule
    strategy: StrategyProtocol
    codec_up: dict[str, Any]
    codec_down: dict[str, Any]
    batch_size: int
    seed: int
    model_changes: tuple[str, ...] = ()
    compile: bool = False

    @classmethod
    def from_config(
        cls, resolved: ResolvedRun, input_shape: tuple[int, ...] | list[int], num_classes: int, n_sites: int, dp_compatible: bool = False
    ) -> RunAssembly:
        """The parts of the run ``resolved`` configures, for a model of ``input_shape`` -> ``num_classes`` and ``n_sites`` sites.

        With ``dp_compatible`` the prototype's layers DP-SGD cannot train are replaced before any site copies it
        (:func:`medfed.federated.privacy.dp_compatible`: BatchNorm -> GroupNorm).
        """
        run = resolved.run
        prototype = seeded_prototype(resolved, input_shape, num_classes)
        changes: list[str] = []
        if dp_compatible:
            prototype, changes = privacy.dp_compatible(prototype)
        strategy = resolved.strategy_cls(resolved.strategy_options, prototype.parameter_split, n_sites, run.trainer.seed)
        strategy.server.aggregation = Aggregation(run.aggregation.name, run.aggregation.trim, run.aggregation.norm_bound)
        return cls(
            prototype,
            strategy,
            run.codec.spec("up"),
            run.codec.spec("down"),
            run.trainer.batch_size,
            run.trainer.seed,
            tuple(changes),
            run.trainer.compile,
        )

    def site(self, fabric: Fabric, index: int, data: SiteData) -> Site:
        """Site ``index`` on ``data``: a copy of the prototype per model slot (with its optimiser, set up by ``fabric``), its strategy half."""
        slots = {}
        for name in self.strategy.slots:
            module = copy.deepcopy(self.prototype)
            self.strategy.prepare_slot(name, module)
            if self.compile:
                module.compile()  # its __call__ compiled; parameters, methods and state_dict keys as they were
            slots[name] = Slot(*fabric.setup(module, module.configure_optimizers()))
        return Site(index, data, slots, self.strategy.evaluated_slot, self.strategy.site_half(index), fabric, self.batch_size, self.seed)

    def sites(self, fabric: Fabric, federation: Federation) -> list[Site]:
        """One site per member of ``federation``, in index order.

        For a strategy that ``pools_data`` (the pooled reference) the pool
        site's training split is the union of every site's (:mod:`medfed.data.pooling`).
        """
        members = pool_training_data(federation.sites) if self.strategy.pools_data else federation.sites
        return [self.site(fabric, index, data) for index, data in enumerate(members)]

    def initial_values(self, device: torch.device) -> Payload:
        """The vectors both ends of every link hold before any message, on ``device`` (also the server half's setup input)."""
        return self.strategy.initial_values({part: self.prototype.get_vector(part).to(device) for part in PARTS})

    def link(self, initial: Payload, device: torch.device, peer: str) -> Link:
        """One end of the link with ``peer`` (a site's name), starting from ``initial`` (:meth:`initial_values`)."""
        return Link(self.codec_up, self.codec_down, self.strategy.coded_keys, initial, device, peer=peer)


def federated_loop(
    run: RunConfig,
    fabric: Fabric,
    strategy: StrategyProtocol,
    sites: Sites,
    initial: Payload,
    save_checkpoint: Callable[[dict[str, Any]], Any] | None = None,
    scratch_dir: Path | None = None,
) -> FederatedLoop:
    """The run's loop over ``sites`` (in this process or on SuperNodes) as ``run`` configures it, for either engine.

    ``trainer.local_epochs`` and ``seed``, ``federation.participation``, ``on_site_failure``,
    ``update_norm_limit`` and ``max_consecutive_failures``, and ``privacy.client_dp``; the engine adds where
    its checkpoints go (``save_checkpoint``) and the participants' start-of-round states (``scratch_dir``).
    """
    federation = run.federation
    return FederatedLoop(
        fabric,
        strategy,
        sites,
        initial,
        local_epochs=run.trainer.local_epochs,
        participation=federation.participation,
        seed=run.trainer.seed,
        save_checkpoint=save_checkpoint,
        on_site_failure=federation.on_site_failure,
        update_norm_limit=federation.update_norm_limit,
        max_consecutive_failures=federation.max_consecutive_failures,
        scratch_dir=scratch_dir,
        client_dp=ClientDP(run.privacy.client_dp, run.trainer.seed) if run.privacy.client_dp.enabled else None,
    )
