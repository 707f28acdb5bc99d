import numpy as np

from medfed.data.patches import extract_axial_patches, sample_centres, tumour_free_centres, zscore_over_brain


def test_patches_equal_direct_slicing_with_zero_padding():
    rng = np.random.default_rng(0)
    image = rng.normal(size=(3, 20, 18, 6)).astype(np.float32)
    target = rng.integers(0, 2, size=(20, 18, 6))
    centres = np.array([[10, 9, 2], [0, 0, 5], [19, 17, 0]])
    x, y = extract_axial_patches(image, target, centres, 8)
    assert x.shape == (3, 3, 8, 8) and y.shape == (3, 8, 8) and x.dtype == np.float32 and y.dtype == np.int64
    assert np.array_equal(x[0], image[:, 6:14, 5:13, 2])  # interior patch: plain slicing
    assert np.array_equal(y[0], target[6:14, 5:13, 2])
    # corner patch: the top-left quarter lies outside the volume and is zero
    assert np.all(x[1][:, :4, :] == 0) and np.all(x[1][:, :, :4] == 0)
    assert np.array_equal(x[1][:, 4:, 4:], image[:, 0:4, 0:4, 5])


def test_tumour_free_centres_have_no_tumour_in_their_patch():
    tumour = np.zeros((40, 40, 3), bool)
    tumour[20, 20, 1] = True
    brain = np.ones_like(tumour)
    valid = tumour_free_centres(brain, tumour, 8)
    assert valid[:, :, 0].all() and valid[:, :, 2].all()  # other slices are all valid
    centres = np.argwhere(valid)
    x, y = extract_axial_patches(np.zeros((1, 40, 40, 3), np.float32), tumour.astype(np.int64), centres, 8)
    assert y.sum() == 0
    assert not valid[17, 17, 1] and not valid[24, 24, 1] and valid[11, 20, 1]


def test_sample_centres_stays_in_mask_and_is_seeded():
    mask = np.zeros((10, 10, 4), bool)
    mask[2:4, 5:7, 1] = True
    a = sample_centres(mask, 3, np.random.default_rng(5))
    assert mask[tuple(a.T)].all()
    assert np.array_equal(a, sample_centres(mask, 3, np.random.default_rng(5)))
    assert sample_centres(np.zeros_like(mask), 3, np.random.default_rng(0)).shape == (0, 3)


def test_zscore_over_brain_keeps_background_and_missing_channels_zero():
    image = np.zeros((2, 4, 4, 2), np.float32)
    image[0, 1:3, 1:3, :] = np.arange(8).reshape(2, 2, 2) + 100.0
    out = zscore_over_brain(image)
    assert np.isclose(out[0][image[0] != 0].mean(), 0, atol=1e-6) and np.isclose(out[0][image[0] != 0].std(), 1, atol=1e-5)
    assert np.all(out[:, ~(image[0] != 0)] == 0) and np.all(out[1] == 0)
