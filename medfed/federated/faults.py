"""What the loop does about a failing site: the checks on a reply, and the state it puts back.

A participant *fails* in a phase of a round when

1. its part of the phase raises (receiving the server's message, local
   training, e.g. a loss that became NaN, or making its reply);
2. its reply holds a NaN or an infinity (any entry, sample counts included);
3. its reply is an *update outlier*: for some model-vector key its update
   norm exceeds ``update_norm_limit`` times the median of that key's update
   norms over the phase's replies (the failing one included; a median of 0
   flags nothing). With two replies the median is their mean, which no norm
   exceeds twice: the check needs three or more participants to single one out.

The *update* of a reply entry carrying a model vector (a ``coded_keys``
entry) is the entry minus the same part of the site's model as it stood
after receiving the phase's message, i.e. what it trained from (FedAvg: the
model it was sent; FedAMP: its cloud model; APPLE's "core/i": its own core
model; pFedNet: the part it trains this phase). An entry declared against
zeros (PGFed's "gradient") has no such model: its update is the entry itself.
:func:`update_norms` measures it; the site's starting vectors are copied for
the site in progress only, so the check keeps nothing per site.

Checks 2 and 3 run on the reply before it is encoded, so a refused reply
never crosses the link: neither end's link state changes, exactly as for a
site that did not reply. The server's message of the phase did reach the
site (its bytes count; a lossy codec's known value K holds it at both
ends), as a message reaches a site that then skips its reply: the link
stays consistent. The server aggregates the phase without the site, and the
site takes no further part in the round (``federation.on_site_failure:
drop``); it is then put back to its state at the start of the round (module,
optimiser, data order, strategy state) and receives the round's delivery like
a site that did not take part. ``stop`` raises :class:`~medfed.errors.SiteFailure`
instead, before the round is checkpointed.

*Where the start-of-round state is kept.* Each participant's state (module,
optimiser, data order, strategy state) is copied to the CPU as the round
starts and dropped when the next round starts: a memory copy, nothing
written (writing them was 98 MB a round for brats_lack0's five U-Nets with
Adam, 2.9 GB in a 30-round run, to be read back only for a site that
fails). :class:`RoundStartStates` keeps the copies in memory up to a budget
(by default a quarter of the memory available when the loop opens them)
and writes only those beyond it to disk (``torch.save`` streams tensor by
tensor, no second copy in memory), so a federation whose sites do not fit
twice in memory still runs; the folder is made at the first such write.
"""

from __future__ import annotations

import copy
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from medfed.federated.link import ZEROS, coded_prefix
from medfed.federated.strategies.base import Payload

if TYPE_CHECKING:
    from medfed.federated.site import Site


def non_finite_keys(payload: Payload) -> list[str]:
    """The keys of ``payload`` whose tensor holds a NaN or an infinity."""
    return [key for key, value in payload.items() if not bool(torch.isfinite(value).all())]


def model_parts(coded_keys: dict[str, str]) -> set[str]:
    """The parts of the model (``"all"``, ``"shared"`` ...) that coded payload entries carry."""
    return {name for name in coded_keys.values() if name != ZEROS}


def update_norms(reply: Payload, start: dict[str, torch.Tensor], coded_keys: dict[str, str]) -> dict[str, float]:
    """The norm of each model-vector entry's update, by ``coded_keys`` prefix (APPLE's "core/i" under "core").

    Args:
        reply: the site's reply.
        start: ``{part: vector}``, the site's model parts when it started to train (:func:`model_parts`).
        coded_keys: the strategy's ``coded_keys``.

    Returns:
        ``{prefix: ||entry - start[part]||_2}`` (``||entry||`` for a key
        declared against zeros); other and empty entries are not measured.
    """
    norms = {}
    for key, value in reply.items():
        prefix = coded_prefix(key, coded_keys)
        if prefix is None or value.numel() == 0:
            continue
        part = coded_keys[prefix]
        update = value if part == ZEROS else value - start[part].to(value)
        norms[prefix] = float(torch.linalg.vector_norm(update.reshape(-1), dtype=torch.float64))
    return norms


