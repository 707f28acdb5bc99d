"""The wire between the server and one site: payloads become bytes and back.

Every payload tensor crosses the boundary as the byte stream of a codec
(:mod:`medfed.compression`); the receiver decodes those bytes, so the
strategy on the other side sees exactly what was sent — lossy codecs
included — and the byte counts are the lengths of real encoded streams.

Model vectors (the payload keys a strategy lists in ``coded_keys``, by
default ``all``/``shared``/``personal``) go through the direction's
configured codec. A lossy (update) codec codes the *change* of a vector
relative to the last value both ends agreed on for that payload key
(``known``): the site's reply "shared" is coded relative to the "shared"
vector it received, the server's next "shared" relative to the site's reply,
and so on. Both ends update ``known`` with the decoded value, so they never
drift apart. Before a key's first message the reference is the seeded
initial model, which both ends hold (every site builds it from the run's
seed), or zero for keys declared against ``"zeros"`` (gradients). Only
lossy codecs need ``known``; a lossless codec sends values as they are.
Every other entry (sample counts, sketches, mixing weights) travels as
dense float32.
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
            (coded by the codecs); their first reference is
            ``initial[vector]``, or zero when the vector is ``"zeros"``.
        initial: the initial model vectors ``{"shared", "personal", "all"}``.
        device: where received tensors are placed (the run's device).
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
        self._specs = {"up": dict(up), "down": dict(down)}
        self._codecs: dict[tuple[str, str], Codec] = {}
        self._small = make_codec("dense")
        self.known: dict[str, torch.Tensor] = {}
        self.bytes_sent = {"up": 0, "down": 0}
        self.dense_bytes = {"up": 0, "down": 0}
        self.codec_seconds = 0.0

    def send(self, direction: str, payload: Payload) -> Payload:
        """Encode ``payload`` in ``direction``, count the bytes, return what the receiver decodes.

        The time spent encoding and decoding accumulates in ``codec_seconds``.
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
            if reference_name is None:
                data = self._small.encode(flat)
                decoded = self._small.decode(data)
            else:
                codec = self._codec(direction, key)
                if codec.lossless:
                    data = codec.encode(flat)
                    decoded = codec.decode(data)
                else:
                    reference = self.known.get(key)
                    if reference is None:
                        reference = torch.zeros_like(flat) if reference_name == ZEROS else self.initial[reference_name]
                    if reference.shape != flat.shape:
                        raise ValueError(f"payload {key!r}: shape {tuple(flat.shape)} differs from its reference {tuple(reference.shape)}")
                    # NumPy, not torch, for the arithmetic next to the codec: a torch
                    # operation wakes PyTorch's OpenMP workers, which then spin for
                    # milliseconds on the core CER's two-core solver is about to use.
                    change = torch.from_numpy(np.subtract(flat.numpy(), reference.numpy()))
                    data = codec.encode(change)
                    decoded = torch.from_numpy(np.add(reference.numpy(), codec.decode(data).numpy()))
                    self.known[key] = decoded
            self.bytes_sent[direction] += len(data)
            self.dense_bytes[direction] += 4 * flat.numel()
            received[key] = decoded.reshape(value.shape).to(self.device)
        self.codec_seconds += time.perf_counter() - started
        return received

    def _reference_name(self, key: str) -> str | None:
        """The initial vector a coded key starts from, or None if the key is not a model vector."""
        for prefix, name in self.coded_keys.items():
            if key == prefix or key.startswith(prefix + "/"):
                return name
        return None

    def _codec(self, direction: str, key: str) -> Codec:
        if (direction, key) not in self._codecs:
            spec = dict(self._specs[direction])
            self._codecs[(direction, key)] = make_codec(spec.pop("name"), **spec)
        return self._codecs[(direction, key)]

    def state_dict(self) -> dict[str, Any]:
        return {
            "codecs": {f"{d}/{k}": c.state_dict() for (d, k), c in self._codecs.items()},
            "known": dict(self.known),
            "bytes_sent": dict(self.bytes_sent),
            "dense_bytes": dict(self.dense_bytes),
            "codec_seconds": self.codec_seconds,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name, codec_state in state["codecs"].items():
            direction, key = name.split("/", 1)
            self._codec(direction, key).load_state_dict(codec_state)
        self.known = dict(state["known"])
        self.bytes_sent = dict(state["bytes_sent"])
        self.dense_bytes = dict(state["dense_bytes"])
        self.codec_seconds = state["codec_seconds"]
