"""Fresh 2-D axial training crops every epoch, cut from volumes kept in memory and augmented.

The paper's protocol cuts a site's training patches once (:mod:`medfed.data.patches`).
:class:`RandomCrops` instead keeps the site's training volumes in memory
(:func:`training_volume`: cropped to the bounding box of everything non-zero,
image as float16) and cuts a new crop for every item of every pass:

* **Slots.** Each case has as many slots as it has fixed patches
  (``tumour_patches_per_case`` tumour-centred ones, then
  ``background_patches_per_case`` background ones; a kind without a
  candidate centre gets none), so an epoch has exactly as many crops as the
  fixed protocol has patches, in the same tumour/background ratio, at every
  epoch: the balance of MONAI's ``RandCropByPosNegLabeld`` without its
  per-draw coin flip.
* **Centres.** A tumour slot centres its crop on a tumour voxel, a
  background slot on a brain voxel whose crop holds no tumour
  (:func:`~medfed.data.patches.tumour_free_centres`), drawn uniformly; the
  crop is the axial slice through the centre, zero outside the volume,
  exactly as :func:`~medfed.data.patches.extract_axial_patches` cuts it.
* **Augmentation** (:class:`Augmentation`), per crop: each in-plane axis
  mirrored with probability ``flip_prob`` (image and label together), then
  every channel's non-zero values scaled by ``1 + f`` and shifted by ``o``,
  ``f ~ U(-scale, scale)``, ``o ~ U(-shift, shift)`` drawn per channel (the
  rules of MONAI's ``RandFlipd``, ``RandScaleIntensityd`` and
  ``RandShiftIntensityd`` with ``channel_wise=True``; here as a few tensor
  operations, since MONAI's per-call overhead would cost more than the crop).
  Zeros stay zero: background, and a missing (zero-filled) sequence, remain
  exactly 0.

**Randomness.** Item ``(slot, seed)`` is a pure function of the slot and the
seed. :meth:`RandomCrops.sampler` draws, per pass, a permutation of the slots
and one seed per slot from the site's generator, so the crops depend on that
generator's state only, which the site checkpoints: the same run seed gives
the same crops, a resumed run the crops of an uninterrupted one.

**Reference set.** ``tensors`` (and an integer index) are the fixed patches
of the paper's protocol for the same slots; whatever reads a site's training
split as a fixed set (pFedNet's data sketch, PGFed's full-split gradient)
reads those.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch
from torch.utils.data import Sampler, TensorDataset

from medfed.data.brats import tumour_regions
from medfed.options.tasks import Augmentation

_SEED_HIGH = 2**62
"""Crop seeds are drawn from [0, _SEED_HIGH)."""


def training_volume(image: np.ndarray, label: np.ndarray, tumour: np.ndarray, background: np.ndarray) -> dict[str, torch.Tensor]:
    """One training case as :class:`RandomCrops` keeps it: cropped to what matters, candidate centres as flat indices.

    Args:
        image: float32 ``(C, X, Y, Z)``, normalised (and a missing channel zeroed).
        label: uint8 ``(X, Y, Z)`` :class:`~medfed.data.brats.TumourLabel` values.
        tumour, background: bool ``(X, Y, Z)`` masks of the tumour and
            background crop centres.

    Returns:
        Plain tensors (they go into the preprocessed-data cache), all cut to
        the bounding box of the non-zero image voxels, the labels and the
        centres, outside of which image and label are 0, so a crop from it is
        the crop from the whole volume: ``image`` float16 ``(C, x, y, z)``,
        ``label`` uint8 ``(x, y, z)``, ``tumour`` and ``background`` int32
        flat indices into ``(x, y, z)``.
    """
    inside = (image != 0).any(axis=0) | (label > 0) | tumour | background
    box = tuple(slice(int(where.min()), int(where.max()) + 1) for where in np.nonzero(inside)) if inside.any() else (slice(0, 0),) * 3
    return {
        "image": torch.from_numpy(image[(slice(None), *box)].astype(np.float16)),
        "label": torch.from_numpy(np.ascontiguousarray(label[box], dtype=np.uint8)),
        "tumour": torch.from_numpy(np.flatnonzero(tumour[box]).astype(np.int32)),
        "background": torch.from_numpy(np.flatnonzero(background[box]).astype(np.int32)),
    }


def axial_crop(volume: torch.Tensor, centre: tuple[int, int, int], size: int) -> torch.Tensor:
    """``(..., X, Y, Z)`` -> ``(..., P, P)``: pixel (i, j) is voxel (cx - P//2 + i, cy - P//2 + j, cz), 0 outside the volume."""
    half = size // 2
    x0, y0 = centre[0] - half, centre[1] - half
    xa, xb = max(x0, 0), min(x0 + size, volume.shape[-3])
    ya, yb = max(y0, 0), min(y0 + size, volume.shape[-2])
    out = volume.new_zeros(*volume.shape[:-3], size, size)
    out[..., xa - x0 : xb - x0, ya - y0 : yb - y0] = volume[..., xa:xb, ya:yb, centre[2]]
    return out


class RandomCrops(TensorDataset):
    """A site's training split that cuts a fresh, augmented crop per item (see the module docstring).

    Args:
        reference: the fixed patches ``(x, y)`` of the same slots (``tensors``).
        volumes: the site's training cases from :func:`training_volume`, in
            the order of the reference patches.
        tumour_per_case, background_per_case: slots per case of each kind
            (a kind without candidates has none).
        patch_size: side P of a crop.
        regions: ``wt`` (y int64 ``(P, P)``, 1 = whole tumour) or ``brats``
            (y uint8 ``(3, P, P)``, WT/TC/ET masks), as the reference patches.
        augmentation: the flips and intensity changes.

    Items: ``dataset[(slot, seed)]`` is a fresh crop ``(x float32 (C, P, P), y)``;
    ``dataset[slot]`` is the slot's reference patch.
    """

    def __init__(
        self,
        reference: tuple[torch.Tensor, torch.Tensor],
        volumes: list[dict[str, torch.Tensor]],
        tumour_per_case: int,
        background_per_case: int,
        patch_size: int,
        regions: str,
        augmentation: Augmentation,
    ) -> None:
        super().__init__(*reference)
        self.volumes = volumes
        self.patch_size = patch_size
        self.regions = regions
        self.augmentation = augmentation
        cases, tumour = [], []
        for case, volume in enumerate(volumes):
            for is_tumour, count in ((True, tumour_per_case), (False, background_per_case)):
                if len(volume["tumour" if is_tumour else "background"]) > 0:
                    cases += [case] * count
                    tumour += [is_tumour] * count
        if len(cases) != len(self):
            raise ValueError(f"{len(cases)} crop slots for {len(self)} reference patches: the volumes do not match the patches")
        self.slot_case = torch.tensor(cases, dtype=torch.int64, device="cpu")
        """int64 ``(n,)``: the case of each slot."""
        self.slot_tumour = torch.tensor(tumour, dtype=torch.bool, device="cpu")
        """bool ``(n,)``: whether each slot's crop is tumour-centred."""

    def sampler(self, generator: torch.Generator) -> CropSampler:
        """The site's training order and crop seeds, both drawn from its (checkpointed) ``generator``."""
        return CropSampler(len(self), generator)

    def __getitem__(self, key: int | tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        if isinstance(key, tuple):
            return self.crop(*key)
        return super().__getitem__(key)

    def crop(self, slot: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Slot ``slot``'s crop for ``seed``: its centre, flips, scales and shifts all drawn from ``seed``."""
        generator = torch.Generator().manual_seed(seed)
        volume = self.volumes[int(self.slot_case[slot])]
        candidates = volume["tumour" if self.slot_tumour[slot] else "background"]
        flat = int(candidates[torch.randint(len(candidates), (1,), generator=generator, device="cpu")])
        centre = tuple(int(i) for i in np.unravel_index(flat, volume["label"].shape))
        image = axial_crop(volume["image"], centre, self.patch_size).float()  # (C, P, P)
        label = axial_crop(volume["label"], centre, self.patch_size)  # (P, P)

        # One fixed layout of draws, whatever the settings: the crop for a seed moves only where a setting acts.
        channels = image.shape[0]
        flips, factors, offsets = torch.rand(2 + 2 * channels, generator=generator, device="cpu").split([2, channels, channels])
        mirrored = [dim for dim, u in zip((-2, -1), flips.tolist()) if u < self.augmentation.flip_prob]
        if mirrored:
            image, label = image.flip(mirrored), label.flip(mirrored)
        scale = 1.0 + self.augmentation.scale * (2.0 * factors - 1.0)
        shift = self.augmentation.shift * (2.0 * offsets - 1.0)
        image = torch.where(image != 0, image * scale[:, None, None] + shift[:, None, None], 0.0)

        if self.regions == "wt":
            return image, (label > 0).long()
        return image, torch.from_numpy(tumour_regions(label.numpy()))


class CropSampler(Sampler[tuple[int, int]]):
    """Keys ``(slot, seed)`` of :class:`RandomCrops`: per pass a permutation of the ``n`` slots and ``n`` fresh seeds from ``generator``."""

    def __init__(self, n: int, generator: torch.Generator) -> None:
        self.n = n
        self.generator = generator

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Iterator[tuple[int, int]]:
        order = torch.randperm(self.n, generator=self.generator, device="cpu")
        seeds = torch.randint(_SEED_HIGH, (self.n,), generator=self.generator, device="cpu")
        return zip(order.tolist(), seeds.tolist())
