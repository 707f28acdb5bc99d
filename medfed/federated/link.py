"""The wire between the server and one site: payloads become bytes and back.

Every payload tensor crosses the boundary as the byte stream of a codec
(:mod:`medfed.compression`); the receiver decodes those bytes, so the
strategy on the other side sees exactly what was sent — lossy codecs
included — and the byte counts are the lengths of real encoded streams.

Model vectors (the payload keys a strategy lists in ``coded_keys``, by
default ``all``/``shared``/``personal``) go through the direction's
configured codec. A lossless codec sends the values as they are. A lossy
codec C sends changes, and the link keeps its error feedback, defined here
once for every lossy codec (the codecs keep no state). Per payload key, with
T the sender's target and C(x) what the receiver decodes from the bytes of x:

    K   the known value: what the receiver of the key's last message holds,
        in either direction (both ends compute it from the bytes alone);
    A   the site's residual: after an up message, what it still owes;
    O   what the site owed when the server's last message on the key came
        (0 before one came).

    down:  x = T - K,          K <- K + C(x)
    up:    x = T - K + O,      K <- K + C(x),   A <- x - C(x)
    and at every down message O <- A.

Invariant: after an up message A = T + O - K, the part of the site's own
changes (and of what it owed before) that the server has not received. The
receiver gets K.

*Why up and down differ.* A site trains from what it received (K after a
down message), so its target is K + its training change; the part of that
change an up message leaves out is lost unless the site sends it later. It
keeps A across the server's reply and adds it to its next change: Sattler
et al.'s (2019) STC client residual, so over the rounds the server receives
the sum of the site's changes in full. A down message's deficit is not
owed that way: the server's next target is computed from the sites' decoded
replies, and the sites whose changes make up the deficit still hold them, so
the next target minus K carries them again; adding the deficit as well would
count it twice (the server keeps no residual). Only the part of the deficit
common to every site is not brought back (a plain average forgets it); the
README gives the measured cost against the old link. Between two messages in
the same direction nothing resets K, so K already holds what was sent and the
unsent part T - K (+ O, still owed) is coded again: on a fixed target K
converges in either direction, STC's error norm never grows, and CER leaves
|x - C(x)| <= 2 gamma entrywise unsent after every message (``tests/test_link.py``).

*Traffic of the strategies.* FedAvg, FedBN, FedAMP, PGFed ("all") and
pFedNet ("shared", "personal") alternate: the server sends a model, the site
trains from it and replies (a site that skips a round receives two down
messages in a row, and its A waits in O). APPLE sends "core/i" only up from
site i and every other "core/j" only down to it, and PGFed's gradients
("gradient" up, "aux_gradient" and "mean_gradient" down) travel one way:
O stays 0 and each message codes T - K, the error feedback of a one-way
stream. For APPLE's own core model that is the client residual too: site i
trains from its own core model, not from K, so T - K is its change plus
what it still owes.

Before a key's first message K is the seeded initial model, which both ends
hold (every site builds it from the run's seed), or zero for keys declared
against ``"zeros"`` (gradients); a key that has an initial vector of its own
name (``Strategy.initial_values``, e.g. IFCA's seeded "cluster/j") starts from
that one. Every other entry (sample counts,
sketches, mixing weights) travels as dense float32; a tensor under such a
key that has the size of a parameter part of the model (``initial``'s
vectors other than buffers, from ``MIN_CHECKED_SIZE`` values) is refused: a model vector must be declared in ``coded_keys`` so
that it never silently skips the codec.

*Dense on the device.* Where both ends are in one process (the simulator's
:meth:`Link.send`), an entry a lossless codec carries (``dense``: model
vectors under a dense codec, and every entry outside ``coded_keys``) would
decode to exactly its float32 values, so it is handed over as a float32 copy
on the receiver's device, never copied to the host, and counted as the
stream it would be (header + 4 bytes a value); one check per message (one
host read) refuses a NaN or an infinity as the codec would. A lossy codec's
entries, and a deployment's (:meth:`Link.encode` / :meth:`Link.decode`),
cross as bytes.

*What a receiver accepts.* :meth:`Link.decode` reads bytes from the other
end, which it does not trust: a wire is a dict of string keys, each entry a
shape (at most ``MAX_DIMS`` non-negative integers) and a codec stream. A
coded key's shape must hold exactly the values of the key's known value (or
of its initial vector), a dense key at most ``max_entries`` values (the
largest initial vector, at least ``MIN_DENSE_BOUND``); the stream must hold
that many values (checked in its header before anything is allocated), all
finite, also after adding a lossy codec's known value. A shape without
values has no stream and a stream never comes without values. Anything else
raises one :class:`~medfed.errors.MessageError` naming the sender and the
key, and leaves the link as it was: the state changes only once every key
of the wire has decoded.
"""

