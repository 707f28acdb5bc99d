"""BraTS ``data.train_sampling: random_crops``: fresh, balanced, augmented crops per epoch, seeded and resumable."""

import json

import numpy as np
import pytest
import torch

from medfed.cli import INTERRUPTED, main
from medfed.config import FederationConfig, MissingChannelConfig
from medfed.data.crops import Augmentation, RandomCrops, axial_crop, training_volume
from medfed.data.patches import extract_axial_patches
from medfed.errors import ConfigError
from medfed.federated.loop import FederatedLoop
from medfed.tasks import brats

P = 32
TUMOUR, BACKGROUND = 4, 2  # slots per case
NO_AUGMENTATION = Augmentation(flip_prob=0.0, scale=0.0, shift=0.0)


def _options(root, **keys):
    return brats.Options(
        root=str(root), generate=None, patch_size=P, tumour_patches_per_case=TUMOUR, background_patches_per_case=BACKGROUND, **keys
    )


def _federation(root, **keys):
    """The tiny data set, 3 sites, T1 (channel 1) missing at site 2."""
    federation = FederationConfig(n_sites=3, missing_channel=MissingChannelConfig(channel=1, sites=[2]))
    return brats.build_federation(_options(root, **keys), federation, seed=0, progress=False)


@pytest.fixture(scope="module")
def crop_sites(tiny_brats_root):
    return _federation(tiny_brats_root, train_sampling="random_crops").sites


def _with(site, augmentation, regions="wt"):
    """Site ``site``'s crops under other augmentation settings (or regions: the reference patches stay those of ``wt``)."""
    return RandomCrops(site.train.tensors, site.train_volumes, TUMOUR, BACKGROUND, P, regions, augmentation)


def _passes(dataset, seed, n_passes):
    """The ``(slot, x, y)`` items of ``n_passes`` passes of a sampler on a generator seeded with ``seed``."""
    sampler = dataset.sampler(torch.Generator().manual_seed(seed))
    return [[(slot, *dataset[(slot, crop_seed)]) for slot, crop_seed in sampler] for _ in range(n_passes)]


def _by_slot(items):
    return {slot: (x, y) for slot, x, y in items}


def test_the_same_seed_gives_the_same_crops_and_every_epoch_new_ones(crop_sites):
    site = crop_sites[0]
    first, again, other_seed = _passes(site.train, 0, 2), _passes(site.train, 0, 2), _passes(site.train, 1, 1)
    for pass_a, pass_b in zip(first, again):
        assert [slot for slot, _, _ in pass_a] == [slot for slot, _, _ in pass_b]
        assert all(torch.equal(xa, xb) and torch.equal(ya, yb) for (_, xa, ya), (_, xb, yb) in zip(pass_a, pass_b))
    assert sorted(slot for slot, _, _ in first[0]) == list(range(len(site.train)))  # every slot once per pass
    assert [slot for slot, _, _ in first[0]] != [slot for slot, _, _ in other_seed[0]]

    epoch_1, epoch_2 = _by_slot(first[0]), _by_slot(first[1])
    assert all(not torch.equal(epoch_1[s][0], epoch_2[s][0]) for s in epoch_1)  # augmented: every crop changes
    plain = _with(site, NO_AUGMENTATION)
    epoch_1, epoch_2 = (_by_slot(items) for items in _passes(plain, 0, 2))
    moved = sum(not torch.equal(epoch_1[s][0], epoch_2[s][0]) for s in epoch_1)
    assert moved >= len(epoch_1) - 1  # a new centre for each slot (hundreds of candidates each)


