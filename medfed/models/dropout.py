"""Dropout whose masks are a counter-based hash of a per-step key: the same draw whichever executor trains a site.

``nn.Dropout`` draws its masks from torch's global generator. Sites trained one
after another (each in its own seeded stream) and sites stacked under
``torch.func.vmap`` (:mod:`medfed.federated.batched`) cannot draw the same masks
from it: vmap has one generator for all the sites it runs. Here the mask of a
training step is a function of a key the executor gives the step
(:func:`step_keys`, seeded from the run's seed, the site, the stream of the work
and the training call) and of the element's position::

    z    = key * K1 + c * K2 + i              (int64, wrapping)   c: the dropout call in the step, i: the element
    u    = top 24 bits of splitmix64(z) / 2^24                     uniform on [0, 1)
    y_i  = x_i * 1[u >= p] / (1 - p)

integer operations only, so vmap runs them over a stack of keys, and a site
draws the same mask alone or stacked. Outside :func:`keyed` (a step no
executor keyed, e.g. a strategy half's own ``SiteView.step``) it is
``torch.nn.functional.dropout``: torch's global generator, which the site's
work seeds.

medfed's models put :class:`KeyedDropout` wherever ``model.dropout`` > 0
(:func:`use_keyed_dropout`); with ``dropout: 0`` (every shipped config) no
layer changes and no draw is made.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch
from torch import nn

#: splitmix64's constants as int64 (two's complement); K1, K2 spread the key and the call apart
_GOLDEN = -7046029254386353131  # 0x9E3779B97F4A7C15
_MIX1 = -4658895280553007687  # 0xBF58476D1CE4E5B9
_MIX2 = -7723592293110705685  # 0x94D049BB133111EB
_CALL = 0x632BE59BD9B4E019

#: the SeedSequence word that keeps dropout keys apart from every other seeded stream of a site
DROPOUT_STREAM = 0xD120


class _Keys:
    """The key of the step in progress (an int64 scalar tensor, or None) and the dropout calls made in it."""

    def __init__(self) -> None:  # instance attributes from the start: a compiled step guards on them
        self.key: torch.Tensor | None = None
        self.calls = 0


_current = _Keys()


@contextmanager
def keyed(key: torch.Tensor) -> Iterator[None]:
    """Inside the block, every :func:`dropout` in training mode draws its mask from ``key`` (int64, shape ``()``)."""
    outer = _current.key, _current.calls
    _current.key, _current.calls = key, 0
    try:
        yield
    finally:
        _current.key, _current.calls = outer


def step_keys(seed_words: list[int], steps: int, device: torch.device) -> torch.Tensor:
    """The keys of ``steps`` training steps, ``(steps,)`` int64 on ``device``: k_t = k_0 + t, k_0 seeded from ``seed_words``.

    ``seed_words``: (run seed, site index, the work's stream, the training call): the same words give the same keys.
    """
    first = int(np.random.SeedSequence([*seed_words, DROPOUT_STREAM]).generate_state(2, dtype=np.uint64)[0] >> np.uint64(2))
    return torch.arange(steps, dtype=torch.int64, device=device) + first


def _logical_shift(z: torch.Tensor, bits: int) -> torch.Tensor:
    """``z >> bits`` as unsigned 64-bit integers (torch shifts int64 arithmetically)."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def uniform_from_key(key: torch.Tensor, call: int, shape: torch.Size, device: torch.device) -> torch.Tensor:
    """Uniform numbers on [0, 1), float32 of ``shape``: splitmix64 of (key, call, element index) (module docstring)."""
    index = torch.arange(math.prod(shape), dtype=torch.int64, device=device).reshape(shape)  # math: torch.compile traces it
    offset = (call * _CALL + (1 << 63)) % (1 << 64) - (1 << 63)  # c * K2 wrapped to int64
    z = key * _GOLDEN + offset + index
    z = (z ^ _logical_shift(z, 30)) * _MIX1
    z = (z ^ _logical_shift(z, 27)) * _MIX2
    z = z ^ _logical_shift(z, 31)
    return _logical_shift(z, 40).to(torch.float32) * (1.0 / (1 << 24))


def dropout(x: torch.Tensor, p: float, training: bool, channels: bool = False) -> torch.Tensor:
    """Inverted dropout of ``x`` with drop probability ``p``: keyed inside :func:`keyed`, else torch's.

    ``channels``: drop whole channels of a ``(N, C, *spatial)`` input (as ``nn.Dropout2d`` / ``nn.Dropout3d``; the
    mask is ``(N, C, 1, ...)``); else each element.
    """
    if not training or p == 0.0:
        return x
    key = _current.key
    if key is None:
        if channels:
            return (nn.functional.dropout3d if x.ndim == 5 else nn.functional.dropout2d)(x, p, True)
        return nn.functional.dropout(x, p, True)
    call = _current.calls
    _current.calls += 1
    shape = (*x.shape[:2], *([1] * (x.ndim - 2))) if channels else x.shape
    keep = uniform_from_key(key, call, torch.Size(shape), x.device) >= p
    return x * keep.to(x.dtype) * (1.0 / (1.0 - p))


class KeyedDropout(nn.Module):
    """``nn.Dropout`` (``channels``: ``nn.Dropout2d``/``3d``) drawing its masks as :func:`dropout` does; no parameters or buffers."""

    def __init__(self, p: float, channels: bool = False) -> None:
        super().__init__()
        if not 0.0 <= p < 1.0:
            raise ValueError(f"dropout probability must be in [0, 1), got {p}")
        self.p = p
        self.channels = channels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dropout(x, self.p, self.training, self.channels)

    def extra_repr(self) -> str:
        return f"p={self.p}, channels={self.channels}"


def use_keyed_dropout(module: nn.Module) -> None:
    """Replace every ``nn.Dropout`` (``nn.Dropout2d``, ``nn.Dropout3d``) in ``module`` with a :class:`KeyedDropout` (in place).

    Other dropouts (alpha, 1-d channel) are refused, so a model never trains with masks the executors could not reproduce.
    """
    for name, child in list(module.named_children()):
        if type(child) is nn.Dropout:
            setattr(module, name, KeyedDropout(child.p))
        elif type(child) in (nn.Dropout2d, nn.Dropout3d):
            setattr(module, name, KeyedDropout(child.p, channels=True))
        elif isinstance(child, nn.modules.dropout._DropoutNd):
            raise ValueError(f"{type(child).__name__} at {name!r}: only nn.Dropout, nn.Dropout2d and nn.Dropout3d are keyed")
        else:
            use_keyed_dropout(child)
