"""Whole-volume evaluation against hand computations, a brute-force Hausdorff reference and MONAI's whole-grid HD95."""

import warnings
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from monai.metrics import compute_hausdorff_distance
from scipy.ndimage import binary_dilation, binary_erosion
from scipy.spatial.distance import cdist

from medfed.data.brats import TumourLabel, find_cases, load_case, whole_tumour
from medfed.data.federation import EvaluationVolume
from medfed.evaluation.rounds import VolumeEvaluation
from medfed.evaluation.volume import bounding_box, mean_over_patients, region_scores, segment_volume


def _box(shape, lo, hi):
    mask = np.zeros(shape, dtype=bool)
    mask[tuple(slice(a, b) for a, b in zip(lo, hi))] = True
    return mask


def _brute_force_hd95(a, b, spacing):
    """Edges = mask minus its erosion; 95th percentile of nearest-edge distances, both ways, the larger."""
    edge = lambda m: np.argwhere(m & ~binary_erosion(m)) * np.asarray(spacing)  # noqa: E731
    distances = cdist(edge(a), edge(b))
    return max(np.percentile(distances.min(axis=1), 95), np.percentile(distances.min(axis=0), 95))


def test_a_perfect_prediction_scores_one_and_zero_distance():
    truth = _box((20, 20, 10), (5, 6, 2), (12, 15, 7))
    assert region_scores(truth, truth, (1.0, 1.0, 1.0)) == {"dice": 1.0, "iou": 1.0, "hd95": 0.0}


def test_a_shifted_box_scores_the_hand_computed_overlap_and_the_brute_force_distance():
    shape, spacing = (24, 24, 12), (1.0, 1.5, 2.0)
    truth = _box(shape, (4, 5, 2), (14, 15, 8))  # 10 x 10 x 6
    prediction = _box(shape, (7, 5, 2), (17, 15, 8))  # shifted 3 voxels along x
    scores = region_scores(prediction, truth, spacing)
    assert scores["dice"] == pytest.approx(2 * 7 / 20)  # overlap 7 x 10 x 6 of two 10 x 10 x 6 boxes
    assert scores["iou"] == pytest.approx(7 / 13)
    assert scores["hd95"] == pytest.approx(_brute_force_hd95(prediction, truth, spacing), rel=1e-5)
    assert scores["hd95"] > 0


def test_empty_masks_follow_the_brats_conventions():
    shape, spacing = (10, 8, 6), (1.0, 2.0, 3.0)
    empty, truth = np.zeros(shape, dtype=bool), _box(shape, (2, 2, 2), (5, 5, 4))
    assert region_scores(empty, empty, spacing) == {"dice": 1.0, "iou": 1.0, "hd95": 0.0}
    missed = region_scores(empty, truth, spacing)
    assert missed["dice"] == 0.0 and missed["iou"] == 0.0
    assert missed["hd95"] == pytest.approx(np.sqrt(10**2 + 16**2 + 18**2))  # the grid's diagonal in mm


def test_segment_volume_tiles_slices_larger_than_the_patch_exactly():
    """A predictor that copies channel 0 must reproduce it over the whole volume, whatever the tiling."""
    generator = torch.Generator().manual_seed(0)
    image = torch.rand(2, 37, 29, 5, generator=generator, device="cpu")
    output = segment_volume(lambda patches: patches[:, :1] * 2.0, image, patch_size=16, batch_size=3)
    assert output.shape == (1, 37, 29, 5)
    torch.testing.assert_close(output[0], image[0] * 2.0, rtol=1e-5, atol=1e-6)


def test_per_site_scores_are_the_mean_over_patients():
    assert mean_over_patients([{"dice": 1.0, "hd95": 0.0}, {"dice": 0.5, "hd95": 4.0}]) == {"dice": 0.75, "hd95": 2.0}
    assert mean_over_patients([]) == {}


class _ChannelZeroModule(torch.nn.Module):
    """A 'model' whose whole-tumour logit is channel 0 of its input."""

    region_names = ("wt",)

    def forward(self, x):
        return torch.cat([-x[:, :1], x[:, :1]], dim=1)

    def region_masks(self, output):
        return (output.argmax(dim=1) == 1).unsqueeze(1)


