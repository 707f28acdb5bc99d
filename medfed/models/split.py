"""Which parameters of a model are shared across sites and which stay personal.

pFedNet writes a site's model as x^(n) = M x + N z_n: the *shared* part x is
the same at every site, the *personal* part z_n is the site's own (see
``shared/design/algorithms.md``). Here M and N are realised by parameter
names: every trainable parameter is either shared or personal, chosen by
regular expressions over ``named_parameters()`` with a sensible default per
model (U-Net: encoder shared, decoder personal). Every strategy reads the
split from this mixin, so the same code serves FedAvg (everything travels),
pFedNet (both parts, differently) and local training (nothing travels).

Only parameters are split. Buffers (e.g. BatchNorm running statistics) never
leave a site: they are local state, as in FedBN.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch
from torch import nn

from medfed.errors import ConfigError

Part = Literal["shared", "personal", "all"]
PARTS: tuple[str, ...] = ("shared", "personal", "all")


@dataclass(frozen=True)
class ParameterSplit:
    """Names and sizes of the shared and personal parameters, in ``named_parameters`` order."""

    shared: tuple[str, ...]
    personal: tuple[str, ...]
    numels: dict[str, int]

    def names(self, part: Part) -> tuple[str, ...]:
        """Parameter names of ``part``; ``"all"`` is every parameter in model order."""
        if part == "shared":
            return self.shared
        if part == "personal":
            return self.personal
        if part == "all":
            order = {name: i for i, name in enumerate(self.numels)}
            return tuple(sorted(self.shared + self.personal, key=order.__getitem__))
        raise ValueError(f"part must be one of {PARTS}, got {part!r}")

    def size(self, part: Part) -> int:
        """Number of scalars in ``part`` (d1 for shared, d2 for personal)."""
        return sum(self.numels[name] for name in self.names(part))


def split_parameters(
    module: nn.Module, personal_patterns: list[str] | tuple[str, ...], shared_patterns: list[str] | tuple[str, ...] | None = None
) -> ParameterSplit:
    """Assign every parameter of ``module`` to the shared or the personal part.

    Args:
        module: the model.
        personal_patterns: regular expressions (``re.search``) over parameter
            names; a match makes the parameter personal.
        shared_patterns: if given, a match makes the parameter shared, and
            every parameter must match exactly one of the two lists; if
            ``None``, everything that is not personal is shared.

    Raises:
        ConfigError: an invalid regular expression, a parameter matched by
            both lists, or (with ``shared_patterns``) a parameter matched by
            neither — the message lists the parameters concerned.
    """
    personal_res = _compile(personal_patterns, "model.personal_patterns")
    shared_res = None if shared_patterns is None else _compile(shared_patterns, "model.shared_patterns")
    shared, personal, both, neither = [], [], [], []
    numels = {}
    for name, parameter in module.named_parameters():
        numels[name] = parameter.numel()
        is_personal = any(r.search(name) for r in personal_res)
        is_shared = (not is_personal) if shared_res is None else any(r.search(name) for r in shared_res)
        if is_personal and is_shared:
            both.append(name)
        elif not is_personal and not is_shared:
            neither.append(name)
        (personal if is_personal else shared).append(name)
    if both:
        raise ConfigError(f"parameters matched by both model.personal_patterns and model.shared_patterns: {both[:5]}")
    if neither:
        raise ConfigError(f"parameters matched by neither model.personal_patterns nor model.shared_patterns: {neither[:5]}")
    return ParameterSplit(shared=tuple(shared), personal=tuple(personal), numels=numels)


def _compile(patterns, key: str) -> list[re.Pattern]:
    compiled = []
    for pattern in patterns:
        try:
            compiled.append(re.compile(pattern))
        except re.error as error:
            raise ConfigError(f"config key '{key}': invalid regular expression {pattern!r}: {error}") from None
    return compiled


class PersonalizationSplit:
    """Mixin for medfed's LightningModules: shared vs personal parameters as flat vectors.

    A subclass sets ``default_personal_patterns`` and calls
    :meth:`configure_split` at the end of ``__init__``. Vectors are 1-D
    float32 tensors on the module's device, concatenating the parameters of
    the part in ``named_parameters`` order (shape ``(size(part),)``).
    """

    default_personal_patterns: ClassVar[tuple[str, ...]] = ()
    default_shared_patterns: ClassVar[tuple[str, ...] | None] = None

    def configure_split(self, personal_patterns=None, shared_patterns=None) -> None:
        """Fix the split, from the config's patterns or the class defaults."""
        personal = self.default_personal_patterns if personal_patterns is None else personal_patterns
        shared = self.default_shared_patterns if shared_patterns is None else shared_patterns
        self._parameter_split = split_parameters(self, personal, shared)

    @property
    def parameter_split(self) -> ParameterSplit:
        return self._parameter_split

    def _parameters_of(self, part: Part) -> list[nn.Parameter]:
        lookup = dict(self.named_parameters())
        return [lookup[name] for name in self._parameter_split.names(part)]

    def get_vector(self, part: Part) -> torch.Tensor:
        """A detached copy of ``part``'s parameters, shape ``(size(part),)``."""
        parameters = self._parameters_of(part)
        if not parameters:
            return torch.zeros(0, device=self._device_of_parameters())
        return torch.cat([p.detach().reshape(-1) for p in parameters])

    def set_vector(self, part: Part, vector: torch.Tensor) -> None:
        """Overwrite ``part``'s parameters in place from a vector of shape ``(size(part),)``."""
        parameters = self._parameters_of(part)
        expected = sum(p.numel() for p in parameters)
        if vector.ndim != 1 or vector.numel() != expected:
            raise ValueError(f"{part} vector must have shape ({expected},), got {tuple(vector.shape)}")
        with torch.no_grad():
            offset = 0
            for p in parameters:
                p.copy_(vector[offset : offset + p.numel()].view_as(p))
                offset += p.numel()

    def set_trainable(self, part: Part | None) -> None:
        """Let only ``part`` receive gradients (``None`` freezes everything)."""
        trainable = set() if part is None else set(self._parameter_split.names(part))
        for name, parameter in self.named_parameters():
            parameter.requires_grad_(name in trainable)

    def _device_of_parameters(self) -> torch.device:
        first = next(iter(self.parameters()), None)
        return torch.device("cpu") if first is None else first.device
