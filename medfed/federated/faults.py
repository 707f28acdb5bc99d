"""What the loop does about a failing site: the checks on a reply, and the state it puts back.

The server trusts nothing a site says about itself: every check on a reply
is made by the server, on what it decoded. A participant *fails* in a phase
of a round when

1. its part of the phase raises (receiving the server's message, local
   training, e.g. a loss that became NaN, or making its reply), or its reply
   holds a NaN or an infinity, which a site refuses to send (:func:`non_finite_keys`);
2. its reply is *malformed*: the server's end of the link refuses it
   (:class:`~medfed.errors.MessageError`: bytes that are not an intact codec
   stream, a shape or size other than expected, a non-finite value), or,
   deployed, its fields are not what a reply holds, or it does not come
   within the deployment's reply timeout;
3. its payload keys are not those the strategy's server half declares for
   the phase (:meth:`~medfed.federated.protocol.ServerHalfProtocol.reply_keys`,
   :func:`reply_key_fault`): a key missing or extra, which the server's
   ``aggregate`` would otherwise meet as a ``KeyError``; or a value the
   server half reads as an index is not one
   (:meth:`~medfed.federated.protocol.ServerHalfProtocol.reply_fault`, IFCA's cluster);
4. it reports more training samples (:data:`NUM_SAMPLES`) than it declared
   when it joined (:func:`sample_count_fault`): a strategy weights by the
   count only within that bound;
5. its reply is an *update outlier*: for some model-vector key its update
   norm exceeds ``update_norm_limit`` times the median of that key's update
   norms over the phase's replies (the failing one included; a median of 0
   flags nothing). With two replies the median is their mean, which no norm
   exceeds twice: the check needs three or more participants to single one out.

The *update* of a reply entry carrying a model vector (a ``coded_keys``
entry) is measured by :func:`update_norms` against the server's own
message of the phase to that site: the entry minus the message's entry under
the same key, i.e. what the server sent it to train from (FedAvg, FedAMP,
IFCA's "cluster/j"). An entry the message did not carry (APPLE's "core/i",
pFedNet's "shared" phase) or declared against zeros (PGFed's "gradient") is
measured as itself: the check compares sites, so each key needs one
reference common to every site, and a site's own report is never one.

A reply the server refuses after decoding it is undone on the link (the
executor keeps each link's state before the phase's reply: references, no
copies), so neither end's link state holds it, exactly as for a site that did
not reply. The server's message of the phase did reach the site (its bytes
count; a lossy codec's known value K holds it at both ends), as a message
reaches a site that then skips its reply: the link stays consistent. The
server aggregates the phase without the site, and the site takes no further
part in the round (``federation.on_site_failure: drop``); it is then put back
to its state at the start of the round (module, optimiser, data order,
strategy state) and receives the round's delivery like a site that did not
take part. ``stop`` raises :class:`~medfed.errors.SiteFailure` instead, before
the round is checkpointed.

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
from medfed.federated.protocol import NUM_SAMPLES, Payload, RoundContext, ServerHalfProtocol

if TYPE_CHECKING:
    from medfed.federated.site import Site


def non_finite_keys(payload: Payload) -> list[str]:
    """The keys of ``payload`` whose tensor holds a NaN or an infinity."""
    return [key for key, value in payload.items() if not bool(torch.isfinite(value).all())]


def reply_key_fault(payload: Payload, allowed: tuple[frozenset[str], ...]) -> str | None:
    """Why the keys of ``payload`` are refused, or None: they must be exactly one of the ``allowed`` sets.

    The reason names the keys missing from, and those extra to, the allowed
    set closest to the reply's keys (the fewest differences; the first such set).
    """
    keys = frozenset(payload)
    if keys in allowed:
        return None
    closest = min(allowed, key=lambda candidate: len(candidate ^ keys))
    missing, extra = sorted(closest - keys), sorted(keys - closest)
    problems = [
        f"{what} {', '.join(repr(key) for key in found)}" for what, found in (("lacks", missing), ("has the unexpected", extra)) if found
    ]
    expected = f"the keys {', '.join(repr(key) for key in sorted(closest))}" if closest else "no keys"
    return f"reply {' and '.join(problems)} (expected {expected})"


def reply_fault(payload: Payload, server: ServerHalfProtocol, ctx: RoundContext, index: int, declared: int) -> str | None:
    """Why site ``index``'s decoded reply in ``ctx`` is refused on its own (checks 3 and 4 of the module docstring), or None.

    Args:
        payload: the reply.
        server: the strategy's server half (its ``reply_keys`` and ``reply_fault``).
        ctx: the round and phase (setup included).
        index: the site.
        declared: the site's declared training-set size.
    """
    return (
        reply_key_fault(payload, server.reply_keys(ctx, index))  # first: the other checks read declared keys
        or server.reply_fault(ctx, index, payload)
        or sample_count_fault(payload, declared)
    )


def sample_count_fault(payload: Payload, declared: int) -> str | None:
    """Why the sample count in ``payload`` (if any) is refused, or None.

    A count must be one whole number from 0 to ``declared`` (the training-set
    size the site declared when it joined; compared in float32, the count's
    type on the wire).
    """
    if NUM_SAMPLES not in payload:
        return None
    value = payload[NUM_SAMPLES]
    if value.numel() != 1:
        return f"reply {NUM_SAMPLES!r} holds {value.numel()} values, expected one sample count"
    count = float(value.reshape(-1)[0])
    if not (0 <= count <= float(np.float32(declared)) and count.is_integer()):
        return f"reply {NUM_SAMPLES!r} = {count:.6g} is not a whole number from 0 to the {declared} training samples the site declared"
    return None


def update_norms(reply: Payload, message: Payload, coded_keys: dict[str, str]) -> dict[str, float]:
    """The norm of each model-vector entry's update, by ``coded_keys`` prefix (APPLE's "core/i" under "core").

    Args:
        reply: the site's reply, as the server decoded it.
        message: the server's message of the phase to the site.
        coded_keys: the strategy's ``coded_keys``.

    Returns:
        ``{prefix: ||entry - message[key]||_2}``, ``||entry||`` where the
        message has no entry of the same size under the key or the key is
        declared against zeros; other and empty entries are not measured.
    """
    norms = {}
    for key, value in reply.items():
        prefix = coded_prefix(key, coded_keys)
        if prefix is None or value.numel() == 0:
            continue
        sent = message.get(key)
        against_message = coded_keys[prefix] != ZEROS and sent is not None and sent.numel() == value.numel()
        update = value.reshape(-1) - sent.reshape(-1).to(value) if against_message else value.reshape(-1)
        norms[prefix] = float(torch.linalg.vector_norm(update, dtype=torch.float64))
    return norms


def refused_replies(
    replies: dict[int, Payload],
    messages: dict[int, Payload],
    server: ServerHalfProtocol,
    ctx: RoundContext,
    declared_samples: list[int],
    coded_keys: dict[str, str],
    norm_limit: float | None,
) -> dict[int, str]:
    """The decoded replies of a phase the server refuses (checks 3 to 5 of the module docstring), with the reasons.

    Args:
        replies: ``{site index: reply}`` as the server decoded them.
        messages: ``{site index: the server's message of the phase}``.
        server: the strategy's server half, which declares the replies (:func:`reply_fault`).
        ctx: the round and phase.
        declared_samples: each site's declared training-set size, by index.
        coded_keys: the strategy's ``coded_keys``.
        norm_limit: c of the update-outlier check (None: no check).
    """
    reasons = {}
    for index, reply in replies.items():
        reason = reply_fault(reply, server, ctx, index, declared_samples[index])
        if reason is not None:
            reasons[index] = reason
    if norm_limit is not None:
        norms = {index: update_norms(reply, messages[index], coded_keys) for index, reply in replies.items() if index not in reasons}
        reasons.update(update_outliers(norms, norm_limit))
    return reasons


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
