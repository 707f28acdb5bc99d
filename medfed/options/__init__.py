"""The config options of every component, declared without torch.

One module per kind of component, each a set of plain dataclasses that a
config group is checked against (:func:`medfed.config.parse_options`):
:mod:`~medfed.options.tasks` (``data``, and the models each task's samples
fit), :mod:`~medfed.options.models` (``model``) and
:mod:`~medfed.options.strategies` (``strategy.<name>``). The components set
them as their ``Options``; keeping them here, away from torch, Lightning and
MONAI, is what lets ``fit --print-config`` and a config error answer at once
(:mod:`medfed.components`).
"""