from __future__ import annotations

import math
import numbers
import time
from typing import Any

import numpy as np
import torch

from medfed.compression.codecs import HEADER_SIZE, Codec, make_codec
from medfed.errors import MessageError
from medfed.federated.protocol import Payload

DIRECTIONS = ("up", "down")
ZEROS = "zeros"
#: model parts smaller than this are not guarded against travelling undeclared: a vector of a few
#: values (a logistic regression's weights) costs nothing dense and cannot be told from a
#: per-site vector (mixing weights, sample counts) of the same length
MIN_CHECKED_SIZE = 256
MAX_DIMS = 8
"""Most dimensions a received payload tensor may have."""
MIN_DENSE_BOUND = 1 << 20
"""A dense (not coded) received entry may hold this many values even where the model is smaller (sketches)."""

Wire = tuple[tuple[int, ...], bytes | None]
"""One payload entry on the wire: the tensor's shape and its codec stream (None: the tensor has no elements)."""


class Link:
    """Encodes, counts and decodes everything exchanged with one site.

    Args:
        up: codec name and options for site -> server (``{"name": "stc", ...}``).
        down: codec name and options for server -> site.
        coded_keys: ``{key prefix: initial vector}``: payload keys equal to a
            prefix or starting with ``prefix + "/"`` carry model-sized vectors
            (coded by the codecs); a key's first known value K is
            ``initial[vector]``, or zero when the vector is ``"zeros"``.
        initial: the initial model vectors ``{"shared", "personal", "all", ...}``, and any
            initial vector of a payload key under the key itself (``Strategy.initial_values``).
        device: where received tensors are placed (the run's device).
        peer: the site at the other end (the server's end) or at this end
            (the site's), named in the errors of what it sends up.

    Attributes:
        known: ``{key: K}``, the known value of every key a lossy codec has
            carried, (d,) float32 on the CPU (see the module docstring).
        residuals: ``{key: A}``, the site's residual after its last up message.
        owed: ``{key: O}``, the residual the site held when the server's last
            message on the key came.

    Raises:
        ValueError: an unknown codec name or option (from ``make_codec``).
    """

    def __init__(
        self,
        up: dict[str, Any],
        down: dict[str, Any],
        coded_keys: dict[str, str],
        initial: dict[str, torch.Tensor],
        device: torch.device,
        peer: str = "the site",
    ) -> None:
        self.coded_keys = coded_keys
        self.peer = peer
        self.initial = {name: vector.detach().reshape(-1).to(torch.float32).cpu() for name, vector in initial.items()}
        self._model_sizes = {  # parameter vectors only: buffers (BatchNorm statistics) may travel dense
            vector.numel(): name
            for name, vector in reversed(self.initial.items())
            if vector.numel() >= MIN_CHECKED_SIZE and not name.startswith("buffers")
        }
        self.max_entries = max([MIN_DENSE_BOUND, *(vector.numel() for vector in self.initial.values())])
        self.device = device
        self._codecs = {direction: _make(spec) for direction, spec in (("up", up), ("down", down))}
        self._small = make_codec("dense")
        self.known: dict[str, torch.Tensor] = {}
        self.residuals: dict[str, torch.Tensor] = {}
        self.owed: dict[str, torch.Tensor] = {}
        self.bytes_sent = {"up": 0, "down": 0}
        self.dense_bytes = {"up": 0, "down": 0}
        self.codec_seconds = 0.0

    def send(self, direction: str, payload: Payload) -> Payload:
        """Encode ``payload`` in ``direction``, count the bytes, return what the receiver decodes.

        Both ends in one object (the simulator): K is held once, for both.
        The time spent encoding and decoding accumulates in ``codec_seconds``.

        Raises:
            ValueError: an unknown direction, or a model-sized tensor under a
                key not in ``coded_keys``.
            MessageError: what the receiver's :meth:`decode` would refuse: a coded
                vector whose length differs from its key's known value, or a
                dense entry over ``max_entries`` values (nothing is sent then).
        """
        _check_direction(direction)
        for key, value in payload.items():  # the receiver's checks on what it would decode, before any state changes
            try:
                self._expected(key, tuple(value.shape))
            except MessageError as error:
                raise error.about(self._sender(direction), key) from None
        received = {}
        started = time.perf_counter()
        dense = {key: value for key, value in payload.items() if self._codec(direction, key).lossless and value.numel() > 0}
        self._check_dense(direction, dense)
        for key, value in payload.items():
            if key in dense:
                received[key] = value.detach().to(device=self.device, dtype=torch.float32, copy=True)
                self.bytes_sent[direction] += HEADER_SIZE + 4 * value.numel()  # the dense stream it would be
                self.dense_bytes[direction] += 4 * value.numel()
                continue
            shape, data, decoded = self._encode_key(direction, key, value)
            received[key] = value.to(self.device) if data is None else decoded.reshape(shape).to(self.device)
        self.codec_seconds += time.perf_counter() - started
        return received

    def _check_dense(self, direction: str, dense: Payload) -> None:
        """Refuse what the dense codec would refuse in ``dense`` (``send``'s lossless entries), reading the device once.

        Raises:
            ValueError: a model-sized tensor under a key not in ``coded_keys``, or an entry holding a NaN or an infinity.
        """
        for key, value in dense.items():
            self._check_declared(direction, key, value.numel())
        if not dense:
            return
        finite = torch.stack([torch.isfinite(value).all().to(self.device) for value in dense.values()])
        if not bool(finite.all()):  # the message's one host read
            key = list(dense)[int(torch.nonzero(~finite)[0])]
            raise ValueError(f"payload {key!r} ({direction}): contains NaN or infinite entries")

    def _codec(self, direction: str, key: str) -> Codec:
        """The codec that carries ``key`` in ``direction``: the direction's for a model vector, dense for any other entry."""
        return self._small if self._reference_name(key) is None else self._codecs[direction]

    def _check_declared(self, direction: str, key: str, count: int) -> None:
        """Refuse ``count`` values under ``key`` where they have a model part's size and the key is not in ``coded_keys``."""
        if self._reference_name(key) is None and count in self._model_sizes:
            raise ValueError(
                f"payload {key!r} ({direction}) holds {count} values, the size of the model part "
                f"{self._model_sizes[count]!r}, but is not declared in the strategy's coded_keys "
                f"({', '.join(self.coded_keys) or 'none'}): a model vector must go through the codec"
            )

    def encode(self, direction: str, payload: Payload) -> dict[str, Wire]:
        """The sender's end alone (a deployment): ``payload`` -> ``{key: (shape, bytes)}``, counted here.

        Updates the sender's state only: K (both directions) and, sending
        up, the site's residual A. The receiver's own :class:`Link` turns the
        result back with :meth:`decode`; the bytes are those :meth:`send`
        would count, and what it decodes is what :meth:`send` would return.
        A key without elements travels as its shape alone (``bytes`` None).

        Raises:
            ValueError: as :meth:`send` (a model-sized tensor under an undeclared key included).
        """
        _check_direction(direction)
        started = time.perf_counter()
        wire = {}
        for key, value in payload.items():
            shape, data, _ = self._encode_key(direction, key, value)
            wire[key] = (shape, data)
        self.codec_seconds += time.perf_counter() - started
        return wire

    def decode(self, direction: str, wire: dict[str, Wire]) -> Payload:
        """The receiver's end alone: ``{key: (shape, bytes)}`` from the other end's :meth:`encode` -> the payload.

        Checks every entry against what this end expects (module docstring)
        before decoding it, counts the bytes as :meth:`send` does and, once
        every entry has decoded, updates the receiver's state only: K (from
        the bytes alone) and, receiving down (the site), O <- A. Every tensor
        is float32 on ``device``, shaped as sent.

        Raises:
            ValueError: an unknown direction.
            MessageError: a malformed wire or entry (naming the sender and
                the key); the link's state is left as it was.
        """
        _check_direction(direction)
        started = time.perf_counter()
        if not isinstance(wire, dict):
            raise MessageError(f"expected a dict of payload entries, got {type(wire).__name__}", self._sender(direction))
        received, known, sizes = {}, {}, [0, 0]
        for key, entry in wire.items():
            try:
                shape, sent, data, coded_change = self._decode_key(direction, key, entry)
            except MessageError as error:
                raise error.about(self._sender(direction), key if isinstance(key, str) else repr(key)) from None
            if data is not None:
                if coded_change:
                    known[key] = sent
                sizes[0] += len(data)
                sizes[1] += 4 * sent.numel()
            received[key] = sent.reshape(shape).to(self.device)
        for key, value in known.items():
            self.known[key] = value
            if direction == "down":
                self._owe(key)
        self.bytes_sent[direction] += sizes[0]
        self.dense_bytes[direction] += sizes[1]
        self.codec_seconds += time.perf_counter() - started
        return received

    def _decode_key(self, direction: str, key: Any, entry: Any) -> tuple[tuple[int, ...], torch.Tensor, bytes | None, bool]:
        """One received entry checked and decoded, no state changed: its shape, the flat float32 CPU tensor,
        its bytes (None: no values) and whether it is a lossy codec's change (the tensor is then the new K).

        Raises:
            MessageError: the entry is not what this end expects (module docstring).
        """
        if not isinstance(key, str):
            raise MessageError(f"a payload key must be a string, got {type(key).__name__}")
        if not isinstance(entry, (tuple, list)) or len(entry) != 2:
            raise MessageError("expected an entry (shape, bytes)")
        shape, data = _checked_shape(entry[0]), entry[1]
        count, reference_name, reference = self._expected(key, shape)
        if count == 0:
            if data is not None:
                raise MessageError(f"shape {shape} holds no values, but a stream came with it")
            return shape, torch.zeros(0, dtype=torch.float32, device="cpu"), None, False  # the link decodes on the CPU
        if data is None:
            raise MessageError(f"shape {shape} holds {count} values, but no stream came with it")
        codec = self._small if reference_name is None else self._codecs[direction]
        sent = codec.decode(data, count)
        coded_change = reference_name is not None and not codec.lossless
        if coded_change:
            known = torch.zeros_like(sent) if reference is None else reference
            with np.errstate(over="ignore", invalid="ignore"):  # refused just below
                sent = torch.from_numpy(np.add(known.numpy(), sent.numpy()))
            if not np.isfinite(sent.numpy()).all():
                raise MessageError("the decoded change added to the known value is not finite")
        return shape, sent, data, coded_change

    def vector_size(self, key: str) -> int | None:
        """How many values a model vector under ``key`` holds at the other end: a coded key's known value's (or its
        initial vector's), or the initial vector named ``key`` (``buffers``); None where this end cannot know it."""
        reference_name = self._reference_name(key)
        reference = self.initial.get(key) if reference_name is None else self._reference(key, reference_name)
        return None if reference is None else reference.numel()

    def _expected(self, key: str, shape: tuple[int, ...]) -> tuple[int, str | None, torch.Tensor | None]:
        """The values a received ``shape`` under ``key`` holds, checked; with the key's reference name and K (None: none).

        Raises:
            MessageError: a coded key's shape that does not hold K's number of values, or another key's more than ``max_entries``.
        """
        count = math.prod(shape)
        reference_name = self._reference_name(key)
        reference = None if reference_name is None else self._reference(key, reference_name)
        if reference is not None and count != reference.numel():
            raise MessageError(f"shape {shape} holds {count} values, expected {reference.numel()} like the key's known value")
        if reference is None and count > self.max_entries:
            raise MessageError(f"shape {shape} holds {count} values, more than the {self.max_entries} this end accepts")
        return count, reference_name, reference

    def _reference(self, key: str, reference_name: str) -> torch.Tensor | None:
        """K of a coded key (before its first message: its own initial vector or its part's); None for a key against zeros not yet received."""
        known = self.known.get(key, self.initial.get(key))
        if known is None and reference_name != ZEROS:
            known = self.initial[reference_name]
        return known

    def _sender(self, direction: str) -> str:
        """Who sends in ``direction``: the site (up) or the server (down)."""
        return self.peer if direction == "up" else "the server"

    def _encode_key(self, direction: str, key: str, value: torch.Tensor) -> tuple[tuple[int, ...], bytes | None, torch.Tensor | None]:
        """One payload entry: (its shape, its bytes (None: no elements), the (d,) float32 vector the receiver decodes).

        Counts the bytes and updates K and, up, A (the sender's state).
        """
        shape = tuple(value.shape)
        flat = value.detach().reshape(-1).to(torch.float32).cpu()
        if flat.numel() == 0:  # e.g. the shared part of an all-personal model: nothing to send
            return shape, None, None
        self._check_declared(direction, key, flat.numel())
        reference_name = self._reference_name(key)
        codec = self._codec(direction, key)
        if codec.lossless:
            data = codec.encode(flat)
            decoded = codec.decode(data)
        else:
            data, decoded = self._send_change(codec, direction, key, reference_name, flat)
        self.bytes_sent[direction] += len(data)
        self.dense_bytes[direction] += 4 * flat.numel()
        return shape, data, decoded

    def _send_change(
        self, codec: Codec, direction: str, key: str, reference_name: str, target: torch.Tensor
    ) -> tuple[bytes, torch.Tensor]:
        """Code ``target`` ((d,) float32) against K (+ O up), update K, A and O; return (bytes, new K).

        At a server's own end (a deployment) there is no A, so down messages leave O alone there.

        K is replaced, never written to, so the tensor handed to the receiver is its own.
        """
        known = self._known(key, reference_name, target)
        # NumPy, not torch, for the arithmetic next to the codec: a torch
        # operation wakes PyTorch's OpenMP workers, which then spin for
        # milliseconds on the core CER's two-core solver is about to use.
        change = np.subtract(target.numpy(), known.numpy())
        if direction == "up" and key in self.owed:
            change += self.owed[key].numpy()
        data = codec.encode(torch.from_numpy(change))
        sent = codec.decode(data).numpy()
        known = torch.from_numpy(np.add(known.numpy(), sent))
        self.known[key] = known
        if direction == "up":
            self.residuals[key] = torch.from_numpy(np.subtract(change, sent))
        else:
            self._owe(key)
        return data, known

    def _known(self, key: str, reference_name: str, like: torch.Tensor) -> torch.Tensor:
        """K of ``key`` (before its first message: its own initial vector, its part's, or zeros), checked against ``like``'s shape."""
        known = self.known.get(key, self.initial.get(key))
        if known is None:
            known = torch.zeros_like(like) if reference_name == ZEROS else self.initial[reference_name]
        if known.shape != like.shape:
            raise ValueError(f"payload {key!r}: expected shape {tuple(known.shape)} like its earlier messages, got {tuple(like.shape)}")
        return known

    def _owe(self, key: str) -> None:
        """A down message on ``key`` came: O <- A (where the site has a residual)."""
        if key in self.residuals:
            self.owed[key] = self.residuals[key]

    def _reference_name(self, key: str) -> str | None:
        """The initial vector a coded key starts from, or None if the key is not a model vector."""
        prefix = coded_prefix(key, self.coded_keys)
        return None if prefix is None else self.coded_keys[prefix]

    def state_dict(self) -> dict[str, Any]:
        """Known values, residuals and owed residuals (``{key: vector}``), byte counters and codec time."""
        return {
            "known": dict(self.known),
            "residuals": dict(self.residuals),
            "owed": dict(self.owed),
            "bytes_sent": dict(self.bytes_sent),
            "dense_bytes": dict(self.dense_bytes),
            "codec_seconds": self.codec_seconds,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned.

        Raises:
            ValueError: ``state`` has other keys (e.g. a checkpoint of an earlier link design).
        """
        expected = {"known", "residuals", "owed", "bytes_sent", "dense_bytes", "codec_seconds"}
        if set(state) != expected:
            raise ValueError(f"link state: expected the keys {sorted(expected)}, got {sorted(state)}")
        self.known = dict(state["known"])
        self.residuals = dict(state["residuals"])
        self.owed = dict(state["owed"])
        self.bytes_sent = dict(state["bytes_sent"])
        self.dense_bytes = dict(state["dense_bytes"])
        self.codec_seconds = state["codec_seconds"]


def _check_direction(direction: str) -> None:
    if direction not in DIRECTIONS:
        raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")


def _checked_shape(shape: Any) -> tuple[int, ...]:
    """A received shape as a tuple of non-negative ints (at most ``MAX_DIMS``).

    Raises:
        MessageError: anything else (a negative or non-integer size, too many dimensions).
    """
    if not isinstance(shape, (tuple, list)) or len(shape) > MAX_DIMS:
        raise MessageError(f"expected a shape of at most {MAX_DIMS} sizes, got {_short(shape)}")
    if not all(isinstance(size, numbers.Integral) and not isinstance(size, bool) and size >= 0 for size in shape):
        raise MessageError(f"expected a shape of non-negative integers, got {_short(shape)}")
    return tuple(int(size) for size in shape)


def _short(value: Any) -> str:
    """``repr(value)``, cut at 80 characters (a received value may be huge)."""
    text = repr(value) if not isinstance(value, (tuple, list)) or len(value) <= 16 else f"a {type(value).__name__} of {len(value)} items"
    return text if len(text) <= 80 else text[:77] + "..."


def coded_prefix(key: str, coded_keys: dict[str, str]) -> str | None:
    """The ``coded_keys`` prefix ``key`` falls under (the prefix itself or ``prefix/...``), or None: not a model vector."""
    for prefix in coded_keys:
        if key == prefix or key.startswith(prefix + "/"):
            return prefix
    return None


def _make(spec: dict[str, Any]) -> Codec:
    """The codec ``{"name": ..., **options}`` describes."""
    options = dict(spec)
    return make_codec(options.pop("name"), **options)