class _Volumes:
    """One patient whose channel 0 is the whole tumour moved ``shift`` voxels along x (what the 'model' will predict)."""

    def __init__(self, label, shift=0):
        self.label, self.shift = label, shift

    def n_volumes(self, site):
        return 1

    def site_volumes(self, site):
        predicted = np.roll(self.label > 0, self.shift, axis=0)
        image = np.stack([np.where(predicted, 5.0, -5.0), np.zeros(self.label.shape)]).astype(np.float32)
        yield EvaluationVolume("case", image, self.label, (1.0, 1.0, 2.0))


def _site(module):
    return SimpleNamespace(index=0, name="site0", module=module, fabric=SimpleNamespace(device=torch.device("cpu")))


def test_the_round_evaluation_scores_a_perfect_and_a_shifted_model_on_a_whole_volume():
    label = np.zeros((40, 36, 6), dtype=np.uint8)
    label[10:20, 8:18, 1:5] = TumourLabel.OEDEMA
    label[12:16, 10:14, 2:4] = TumourLabel.ENHANCING
    evaluation = VolumeEvaluation(_Volumes(label), patch_size=16, every=2, last_round=5, batch_size=4)
    assert evaluation.evaluate_site(_site(_ChannelZeroModule())) == {"case": {"dice_wt": 1.0, "iou_wt": 1.0, "hd95_wt": 0.0}}
    shifted = VolumeEvaluation(_Volumes(label, shift=3), patch_size=16, every=2, last_round=5, batch_size=4)
    scores = shifted.evaluate_site(_site(_ChannelZeroModule()))["case"]
    assert scores["dice_wt"] == pytest.approx(7 / 10)  # a 10-voxel extent moved 3 voxels: 7 / 10 of it overlaps
    assert scores["hd95_wt"] == pytest.approx(_brute_force_hd95(np.roll(label > 0, 3, axis=0), label > 0, (1.0, 1.0, 2.0)), rel=1e-5)
    assert [evaluation.due(r) for r in range(1, 6)] == [False, True, False, True, True]


def _real_cases(root, count=3):
    """The whole-tumour mask and the voxel size (mm) of the first ``count`` generated cases, read through the BraTS reader."""
    cases = []
    for case in find_cases(root)[:count]:
        volume = load_case(case)
        cases.append((whole_tumour(volume.label), tuple(float(s) for s in np.linalg.norm(volume.affine[:3, :3], axis=0))))
    return cases


def _monai_whole_grid_hd95(prediction, truth, spacing):
    as_batch = lambda mask: torch.from_numpy(np.ascontiguousarray(mask))[None, None]  # noqa: E731
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        distance = compute_hausdorff_distance(as_batch(prediction), as_batch(truth), include_background=True, percentile=95, spacing=list(spacing))
        return float(distance)


