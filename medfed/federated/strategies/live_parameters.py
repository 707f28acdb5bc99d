"""A site's parameters as differentiable tensors, for terms a strategy adds to the local loss.

``PersonalizationSplit.get_vector`` returns a detached copy (what crosses the
wire); a proximal or linear term of the local objective must instead be built
from the *live* parameters so that its gradient reaches the optimiser (a
detached term has none: bug 6 of ``shared/design/algorithms.md``). The
helpers here give the live flat vector of a part, its squared distance to a
fixed centre and the proximal term ``weight / 2 * ||w - centre||^2`` built
from it, and run a module's
``training_step`` with substituted parameter tensors (``torch.func.functional_call``),
which APPLE needs for its mixed personalised model.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from medfed.models.base import FederatedModule, unwrap
from medfed.models.split import Part


def live_parameters(module: nn.Module, part: Part) -> list[nn.Parameter]:
    """The parameters of ``part`` in vector order (``ParameterSplit.names(part)``), not detached."""
    original = unwrap(module)
    lookup = dict(original.named_parameters())
    return [lookup[name] for name in original.parameter_split.names(part)]


def live_vector(module: nn.Module, part: Part) -> torch.Tensor:
    """``part``'s parameters as one differentiable vector, shape ``(size(part),)``, the parameters' dtype.

    Same order as ``get_vector(part)``; gradients of anything computed from it
    flow back to the parameters themselves.
    """
    return torch.cat([p.reshape(-1) for p in live_parameters(module, part)])


def proximal_term(module: nn.Module, part: Part, centre: torch.Tensor, weight: float) -> torch.Tensor:
    """``weight / 2 * ||w - centre||^2`` on the live parameters w of ``part``.

    Args:
        module: the site's module (Fabric-wrapped or not).
        part: the part of the model the term acts on.
        centre: ``(size(part),)``, a fixed vector (no gradient flows to it).
        weight: the term's weight (FedProx's mu, Ditto's lambda, ...).

    Returns:
        A scalar whose gradient in w is ``weight * (w - centre)``.
    """
    return proximal_term_of(live_vector(module, part), centre, weight)


def proximal_term_of(vector: torch.Tensor, centre: torch.Tensor, weight: float) -> torch.Tensor:
    """``weight / 2 * ||vector - centre||^2`` of a live vector the caller already built (SuPerFed's w^f, used twice).

    Args:
        vector: ``(n,)``, differentiable (e.g. :func:`live_vector`).
        centre: ``(n,)``, fixed.
        weight: the term's weight.
    """
    return weight / 2.0 * (vector - centre).square().sum()


def squared_distance(module: nn.Module, part: Part, centre: torch.Tensor) -> torch.Tensor:
    """||w - c||^2 of ``part``'s live parameters w and a fixed ``centre`` c, shape ``(size(part),)``.

    A scalar whose gradient in w is 2 (w - c) (none reaches ``centre``, which
    is data: a received or detached vector); a proximal term mu/2 ||w - c||^2
    is ``mu / 2 * squared_distance(module, part, c)``.
    """
    return (live_vector(module, part) - centre).square().sum()


class _TrainingStep(nn.Module):
    """Exposes ``module.training_step`` as ``forward``, so ``functional_call`` can run it."""

    def __init__(self, module: FederatedModule) -> None:
        super().__init__()
        self.module = module

    def forward(self, batch: Any) -> torch.Tensor:
        return self.module.training_step(batch, 0)


def training_loss_with(module: nn.Module, parameters: dict[str, torch.Tensor], batch: Any) -> torch.Tensor:
    """The module's training loss on ``batch`` with its parameters replaced by ``parameters``.

    Args:
        module: the site's module (Fabric-wrapped or not).
        parameters: ``{parameter name: tensor of that parameter's shape}``;
            any tensor, e.g. a differentiable combination of other tensors
            (gradients flow to whatever it was computed from). Buffers may be
            named too (e.g. copies, for a pass that must not move BatchNorm
            statistics). Whatever is not named keeps the module's own values.
        batch: a device batch, as ``training_step`` takes it.

    Returns:
        The scalar loss of ``training_step(batch, 0)``.
    """
    wrapper = _TrainingStep(unwrap(module))
    return torch.func.functional_call(wrapper, {f"module.{name}": t for name, t in parameters.items()}, (batch,))


def gradient_only(term: torch.Tensor) -> torch.Tensor:
    """``term - sg(term)``: 0 in value (exactly, for a finite ``term``), ``term``'s gradient in everything it depends on.

    Added to a step's loss, it trains what ``term`` depends on without changing
    the loss the step reports (APFL's mixture loss, which trains v and alpha
    beside w's reported loss).
    """
    return term - term.detach()