def test_every_epoch_has_the_fixed_protocols_tumour_and_background_crops_per_case(crop_sites):
    for site in crop_sites:
        dataset = _with(site, NO_AUGMENTATION)
        n_cases = len(site.train_volumes)
        for items in _passes(dataset, 0, 3):
            per_case = np.zeros((n_cases, 2), dtype=int)  # tumour-centred, tumour-free crops
            for slot, _, y in items:
                tumour_centred, tumour_free = bool(y[P // 2, P // 2] == 1), not y.any()
                assert tumour_centred != tumour_free  # one kind or the other, never neither
                per_case[int(dataset.slot_case[slot]), 0 if tumour_centred else 1] += 1
            assert (per_case == [[TUMOUR, BACKGROUND]] * n_cases).all()


def test_flips_mirror_image_and_label_and_intensity_changes_only_non_zero_values(crop_sites):
    site = crop_sites[2]  # T1 missing
    plain, flipped = _with(site, NO_AUGMENTATION), _with(site, Augmentation(flip_prob=1.0, scale=0.0, shift=0.0))
    intensity = _with(site, Augmentation(flip_prob=0.0, scale=0.2, shift=0.3))
    for regions in ("wt", "brats"):
        plain_t, flipped_t = _with(site, NO_AUGMENTATION, regions), _with(site, flipped.augmentation, regions)
        for slot in range(len(plain)):
            x, y = plain_t[(slot, 7)]
            x_flipped, y_flipped = flipped_t[(slot, 7)]
            assert torch.equal(x_flipped, x.flip((-2, -1))) and torch.equal(y_flipped, y.flip((-2, -1)))
        assert y.shape == ((P, P) if regions == "wt" else (3, P, P))

    slopes, intercepts = [], []
    for seed in range(40):
        slot = seed % len(plain)
        (x, y), (x_aug, y_aug) = plain[(slot, seed)], intensity[(slot, seed)]
        assert torch.equal(y_aug, y) and torch.count_nonzero(x_aug[1]) == 0  # labels untouched, the missing sequence stays 0
        for channel in (0, 2, 3):
            inside = x[channel] != 0
            assert torch.equal(x_aug[channel] != 0, inside)  # background stays exactly 0
            a, b = np.polyfit(x[channel][inside].double().numpy(), x_aug[channel][inside].double().numpy(), 1)
            assert torch.allclose(x_aug[channel][inside].double(), a * x[channel][inside].double() + b, atol=1e-5)  # affine per channel
            slopes.append(a)
            intercepts.append(b)
    assert 0.8 <= min(slopes) < 0.85 and 1.15 < max(slopes) <= 1.2  # 1 + U(-0.2, 0.2), 120 draws
    assert -0.3 <= min(intercepts) < -0.25 and 0.25 < max(intercepts) <= 0.3  # U(-0.3, 0.3)


def test_a_crop_from_the_kept_bounding_box_is_the_crop_from_the_whole_volume():
    rng = np.random.default_rng(0)
    image = np.zeros((4, 20, 24, 10), dtype=np.float32)
    image[:, 3:15, 5:20, 2:8] = rng.normal(size=(4, 12, 15, 6))
    label = np.zeros((20, 24, 10), dtype=np.uint8)
    label[6:9, 8:12, 4:6] = 2
    tumour = label > 0
    background = np.zeros_like(tumour)
    background[3, 19, 2] = background[14, 5, 7] = True  # corners of the box: crops reach past the volume's edge
    kept = training_volume(image, label, tumour, background)
    assert kept["image"].shape == (4, 12, 15, 6) and kept["image"].dtype == torch.float16 and kept["label"].shape == (12, 15, 6)
    assert len(kept["tumour"]) == tumour.sum() and len(kept["background"]) == 2
    whole = image.astype(np.float16).astype(np.float32)  # what the kept float16 image holds
    for flat in torch.cat([kept["tumour"], kept["background"]]).tolist():
        centre = np.unravel_index(flat, kept["label"].shape)
        in_volume = np.array(centre) + (3, 5, 2)
        x, y = extract_axial_patches(whole, label.astype(np.int64), in_volume[None], 8)
        assert torch.equal(axial_crop(kept["image"], centre, 8).float(), torch.from_numpy(x[0]))
        assert torch.equal(axial_crop(kept["label"], centre, 8).long(), torch.from_numpy(y[0]))


def test_the_reference_set_and_the_evaluation_split_are_the_fixed_protocols(tiny_brats_root, crop_sites):
    fixed = _federation(tiny_brats_root)
    for crops, patches in zip(crop_sites, fixed.sites):
        assert isinstance(crops.train, RandomCrops) and patches.train_volumes is None
        assert len(crops.train) == len(patches.train)
        assert all(torch.equal(a, b) for a, b in zip(crops.train.tensors, patches.train.tensors))
        assert all(torch.equal(a, b) for a, b in zip(crops.train[3], patches.train[3]))  # an integer index: the reference patch
        assert all(torch.equal(a, b) for a, b in zip(crops.test.tensors, patches.test.tensors))


def test_the_volumes_are_cached_and_augmentation_settings_reuse_the_entry(tiny_brats_root, crop_sites):
    again = _federation(tiny_brats_root, train_sampling="random_crops", augment=Augmentation(flip_prob=1.0))
    fixed = _federation(tiny_brats_root)
    assert again.cache["hit"] and again.cache["key"] != fixed.cache["key"]
    assert again.sites[0].train.augmentation.flip_prob == 1.0
    for kept, read in zip(again.sites[0].train_volumes, crop_sites[0].train_volumes):
        assert kept.keys() == read.keys() and all(torch.equal(kept[name], read[name]) for name in kept)
    with pytest.raises(ConfigError, match="train_sampling"):
        _options(tiny_brats_root, train_sampling="random")
    with pytest.raises(ConfigError, match="augment.flip_prob"):
        Augmentation(flip_prob=2.0)


def _results(path):
    return json.loads((path / "results.json").read_text())


def test_a_random_crops_run_resumes_to_the_same_metrics(tiny_run_config, tmp_path, monkeypatch):
    crops = ["--quiet", "data.train_sampling=random_crops", "trainer.rounds=2"]
    full, interrupted = tmp_path / "full", tmp_path / "interrupted"
    assert main(["fit", "--config", str(tiny_run_config), *crops, f"output_dir={full}"]) == 0
    original = FederatedLoop._run_round

    def crash_in_round_2(self, round_index):
        if round_index == 2:
            raise KeyboardInterrupt("simulated interruption")
        return original(self, round_index)

    monkeypatch.setattr(FederatedLoop, "_run_round", crash_in_round_2)
    assert main(["fit", "--config", str(tiny_run_config), *crops, f"output_dir={interrupted}"]) == INTERRUPTED
    monkeypatch.setattr(FederatedLoop, "_run_round", original)
    assert main(["fit", "--config", str(tiny_run_config), *crops, "--resume", f"output_dir={interrupted}"]) == 0

    resumed, uninterrupted = _results(interrupted), _results(full)
    assert uninterrupted["config"]["data"]["train_sampling"] == "random_crops"
    assert [site["n_train"] for site in uninterrupted["federation"]["sites"]] == [6 * len(site["train_cases"]) for site in uninterrupted["federation"]["sites"]]
    assert resumed["sites"] == uninterrupted["sites"]
    assert [r["metrics"] for r in resumed["history"]] == [r["metrics"] for r in uninterrupted["history"]]