def test_hd95_on_the_masks_bounding_box_equals_monais_whole_grid_value_on_real_cases(tiny_brats_root):
    rng = np.random.default_rng(0)
    for truth, spacing in _real_cases(tiny_brats_root):
        assert truth.any()
        shifted = np.roll(truth, 2, axis=0)
        scattered = binary_dilation(truth, iterations=1)  # a grown tumour with false positives across the grid
        scattered[tuple(rng.integers(0, n, size=40) for n in truth.shape)] = True
        at_the_border = truth.copy()
        at_the_border[0, :, truth.shape[2] // 2] = True  # a false positive along the grid's edge
        for prediction in (shifted, scattered, at_the_border, truth):
            expected = _monai_whole_grid_hd95(prediction, truth, spacing)
            assert region_scores(prediction, truth, spacing)["hd95"] == pytest.approx(expected, rel=1e-5, abs=1e-6)
            assert region_scores(truth, prediction, spacing)["hd95"] == pytest.approx(expected, rel=1e-5, abs=1e-6)  # symmetric
        assert min(region_scores(p, truth, spacing)["hd95"] for p in (shifted, scattered, at_the_border)) > 0
        assert region_scores(truth, truth, spacing)["hd95"] == 0.0
        empty = np.zeros_like(truth)  # nothing predicted: the whole grid's diagonal, not the box's
        diagonal = float(np.linalg.norm(np.asarray(truth.shape) * np.asarray(spacing)))
        assert region_scores(empty, truth, spacing)["hd95"] == pytest.approx(diagonal)
        assert region_scores(truth, empty, spacing)["hd95"] == pytest.approx(diagonal)


def test_bounding_box_is_the_smallest_box_holding_the_mask():
    mask = np.zeros((6, 7, 8), dtype=bool)
    mask[1, 2, 3] = mask[4, 2, 6] = mask[2, 5, 3] = True
    assert bounding_box(mask) == (slice(1, 5), slice(2, 6), slice(3, 7))
    assert mask[bounding_box(mask)].sum() == mask.sum() == 3


def test_a_due_round_gets_the_site_scores_their_mean_and_the_evaluation_time_in_its_record():
    label = np.zeros((40, 36, 6), dtype=np.uint8)
    label[10:20, 8:18, 1:5] = TumourLabel.OEDEMA
    evaluation = VolumeEvaluation(_Volumes(label, shift=3), patch_size=16, every=0, last_round=2, batch_size=4)
    loop = SimpleNamespace(sites=[_site(_ChannelZeroModule())])
    record = {"round": 1, "metrics": {"site0": {"iou": 0.5}}, "mean": {"iou": 0.5}, "timing": {"round_s": 1.0}}
    evaluation.on_round_end(loop, record)  # every=0: only the last round is due
    assert record["timing"] == {"round_s": 1.0} and record["metrics"]["site0"] == {"iou": 0.5}
    record["round"] = 2
    evaluation.on_round_end(loop, record)
    assert record["metrics"]["site0"]["dice_wt"] == pytest.approx(7 / 10) == record["mean"]["dice_wt"]
    assert set(record["mean"]) == {"iou", "dice_wt", "iou_wt", "hd95_wt"}
    assert record["volumes"] == {"site0": {"case": {"dice_wt": pytest.approx(7 / 10), "iou_wt": pytest.approx(7 / 13),
                                                     "hd95_wt": record["metrics"]["site0"]["hd95_wt"]}}}  # each patient's scores
    assert 0 < record["timing"]["volume_eval_s"] < 60


class _SiteVolumes:
    """Random 4-channel volumes per site: sites 0 and 1 two of one shape, site 2 one of another (a ragged group)."""

    def __init__(self):
        generator = np.random.default_rng(0)
        shapes = {0: [(20, 18, 3), (20, 18, 3)], 1: [(20, 18, 3), (20, 18, 3)], 2: [(24, 18, 3)]}
        self.volumes = {}
        for site, site_shapes in shapes.items():
            self.volumes[site] = []
            for k, shape in enumerate(site_shapes):
                label = np.zeros(shape, dtype=np.uint8)
                label[4:12, 5:11, 1:3] = TumourLabel.OEDEMA
                image = generator.normal(size=(4, *shape)).astype(np.float32)
                self.volumes[site].append(EvaluationVolume(f"case{site}{k}", image, label, (1.0, 1.0, 2.0)))

    def n_volumes(self, site):
        return len(self.volumes[site])

    def site_volumes(self, site):
        yield from self.volumes[site]


def test_sites_segmented_stacked_get_the_scores_and_outputs_each_gets_alone():
    from medfed.evaluation.volume import segment_volumes
    from medfed.models.segmentation import UNetSegmenter

    sites = []
    for index in range(3):
        torch.manual_seed(index)  # each site its own model
        module = UNetSegmenter(4, 2, UNetSegmenter.Options(channels=[4, 8], strides=[2], num_res_units=1)).eval()
        sites.append(SimpleNamespace(index=index, name=f"site{index}", module=module, fabric=SimpleNamespace(device=torch.device("cpu"))))
    volumes = _SiteVolumes()
    evaluation = VolumeEvaluation(volumes, patch_size=16, every=0, last_round=1, batch_size=3)
    alone = {site.name: evaluation.evaluate_site(site) for site in sites}
    stacked = evaluation.evaluate_stacked(sites)
    assert list(stacked) == ["site0", "site1", "site2"] and {name: list(cases) for name, cases in stacked.items()} == {
        name: list(cases) for name, cases in alone.items()}
    for name in alone:
        for case, scores in alone[name].items():
            assert stacked[name][case] == pytest.approx(scores, rel=1e-6), (name, case)
    images = [torch.from_numpy(volumes.volumes[i][0].image) for i in (0, 1)]
    joined = segment_volumes([sites[0].module, sites[1].module], images, 16, 3)
    for site, image, output in zip(sites, images, joined):
        with torch.no_grad():
            torch.testing.assert_close(output, segment_volume(site.module, image, 16, 3), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(joined[0], joined[1])  # each its own model
