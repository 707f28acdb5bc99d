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
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

from medfed.compression.codecs import Codec, make_codec
from medfed.federated.strategies.base import Payload

DIRECTIONS = ("up", "down")
ZEROS = "zeros"
#: model parts smaller than this are not guarded against travelling undeclared: a vector of a few
#: values (a logistic regression's weights) costs nothing dense and cannot be told from a
#: per-site vector (mixing weights, sample counts) of the same length
MIN_CHECKED_SIZE = 256

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
    ) -> None:
        self.coded_keys = coded_keys
        self.initial = {name: vector.detach().reshape(-1).to(torch.float32).cpu() for name, vector in initial.items()}
        self._model_sizes = {  # parameter vectors only: buffers (BatchNorm statistics) may travel dense
            vector.numel(): name
            for name, vector in reversed(self.initial.items())
            if vector.numel() >= MIN_CHECKED_SIZE and not name.startswith("buffers")
        }
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
            ValueError: an unknown direction, a coded vector whose length
                differs from its key's earlier messages, or a model-sized
                tensor under a key not in ``coded_keys``.
        """
        _check_direction(direction)
        received = {}
        started = time.perf_counter()
        for key, value in payload.items():
            shape, data, decoded = self._encode_key(direction, key, value)
            received[key] = value.to(self.device) if data is None else decoded.reshape(shape).to(self.device)
        self.codec_seconds += time.perf_counter() - started
        return received

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

        Counts the bytes as :meth:`send` does and updates the receiver's
        state only: K (from the bytes alone) and, receiving down (the site),
        O <- A. Every tensor is float32 on ``device``, shaped as sent.

        Raises:
            ValueError: an unknown direction; a coded vector whose length
                differs from its key's earlier messages; bytes that are not a
                medfed codec stream (from the codec's decoder).
        """
        _check_direction(direction)
        started = time.perf_counter()
        received = {}
        for key, (shape, data) in wire.items():
            if data is None:
                received[key] = torch.zeros(shape, dtype=torch.float32, device=self.device)
                continue
            reference_name = self._reference_name(key)
            sent = (self._small if reference_name is None else self._codecs[direction]).decode(data)
            if reference_name is not None and not self._codecs[direction].lossless:
                known = self._known(key, reference_name, sent)
                sent = torch.from_numpy(np.add(known.numpy(), sent.numpy()))
                self.known[key] = sent
                if direction == "down":
                    self._owe(key)
            self.bytes_sent[direction] += len(data)
            self.dense_bytes[direction] += 4 * sent.numel()
            received[key] = sent.reshape(shape).to(self.device)
        self.codec_seconds += time.perf_counter() - started
        return received

    def _encode_key(self, direction: str, key: str, value: torch.Tensor) -> tuple[tuple[int, ...], bytes | None, torch.Tensor | None]:
        """One payload entry: (its shape, its bytes (None: no elements), the (d,) float32 vector the receiver decodes).

        Counts the bytes and updates K and, up, A (the sender's state).
        """
        shape = tuple(value.shape)
        flat = value.detach().reshape(-1).to(torch.float32).cpu()
        if flat.numel() == 0:  # e.g. the shared part of an all-personal model: nothing to send
            return shape, None, None
        reference_name = self._reference_name(key)
        if reference_name is None and flat.numel() in self._model_sizes:
            raise ValueError(
                f"payload {key!r} ({direction}) holds {flat.numel()} values, the size of the model part "
                f"{self._model_sizes[flat.numel()]!r}, but is not declared in the strategy's coded_keys "
                f"({', '.join(self.coded_keys) or 'none'}): a model vector must go through the codec"
            )
        codec = self._small if reference_name is None else self._codecs[direction]
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
