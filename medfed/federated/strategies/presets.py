"""A strategy's budget preset: ``equal`` (its plans share ``trainer.local_epochs``) or ``published`` (its paper's protocol).

Every strategy whose published protocol trains more than the budget per
round has the option ``preset`` (``strategy.<name>.preset: published``, or
``strategy.fedrep.preset=published`` on the command line); its options
that split the budget default to ``null``, meaning "as the preset says", and
a value set explicitly wins over the preset. The split of each preset is in
the strategy's docstring; the budget itself in
:mod:`medfed.federated.strategies.base`.
"""

from __future__ import annotations

from typing import TypeVar

from medfed.config import require

EQUAL, PUBLISHED = "equal", "published"
PRESETS = (EQUAL, PUBLISHED)

T = TypeVar("T")


def check_preset(preset: str) -> None:
    """Refuse a preset that is not one of :data:`PRESETS` (naming the option)."""
    require(preset in PRESETS, "preset", preset, f"one of {', '.join(PRESETS)}")


def by_preset(preset: str, equal: T, published: T) -> T:
    """The value ``preset`` gives an option left null: ``equal``'s or ``published``'s."""
    return published if preset == PUBLISHED else equal
