"""Codecs: what crosses the site boundary, as real bytes.

A codec turns a flat float32 update, shape (d,), into a self-describing byte
string and back. The communication cost of a message is ``len(data)``.

Every stream starts with an 18-byte header, then the codec's payload:

    magic b"MFCD" | format version (uint8) | codec id (uint8) | d (uint64) |
    CRC-32 of the header's first 14 bytes and the payload (uint32)   (little-endian)

The CRC covers the whole frame but itself (format version 2; version 1's
covered the payload only, so a flipped bit in d decoded to another length):
every single-bit flip, and every burst of up to 32 flipped bits, is
detected. A CRC is no defence against a sender who means harm, so the
decoders also check, before they allocate, every count a stream gives
against the length the receiver expects (``decode``'s ``size``) and the
bits that are left, and refuse non-finite values: whatever the bytes, a
decoder returns a finite (d,) vector of the expected length or raises
:class:`~medfed.errors.MessageError`.

Codecs (``make_codec(name, **options)``):

    "dense"    raw little-endian float32 values (4 d bytes).
    "stc"      sparse ternary compression: the top p d entries as one
               magnitude and their signs (options: sparsity=1/400), see ``stc``.
    "cer"      exact CER (options: gamma, the weight w = eta * gamma of
               ``tv.cer``), then the run coder of ``piecewise``
               (options: quant_bits=None for exact float32 runs, or 1..16).
    "cer+stc"  CER then STC, the pFedNet paper's composition (options:
               gamma, sparsity=1/400).

Codecs keep no state: a message depends only on the vector encoded, and any
codec object of the same kind decodes it. Error feedback (what a lossy codec
has not sent yet) is kept by :mod:`medfed.federated.link`, which encodes the
difference between the sender's target and the value both ends last agreed
on, plus the residual a site still owes.
"""

from __future__ import annotations

import abc
import inspect
import numbers
import struct
import zlib
from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import torch

from medfed.compression.bitstream import BitReader, BitWriter
from medfed.compression.piecewise import MAX_QUANT_BITS, read_piecewise, write_piecewise
from medfed.compression.stc import kept_count, read_ternary, select_top_k, write_ternary
from medfed.compression.tv import cer
from medfed.errors import MessageError

__all__ = ["CODEC_NAMES", "CERCodec", "CERSTCCodec", "Codec", "DenseCodec", "Encoding", "STCCodec", "codec_options", "make_codec"]

MAGIC = b"MFCD"
FORMAT_VERSION = 2
_HEADER = struct.Struct("<4sBBQI")
HEADER_SIZE = _HEADER.size
"""Bytes before every payload (18); the CRC-32 is the header's last 4 bytes."""
_CHECKED = HEADER_SIZE - 4
"""The header bytes the CRC covers, with the payload: all but the CRC itself."""


def frame_checksum(header_start: bytes | memoryview, payload: bytes | memoryview) -> int:
    """CRC-32 of a frame: of the header's first 14 bytes (magic, version, codec id, d) and then the payload."""
    return zlib.crc32(payload, zlib.crc32(header_start))


class Encoding(NamedTuple):
    """One encoded message: the bytes sent and the (d,) float32 CPU tensor the receiver will decode."""

    data: bytes
    sent: torch.Tensor


def _check_update(x: torch.Tensor) -> np.ndarray:
    """A finite, non-empty (d,) float32 tensor as a NumPy array on the CPU (no copy when possible)."""
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"x: expected a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 1 or x.numel() == 0 or x.dtype != torch.float32:
        raise ValueError(f"x: expected a non-empty flat (d,) float32 tensor, got shape {tuple(x.shape)} {x.dtype}")
    array = x.detach().cpu().numpy()
    if not np.isfinite(array).all():
        raise ValueError("x: contains NaN or infinite entries")
    return array


def _check_gamma(gamma: float) -> float:
    if isinstance(gamma, bool) or not isinstance(gamma, numbers.Real) or not np.isfinite(gamma) or gamma < 0:
        raise ValueError(f"gamma: expected a finite number >= 0 (the CER weight), got {gamma!r}")
    return float(gamma)


