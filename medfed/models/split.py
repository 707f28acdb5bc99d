"""Which parameters of a model are shared across sites and which stay personal, and the model as flat vectors.

pFedNet writes a site's model as x^(n) = M x + N z_n: the *shared* part x is
the same at every site, the *personal* part z_n is the site's own (see
``shared/design/algorithms.md``). Here M and N are realised by parameter
names: every trainable parameter is either shared or personal, chosen by
regular expressions over ``named_parameters()`` with a sensible default per
model (U-Net: encoder shared, decoder personal). Every strategy reads the
split from this mixin, so the same code serves FedAvg (everything travels),
pFedNet (both parts, differently) and local training (nothing travels).

Besides the parameters a model holds buffers. The floating-point ones (e.g.
BatchNorm running means and variances) form the vector ``"buffers"``; they
stay at their site unless a strategy sends that vector (FedAvg averages them).
Integer buffers (BatchNorm's ``num_batches_tracked`` step counter) are in no
vector: they always stay local. Two more vectors leave out everything that
belongs to a BatchNorm layer (its weight, bias and running statistics), for
FedBN: ``"all_except_batchnorm"`` and ``"buffers_except_batchnorm"``.

The split's parts are named for pFedNet's roles; ``"body"`` and ``"head"``
name the same two vectors for the representation-learning methods (FedPer,
FedRep and FedBABU keep the head and share the body; LG-FedAvg the
reverse), so a strategy says what it averages.

Every vector is a fixed selection of names in model order, so
``get_vector``/``set_vector`` of the same part line up at every site and on
the server, which knows the names and sizes (:class:`ParameterSplit`) but no
values.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch
from torch import nn

from medfed.errors import ConfigError

Part = Literal["shared", "personal", "all", "buffers", "all_except_batchnorm", "buffers_except_batchnorm", "body", "head"]
PARTS: tuple[str, ...] = ("shared", "personal", "all", "buffers", "all_except_batchnorm", "buffers_except_batchnorm")
#: Role-neutral names of the split's two parts, for strategies whose roles are not "shared" and "personal"
#: (LG-FedAvg averages the head and keeps the body): the same vectors, under the names of what they are.
ROLES: dict[str, str] = {"body": "shared", "head": "personal"}
#: The parts made of parameters only, which local training can train.
TRAINABLE_PARTS: tuple[str, ...] = ("shared", "personal", "all", *ROLES)


@dataclass(frozen=True)
class ParameterSplit:
    """Names and sizes of the model's vectors, in model order.

    Attributes:
        shared: parameter names of the shared part (``named_parameters`` order).
        personal: parameter names of the personal part.
        numels: scalars of every parameter, then of every floating-point buffer.
        buffers: floating-point buffer names (``named_buffers`` order).
        batchnorm: names of the parameters and buffers of BatchNorm layers.
    """

    shared: tuple[str, ...]
    personal: tuple[str, ...]
    numels: dict[str, int]
    buffers: tuple[str, ...] = ()
    batchnorm: frozenset[str] = frozenset()

    def names(self, part: Part) -> tuple[str, ...]:
        """Names in ``part``; ``"all"`` is every parameter in model order, ``"buffers"`` every float buffer;
        ``"body"`` and ``"head"`` are ``"shared"`` and ``"personal"`` (:data:`ROLES`)."""
        part = ROLES.get(part, part)
        if part == "shared":
            return self.shared
        if part == "personal":
            return self.personal
        if part == "all":
            order = {name: i for i, name in enumerate(self.numels)}
            return tuple(sorted(self.shared + self.personal, key=order.__getitem__))
        if part == "buffers":
            return self.buffers
        if part == "all_except_batchnorm":
            return tuple(name for name in self.names("all") if name not in self.batchnorm)
        if part == "buffers_except_batchnorm":
            return tuple(name for name in self.buffers if name not in self.batchnorm)
        raise ValueError(f"part must be one of {(*PARTS, *ROLES)}, got {part!r}")

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
    buffers = []
    for name, buffer in module.named_buffers():
        if buffer.is_floating_point():
            buffers.append(name)
            numels[name] = buffer.numel()
    return ParameterSplit(
        shared=tuple(shared), personal=tuple(personal), numels=numels, buffers=tuple(buffers), batchnorm=batchnorm_names(module)
    )


def batchnorm_names(module: nn.Module) -> frozenset[str]:
    """Full names of the parameters and buffers that belong to BatchNorm layers of ``module``.

    A BatchNorm layer is any subclass of ``torch.nn.modules.batchnorm._BatchNorm``
    (BatchNorm1d/2d/3d, their lazy forms, SyncBatchNorm): the base class
    PyTorch itself tests for; instance and group normalisation keep no
    statistics across batches and are not included.
    """
    names = set()
    for prefix, layer in module.named_modules():
        if isinstance(layer, nn.modules.batchnorm._BatchNorm):
            for name, _ in (*layer.named_parameters(recurse=False), *layer.named_buffers(recurse=False)):
                names.add(f"{prefix}.{name}" if prefix else name)
    return frozenset(names)


def _compile(patterns, key: str) -> list[re.Pattern]:
    compiled = []
    for pattern in patterns:
        try:
            compiled.append(re.compile(pattern))
        except re.error as error:
            raise ConfigError(f"config key '{key}': invalid regular expression {pattern!r}: {error}") from None
    return compiled


class PersonalizationSplit:
    """Mixin for medfed's LightningModules: the parts of :data:`PARTS` as flat vectors.

    A subclass sets ``default_personal_patterns`` and calls
    :meth:`configure_split` at the end of ``__init__`` (after creating every
    layer). Vectors are 1-D tensors on the module's device, in the
    parameters' (float32) dtype, concatenating the parameters or buffers of
    the part in model order (shape ``(size(part),)``).
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

    def _tensors_of(self, part: Part) -> list[torch.Tensor]:
        lookup = {**dict(self.named_parameters()), **dict(self.named_buffers())}
        return [lookup[name] for name in self._parameter_split.names(part)]

    def get_vector(self, part: Part) -> torch.Tensor:
        """A detached copy of ``part``'s parameters or buffers, shape ``(size(part),)``."""
        tensors = self._tensors_of(part)
        if not tensors:
            return torch.zeros(0, device=self._device_of_parameters())
        return torch.cat([t.detach().reshape(-1) for t in tensors])

    def set_vector(self, part: Part, vector: torch.Tensor) -> None:
        """Overwrite ``part``'s parameters or buffers in place from a vector of shape ``(size(part),)``."""
        tensors = self._tensors_of(part)
        expected = sum(t.numel() for t in tensors)
        if vector.ndim != 1 or vector.numel() != expected:
            raise ValueError(f"{part} vector must have shape ({expected},), got {tuple(vector.shape)}")
        with torch.no_grad():
            offset = 0
            for t in tensors:
                t.copy_(vector[offset : offset + t.numel()].view_as(t))
                offset += t.numel()

    def set_trainable(self, part: Part | None) -> None:
        """Let only ``part`` (one of :data:`TRAINABLE_PARTS`) of the split receive gradients (``None`` freezes it all).

        Parameters outside the split (added after :meth:`configure_split`, e.g.
        FedRoD's personal head, :mod:`medfed.models.additive_head`) keep their
        ``requires_grad``: the loss that uses them decides what they learn.
        """
        if part is not None and part not in TRAINABLE_PARTS:
            raise ValueError(f"only {TRAINABLE_PARTS} can be trained, got {part!r}")
        trainable = set() if part is None else set(self._parameter_split.names(part))
        split = set(self._parameter_split.names("all"))
        for name, parameter in self.named_parameters():
            if name in split:
                parameter.requires_grad_(name in trainable)

    def _device_of_parameters(self) -> torch.device:
        first = next(iter(self.parameters()), None)
        return torch.device("cpu") if first is None else first.device
