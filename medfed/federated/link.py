"""The wire between the server and one site: payloads become bytes and back.

Every payload tensor crosses the boundary as the byte stream of a codec
(:mod:`medfed.compression`); the receiver decodes those bytes, so the
strategy on the other side sees exactly what was sent — lossy codecs
included — and the byte counts are the lengths of real encoded streams.

Model vectors (the payload keys a strategy lists in ``coded_keys``, by
default ``all``/``shared``/``personal``) go through the direction's
configured codec. A lossless codec sends the values as they are. A lossy
codec works on *streams*: each (direction, key) pair, e.g. ("up", "shared")
and ("down", "shared"), is a stream of its own with one piece of state, the
receiver's copy R, shape (d,) float32. Message t of a stream, carrying the
sender's target T_t, is

    data_t = codec(T_t - R_{t-1}),     R_t = R_{t-1} + decode(data_t).

Both ends compute R_t from the bytes alone, so they hold the same copy, and
the receiver's strategy gets R_t. Error feedback is defined here, once, for
every lossy codec; the codecs themselves keep no state. Invariant: the part
of the target not yet sent is A_t = T_t - R_t (Sattler's STC residual), and
each message codes A_{t-1} + (T_t - T_{t-1}) = T_t - R_{t-1}, the change of
the sender's own target plus what it still owes. Nothing is counted twice,
so on a fixed target R converges: STC's error norm never grows, and CER
leaves |T - R| <= 2 gamma entrywise after every message however T moves
(``tests/test_link.py`` checks both, for both directions).

Before a stream's first message R_0 is the seeded initial model, which both
ends hold (every site builds it from the run's seed), or zero for keys
declared against ``"zeros"`` (gradients). Every other entry (sample counts,
sketches, mixing weights) travels as dense float32.
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


class Link:
    """Encodes, counts and decodes everything exchanged with one site.

    Args:
        up: codec name and options for site -> server (``{"name": "stc", ...}``).
        down: codec name and options for server -> site.
        coded_keys: ``{key prefix: initial vector}``: payload keys equal to a
            prefix or starting with ``prefix + "/"`` carry model-sized vectors
            (coded by the codecs); a stream's first reference R_0 is
            ``initial[vector]``, or zero when the vector is ``"zeros"``.
        initial: the initial model vectors ``{"shared", "personal", "all"}``.
        device: where received tensors are placed (the run's device).

    Attributes:
        copies: ``{(direction, key): R}``, the receiver's copy of every lossy
            stream that has carried a message, (d,) float32 on the CPU.

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
        self.device = device
        self._codecs = {direction: _make(spec) for direction, spec in (("up", up), ("down", down))}
        self._small = make_codec("dense")
        self.copies: dict[tuple[str, str], torch.Tensor] = {}
        self.bytes_sent = {"up": 0, "down": 0}
        self.dense_bytes = {"up": 0, "down": 0}
        self.codec_seconds = 0.0

    def send(self, direction: str, payload: Payload) -> Payload:
        """Encode ``payload`` in ``direction``, count the bytes, return what the receiver decodes.

        The time spent encoding and decoding accumulates in ``codec_seconds``.

        Raises:
            ValueError: an unknown direction, or a coded vector whose length
                differs from its stream's earlier messages.
        """
        if direction not in DIRECTIONS:
            raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
        received = {}
        started = time.perf_counter()
        for key, value in payload.items():
            flat = value.detach().reshape(-1).to(torch.float32).cpu()
            if flat.numel() == 0:  # e.g. the shared part of an all-personal model: nothing to send
                received[key] = value.to(self.device)
                continue
            reference_name = self._reference_name(key)
            codec = self._small if reference_name is None else self._codecs[direction]
            if codec.lossless:
                data = codec.encode(flat)
                decoded = codec.decode(data)
            else:
                data, decoded = self._send_on_stream(codec, (direction, key), reference_name, flat)
            self.bytes_sent[direction] += len(data)
            self.dense_bytes[direction] += 4 * flat.numel()
            received[key] = decoded.reshape(value.shape).to(self.device)
        self.codec_seconds += time.perf_counter() - started
        return received

    def _send_on_stream(
        self, codec: Codec, stream: tuple[str, str], reference_name: str, target: torch.Tensor
    ) -> tuple[bytes, torch.Tensor]:
        """Code ``target - R`` ((d,) float32) on ``stream``, add what was sent to R; return (bytes, new R).

        R is replaced, never written to, so the tensor handed to the receiver is its own.
        """
        copy = self.copies.get(stream)
        if copy is None:
            copy = torch.zeros_like(target) if reference_name == ZEROS else self.initial[reference_name]
        if copy.shape != target.shape:
            raise ValueError(
                f"payload {stream[1]!r}: expected shape {tuple(copy.shape)} like its stream's reference, got {tuple(target.shape)}"
            )
        # NumPy, not torch, for the arithmetic next to the codec: a torch
        # operation wakes PyTorch's OpenMP workers, which then spin for
        # milliseconds on the core CER's two-core solver is about to use.
        data = codec.encode(torch.from_numpy(np.subtract(target.numpy(), copy.numpy())))
        copy = torch.from_numpy(np.add(copy.numpy(), codec.decode(data).numpy()))
        self.copies[stream] = copy
        return data, copy

    def _reference_name(self, key: str) -> str | None:
        """The initial vector a coded key starts from, or None if the key is not a model vector."""
        for prefix, name in self.coded_keys.items():
            if key == prefix or key.startswith(prefix + "/"):
                return name
        return None

    def state_dict(self) -> dict[str, Any]:
        """The streams' copies (``{"direction/key": R}``), byte counters and codec time."""
        return {
            "copies": {f"{direction}/{key}": copy for (direction, key), copy in self.copies.items()},
            "bytes_sent": dict(self.bytes_sent),
            "dense_bytes": dict(self.dense_bytes),
            "codec_seconds": self.codec_seconds,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned.

        Raises:
            ValueError: ``state`` has other keys (e.g. a checkpoint written before streams had copies).
        """
        expected = {"copies", "bytes_sent", "dense_bytes", "codec_seconds"}
        if set(state) != expected:
            raise ValueError(f"link state: expected the keys {sorted(expected)}, got {sorted(state)}")
        self.copies = {tuple(name.split("/", 1)): copy for name, copy in state["copies"].items()}
        self.bytes_sent = dict(state["bytes_sent"])
        self.dense_bytes = dict(state["dense_bytes"])
        self.codec_seconds = state["codec_seconds"]


def _make(spec: dict[str, Any]) -> Codec:
    """The codec ``{"name": ..., **options}`` describes."""
    options = dict(spec)
    return make_codec(options.pop("name"), **options)