def update_outliers(norms: dict[int, dict[str, float]], limit: float) -> dict[int, str]:
    """The replies whose update norm on some key exceeds ``limit`` times that key's median.

    Args:
        norms: ``{site index: {key prefix: update norm}}`` of one phase's replies.
        limit: the factor c of ``federation.update_norm_limit``.

    Returns:
        ``{site index: reason}`` for each outlier (its first outlying key).
    """
    reasons: dict[int, str] = {}
    for prefix in sorted({prefix for site_norms in norms.values() for prefix in site_norms}):
        values = {index: site_norms[prefix] for index, site_norms in norms.items() if prefix in site_norms}
        median = float(np.median(list(values.values())))
        for index, value in values.items():
            if median > 0 and value > limit * median and index not in reasons:
                reasons[index] = (
                    f"update norm {value:.3g} of {prefix!r} is over {limit:g} x the median {median:.3g} of {len(values)} replies"
                )
    return reasons


class RoundStartStates:
    """The state of each participant at the start of the round, to put a failing site back.

    Args:
        directory: where states beyond the memory budget are written (a
            temporary folder is made inside at the first write; ``None``: the
            system's temporary directory).
        memory_budget: bytes of CPU copies kept in memory; ``None``: a quarter
            of the memory available now (``os.sysconf``), 0: every state on disk.
    """

    def __init__(self, directory: Path | None, memory_budget: int | None = None) -> None:
        self.parent = directory
        self.memory_budget = _available_memory() // 4 if memory_budget is None else memory_budget
        self.in_memory: dict[int, dict[str, Any]] = {}  # site index -> CPU copy of its state
        self.memory_bytes = 0
        self.directory: Path | None = None  # made at the first state written to disk

    def save(self, site: Site) -> None:
        """Keep the site's state now (before its first phase of the round), replacing what was kept of an earlier round."""
        self._drop(site.index)
        state = site.state_dict()
        size = _tensor_bytes(state)
        if self.memory_bytes + size <= self.memory_budget:
            self.in_memory[site.index] = _cpu_copy(state)
            self.memory_bytes += size
            return
        if self.directory is None:
            if self.parent is not None:
                Path(self.parent).mkdir(parents=True, exist_ok=True)
            self.directory = Path(tempfile.mkdtemp(prefix=".round-start-", dir=self.parent))
        torch.save(state, self._path(site.index))

    def restore(self, site: Site) -> None:
        """Put the site back to the state :meth:`save` kept (the kept copy stays unshared with the site)."""
        if site.index in self.in_memory:
            site.load_state_dict(_cpu_copy(self.in_memory[site.index]))
        else:
            site.load_state_dict(torch.load(self._path(site.index), map_location=site.fabric.device, weights_only=True))

    def close(self) -> None:
        """Drop the copies and delete the files."""
        self.in_memory.clear()
        self.memory_bytes = 0
        if self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)
            self.directory = None

    def _drop(self, index: int) -> None:
        if index in self.in_memory:
            self.memory_bytes -= _tensor_bytes(self.in_memory.pop(index))
        elif self.directory is not None:
            self._path(index).unlink(missing_ok=True)

    def _path(self, index: int) -> Path:
        assert self.directory is not None
        return self.directory / f"site{index}.pt"


def _cpu_copy(state: Any) -> Any:
    """``state`` (nested dicts, lists, tuples) with every tensor copied to the CPU (a new tensor, never a view)."""
    if isinstance(state, torch.Tensor):
        return state.detach().to("cpu", copy=True)
    if isinstance(state, dict):
        return {key: _cpu_copy(value) for key, value in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(_cpu_copy(value) for value in state)
    return copy.deepcopy(state)


def _tensor_bytes(state: Any) -> int:
    """Bytes held by the tensors of ``state`` (nested dicts, lists, tuples)."""
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(_tensor_bytes(value) for value in state.values())
    if isinstance(state, (list, tuple)):
        return sum(_tensor_bytes(value) for value in state)
    return 0


def _available_memory() -> int:
    """Bytes of memory available now (``os.sysconf``; 0 where the system does not say, so every state goes to disk)."""
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 0