class Codec(abc.ABC):
    """Encodes a flat float32 update crossing the site boundary; stateless, decode needs only the bytes."""

    name: str
    codec_id: int
    lossless: bool = False
    """True if decoding returns the input exactly, so coding absolute values costs nothing extra;
    lossy codecs are meant for updates (the link codes target - known value, see ``medfed.federated.link``)."""

    def encode(self, x: torch.Tensor) -> bytes:
        """The bytes for update ``x`` ((d,) float32).

        Raises:
            ValueError: x is not a finite, non-empty, flat float32 tensor.
        """
        return self._encode(x)[0]

    def encode_with_sent(self, x: torch.Tensor) -> Encoding:
        """Encode ``x`` ((d,) float32) and also return what the receiver will decode from it.

        Raises:
            ValueError: x is not a finite, non-empty, flat float32 tensor.
        """
        data, decoded = self._encode(x)
        return Encoding(data, torch.from_numpy(decoded()))

    def _encode(self, x: torch.Tensor) -> tuple[bytes, Callable[[], np.ndarray]]:
        """The whole stream for ``x`` and a function returning the (d,) float32 vector it decodes to."""
        array = _check_update(x)
        payload, decoded = self._encode_payload(array)
        start = _HEADER.pack(MAGIC, FORMAT_VERSION, self.codec_id, array.size, 0)[:_CHECKED]
        return start + struct.pack("<I", frame_checksum(start, payload)) + payload, decoded

    def decode(self, data: bytes, size: int | None = None) -> torch.Tensor:
        """The (d,) float32 CPU tensor encoded in ``data``.

        Args:
            data: the stream (bytes-like).
            size: the length d the receiver expects. A receiver of bytes it
                did not make itself must give it: the stream's own d is then
                checked against it before anything is allocated, and no
                decoder allocates more than a few times d entries. ``None``
                trusts the stream's d (the sender decoding its own bytes).

        Raises:
            MessageError: data is not a complete, intact stream of this codec
                holding ``size`` finite values.
        """
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise MessageError(f"{self.name} stream: expected bytes, got {type(data).__name__}")
        data = memoryview(data).cast("B")
        if len(data) < _HEADER.size:
            raise MessageError(f"{self.name} stream: {len(data)} bytes is shorter than the {_HEADER.size}-byte header")
        magic, version, codec_id, length, checksum = _HEADER.unpack_from(data)
        if magic != MAGIC:
            raise MessageError(f"{self.name} stream: not a medfed codec stream (magic {bytes(magic)!r})")
        if version != FORMAT_VERSION:
            raise MessageError(f"{self.name} stream: format version {version}, this medfed reads {FORMAT_VERSION}")
        if codec_id != self.codec_id:
            other = _NAME_OF_ID.get(codec_id, f"unknown codec id {codec_id}")
            raise MessageError(f"{self.name} stream: the data was written by codec {other!r}")
        if frame_checksum(data[:_CHECKED], data[_HEADER.size :]) != checksum:
            raise MessageError(f"{self.name} stream: truncated or corrupt (CRC-32 mismatch)")
        if length == 0:
            raise MessageError(f"{self.name} stream: empty vector (d = 0)")
        if size is not None and length != size:
            raise MessageError(f"{self.name} stream: holds {length} values, expected {size}")
        return torch.from_numpy(self._decode_payload(data[_HEADER.size :], length))

    @abc.abstractmethod
    def _encode_payload(self, x: np.ndarray) -> tuple[bytes, Callable[[], np.ndarray]]:
        """Payload for ``x`` ((d,) float32) and a function returning the (d,) float32 vector it decodes to.

        The function is called only by ``encode_with_sent``: ``encode`` does
        not pay for building the decoded vector.
        """

    @abc.abstractmethod
    def _decode_payload(self, payload: memoryview, size: int) -> np.ndarray:
        """The (size,) float32 vector in ``payload``, every value finite.

        Raises:
            MessageError: the payload is not ``size`` finite values of this codec.
        """


class DenseCodec(Codec):
    """Raw float32 values: the uncompressed reference, 4 d bytes of payload."""

    name = "dense"
    codec_id = 0
    lossless = True

    def _encode_payload(self, x: np.ndarray) -> tuple[bytes, Callable[[], np.ndarray]]:
        return x.astype("<f4", copy=False).tobytes(), x.copy

    def _decode_payload(self, payload: memoryview, size: int) -> np.ndarray:
        if len(payload) != 4 * size:
            raise MessageError(f"dense stream: expected {4 * size} bytes of float32 values, got {len(payload)}")
        values = np.frombuffer(payload, dtype="<f4").astype(np.float32)
        if not np.isfinite(values).all():
            raise MessageError("dense stream: holds NaN or infinite values")
        return values


