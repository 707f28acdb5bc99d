"""A second head whose output adds to the model's own (FedRoD's personalised predictor), for any FederatedModule.

Write a model's forward as F(x; theta, psi), theta its shared part (the
body) and psi its personal part (the head), as the model's split names them
(:mod:`medfed.models.split`). :func:`attach_additive_head` gives the model a
second head phi, a copy of psi's parameters (so phi starts equal to psi),
and makes its forward return the *personalised prediction*::

    forward(x) = sg(F(x; theta, psi)) + F(x; sg(theta), phi)

sg(.) the stop-gradient: the first term is the generic predictor's output,
the second the head phi on top of the body's features, and a loss of the
output trains phi alone (FedRoD's personalised head, learnt on the empirical
loss on top of the generic predictor; in evaluation the sg changes nothing).
F(x; sg(theta), phi) is the model's own forward with its parameters replaced
(``torch.func.functional_call``), so "the head on the body's features" holds
for any architecture with no model code: a linear classifier (the DenseNet's;
the logistic regression's, whose body is empty and whose features are the
inputs) or a U-Net decoder, which reads every encoder level through the skip
connections. It costs a second forward pass of the body: the features are
not cached between the two terms.

Inside :func:`generic_output` the forward is the generic predictor instead,
not detached, plus an optional shift (the log prior of the Balanced Softmax
loss, :meth:`~medfed.models.base.FederatedModule.log_prior`)::

    forward(x) = F(x; theta, psi) + shift

phi is ``model.additive_head.phi`` (an ``nn.ParameterList`` in the order of
the split's personal names): in the state dict, and in the optimiser when it
is attached before the optimiser is made (``Strategy.prepare_slot``), but in
no part of the split, so no vector a strategy sends carries it, and
``set_trainable`` leaves it trainable. The head's buffers, if it had any
(medfed's heads have none), would serve both heads.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from medfed.models.base import FederatedModule


class AdditiveHead(nn.Module):
    """phi, and the mode the model's forward hook reads (see the module docstring).

    Attributes:
        phi: copies of the personal part's parameters, split order.
        generic: the forward returns F(x; theta, psi) (+ ``shift``).
        shift: added to the generic output, or None.
        inner: set while the hook runs F(x; sg(theta), phi) (the hook then
            leaves the output alone).
    """

    def __init__(self, model: FederatedModule) -> None:
        super().__init__()
        live = dict(model.named_parameters())
        self.phi = nn.ParameterList([nn.Parameter(live[name].detach().clone()) for name in model.parameter_split.personal])
        self.generic = False
        self.shift: torch.Tensor | None = None
        self.inner = False

    def personal_output(self, model: FederatedModule, args: tuple) -> torch.Tensor:
        """F(x; sg(theta), phi): the model's forward on ``args`` with the body detached and the head replaced by phi."""
        split = model.parameter_split
        live = dict(model.named_parameters())
        substitutes = {name: live[name].detach() for name in split.shared}
        substitutes.update(zip(split.personal, self.phi))
        self.inner = True
        try:
            return torch.func.functional_call(model, substitutes, args)
        finally:
            self.inner = False


def attach_additive_head(model: FederatedModule) -> None:
    """Give ``model`` the head phi (= its personal part now) and make its forward the personalised prediction."""
    if hasattr(model, "additive_head"):
        raise ValueError(f"{type(model).__name__} already has an additive head")
    model.additive_head = AdditiveHead(model)
    model.register_forward_hook(_add_head_output)


def _add_head_output(model: FederatedModule, args: tuple, output: torch.Tensor) -> torch.Tensor:
    """The forward hook: turns F(x; theta, psi) into the output of the current mode."""
    head = model.additive_head
    if head.inner:
        return output
    if head.generic:
        return output if head.shift is None else output + head.shift
    return output.detach() + head.personal_output(model, args)


@contextmanager
def generic_output(model: FederatedModule, shift: torch.Tensor | None = None) -> Iterator[None]:
    """Inside the block ``model``'s forward is F(x; theta, psi) + ``shift`` (broadcast against the output)."""
    head = model.additive_head
    head.generic, head.shift = True, shift
    try:
        yield
    finally:
        head.generic, head.shift = False, None