class STCCodec(Codec):
    """Sparse ternary compression (Sattler et al. 2019) of one vector: its top p d entries as mu * sign.

    Args:
        sparsity: p in (0, 1], the fraction of entries sent per message.
    """

    name = "stc"
    codec_id = 1

    def __init__(self, sparsity: float = 1.0 / 400.0) -> None:
        if isinstance(sparsity, bool) or not isinstance(sparsity, numbers.Real) or not 0.0 < sparsity <= 1.0:
            raise ValueError(f"sparsity: expected a fraction in (0, 1], got {sparsity!r}")
        self.sparsity = float(sparsity)

    def _ternarised(self, x: np.ndarray) -> np.ndarray:
        """What is ternarised; STC alone takes the update itself."""
        return x

    def _encode_payload(self, x: np.ndarray) -> tuple[bytes, Callable[[], np.ndarray]]:
        update = select_top_k(self._ternarised(x), kept_count(self.sparsity, x.size))
        writer = BitWriter()
        write_ternary(writer, update)
        return writer.to_bytes(), update.to_dense

    def _decode_payload(self, payload: memoryview, size: int) -> np.ndarray:
        reader = BitReader(payload, f"{self.name} stream")
        update = read_ternary(reader, size)
        reader.finish()
        return update.to_dense()


class CERSTCCodec(STCCodec):
    """CER then STC, the pFedNet paper's composition.

    Args:
        gamma: the CER weight w >= 0 (the paper's eta * gamma).
        sparsity: p in (0, 1], the fraction of entries sent per message.
    """

    name = "cer+stc"
    codec_id = 3

    def __init__(self, gamma: float, sparsity: float = 1.0 / 400.0) -> None:
        super().__init__(sparsity)
        self.gamma = _check_gamma(gamma)

    def _ternarised(self, x: np.ndarray) -> np.ndarray:
        return cer(x, self.gamma)


class CERCodec(Codec):
    """Exact CER, then the piecewise-constant run coder.

    Args:
        gamma: the CER weight w >= 0 (the paper's eta * gamma).
        quant_bits: None to send CER's run values exactly (float32), or 1..16
            to quantise them uniformly between their minimum and maximum.
    """

    name = "cer"
    codec_id = 2

    def __init__(self, gamma: float, quant_bits: int | None = None) -> None:
        self.gamma = _check_gamma(gamma)
        is_integer = isinstance(quant_bits, numbers.Integral) and not isinstance(quant_bits, bool)
        if quant_bits is not None and not (is_integer and 1 <= quant_bits <= MAX_QUANT_BITS):
            raise ValueError(f"quant_bits: expected None or an integer 1..{MAX_QUANT_BITS}, got {quant_bits!r}")
        self.quant_bits = None if quant_bits is None else int(quant_bits)

    def _encode_payload(self, x: np.ndarray) -> tuple[bytes, Callable[[], np.ndarray]]:
        writer = BitWriter()
        sent = write_piecewise(writer, cer(x, self.gamma), self.quant_bits)
        return writer.to_bytes(), lambda: sent

    def _decode_payload(self, payload: memoryview, size: int) -> np.ndarray:
        reader = BitReader(payload, f"{self.name} stream")
        u = read_piecewise(reader, size)
        reader.finish()
        return u


_CODECS: dict[str, type[Codec]] = {codec.name: codec for codec in (DenseCodec, STCCodec, CERCodec, CERSTCCodec)}
_NAME_OF_ID = {codec.codec_id: codec.name for codec in _CODECS.values()}
CODEC_NAMES = tuple(_CODECS)


def codec_options(name: str) -> dict[str, inspect.Parameter]:
    """The options codec ``name`` accepts, as keyword parameters (``default`` empty when required)."""
    if name not in _CODECS:
        raise ValueError(f"codec: unknown name {name!r}; expected one of {', '.join(CODEC_NAMES)}")
    return {
        key: parameter
        for key, parameter in inspect.signature(_CODECS[name]).parameters.items()
        if parameter.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    }


def make_codec(name: str, **options) -> Codec:
    """A new codec by name: "dense", "stc", "cer" or "cer+stc".

    Raises:
        ValueError: unknown name, unknown or missing option, or an option out of range.
    """
    parameters = codec_options(name)
    unknown = sorted(set(options) - set(parameters))
    if unknown:
        raise ValueError(f"codec {name!r}: unknown option(s) {unknown}; it accepts {sorted(parameters) or 'none'}")
    required = {key for key, parameter in parameters.items() if parameter.default is inspect.Parameter.empty}
    missing = sorted(required - set(options))
    if missing:
        raise ValueError(f"codec {name!r}: missing option(s) {missing}")
    return _CODECS[name](**options)
