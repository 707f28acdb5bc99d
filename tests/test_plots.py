"""The run's figures, drawn with the Agg renderer: every text inside the figure, words and units on the axes,
whole-number rounds, the legend off the data, the data's provenance (GENERATED) on every figure."""

import math

import numpy as np
import pytest
import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg

from medfed.federated.strategies.solvers.graph import SimilarityGraph
from medfed.viz.plots import (
    add_source,
    metric_label,
    plot_confusion_matrices,
    plot_learning_curves,
    plot_roc_curves,
    plot_similarity_graphs,
)

SOURCE = "GENERATED BraTS-like data (medfed.data.phantoms.brats v1): 5 sites x 8 cases (10 LGG), 2 mm, seed 0"
TITLE = f"pfednet on brats, seed 0; data: {SOURCE}"


def _drawn(figure):
    """The figure drawn (so every text has its final place); returns the renderer."""
    canvas = FigureCanvasAgg(figure)
    canvas.draw()
    return canvas.get_renderer()


def _texts_outside(figure):
    """What of the drawn figure reaches beyond its edges (a cut title or label): the titles and axis labels
    that do, and "ticks or other artists" when the figure's tight box (every drawn artist) does."""
    renderer = _drawn(figure)
    width, height = figure.bbox.width, figure.bbox.height

    def outside(box):
        return box.x0 < -0.5 or box.y0 < -0.5 or box.x1 > width + 0.5 or box.y1 > height + 0.5

    named = [figure._suptitle] if figure._suptitle is not None else []
    for axis in figure.axes:
        named += [axis.title, axis.xaxis.label, axis.yaxis.label]
    for legend in figure.legends:
        named += legend.get_texts()
    cut = [text.get_text() for text in named if text.get_visible() and text.get_text().strip() and outside(text.get_window_extent(renderer))]
    tight = figure.get_tightbbox(renderer).transformed(figure.dpi_scale_trans)
    if not cut and outside(tight):
        cut.append("ticks or other artists")
    return cut


def _history(rounds=12, volume_rounds=(5, 10, 12)):
    history = []
    for r in range(1, rounds + 1):
        metrics = {f"site{s}": {"iou": 0.2 + 0.05 * r + 0.01 * s, "label_iou": 0.1 + 0.05 * r} for s in range(3)}
        if r in volume_rounds:
            for s, site in enumerate(metrics.values()):
                site.update({"dice_wt": 0.05 * r, "hd95_wt": 120.0 - 8 * r + s})
        mean = {name: float(np.mean([m[name] for m in metrics.values()])) for name in metrics["site0"]}
        history.append({"round": r, "metrics": metrics, "mean": mean})
    return history


def _graph():
    return SimilarityGraph(4, [(0, 1), (1, 2), (2, 3), (0, 3)], [0.9, 0.5, 0.3, 0.7], torch.zeros(4, 4, dtype=torch.float64))


def _scores():
    generator = torch.Generator().manual_seed(0)
    label = torch.randint(0, 2, (60,), generator=generator)
    probability = (0.3 * label + 0.7 * torch.rand(60, generator=generator, dtype=torch.float64)).clamp(0, 1)
    return {f"site{s}": (probability, label) for s in range(4)}


def test_metric_labels_are_words_with_units():
    assert metric_label("hd95_wt") == "HD95, whole tumour\n(mm; whole volumes)"
    assert metric_label("dice_tc") == "Dice, tumour core\n(whole volumes)"
    assert metric_label("label_iou") == "tumour IoU (test patches)"
    assert metric_label("label_iou_et") == "enhancing tumour IoU (test patches)"
    assert metric_label("auroc") == "AUROC"
    assert metric_label("some_new_metric") == "some new metric"


def test_learning_curves_have_readable_axes_whole_rounds_a_legend_off_the_data_and_nothing_cut():
    figure = plot_learning_curves(_history(), TITLE)
    assert _texts_outside(figure) == []
    renderer = _drawn(figure)
    axes = figure.axes
    assert [axis.get_ylabel() for axis in axes] == [metric_label(name) for name in ("iou", "label_iou", "dice_wt", "hd95_wt")]
    assert "mm" in axes[-1].get_ylabel()
    for axis in axes:
        ticks = [tick for tick in axis.get_xticks() if axis.get_xlim()[0] <= tick <= axis.get_xlim()[1]]
        assert ticks and all(float(tick).is_integer() for tick in ticks), ticks
        assert all(label.get_text().lstrip("−-").isdigit() for label in axis.get_xticklabels() if label.get_text())
    (legend,) = figure.legends
    legend_box = legend.get_window_extent(renderer)
    for axis in axes:  # the legend covers no panel, so no point
        assert not legend_box.overlaps(axis.get_window_extent(renderer))
    assert "GENERATED" in figure.get_suptitle()


def test_a_metric_of_one_round_of_many_gets_no_one_dot_panel_but_a_word_in_the_title():
    figure = plot_learning_curves(_history(rounds=20, volume_rounds=(20,)), TITLE)
    assert [axis.get_ylabel() for axis in figure.axes] == [metric_label("iou"), metric_label("label_iou")]
    assert "dice_wt, hd95_wt: evaluated after round 20 only (no curve): see the table and results.json" in " ".join(figure.get_suptitle().split())
    assert all(len(line.get_xdata()) == 20 for axis in figure.axes for line in axis.get_lines())
    assert _texts_outside(figure) == []
    one_round = plot_learning_curves(_history(rounds=1, volume_rounds=(1,)), TITLE)  # a 1-round run: every metric has its dot
    assert len(one_round.axes) == 4


def test_similarity_graph_panels_say_which_rounds_each_graph_served():
    from medfed.federated.strategies.pfednet import _served

    assert _served(0, None) == "built before training, used in every round"  # the data space's graph: the only one
    assert [_served(0, 5), _served(5, 6), _served(6, None)] == [
        "built before training, used in rounds 1-4", "built in round 5, used in round 5", "built in round 6, used from round 6 on",
    ]


def test_segmentation_examples_say_why_a_site_shows_another_sequence_and_draw_every_region():
    from types import SimpleNamespace

    from medfed.viz.plots import plot_segmentation_examples

    class Regions(torch.nn.Module):
        region_names = ("wt", "tc", "et")

        def forward(self, x):
            return torch.stack([x[:, 1], x[:, 1] - 0.5, x[:, 1] - 1.5], dim=1)

        def region_masks(self, output):
            return output > 0

    x = torch.zeros(2, 4, 16, 16)
    x[:, 1, 4:12, 4:12] = 1.0  # T1 only: FLAIR (channel 0) is missing at this site
    y = torch.zeros(2, 3, 16, 16, dtype=torch.uint8)
    y[:, 0, 4:12, 4:12] = y[:, 1, 6:10, 6:10] = y[:, 2, 7:9, 7:9] = 1
    site = SimpleNamespace(name="site3", data=SimpleNamespace(test=SimpleNamespace(tensors=(x, y))), module=Regions(),
                           fabric=SimpleNamespace(to_device=lambda t: t))
    figure = plot_segmentation_examples([site], TITLE, per_site=2, channel_names=("FLAIR", "T1", "T1ce", "T2"))
    assert figure.axes[0].get_ylabel() == "site3\n(T1: no FLAIR\nat this site)"
    assert "solid: truth, dashed: prediction; WT yellow, TC red, ET cyan" in figure.get_suptitle()
    contours = [collection for collection in figure.axes[0].collections]
    assert len(contours) == 5  # truth WT, TC, ET; predicted WT and TC (the ET logit never passes 0)


def test_a_similarity_graph_gets_the_data_source_and_its_title_fits():
    figure = plot_similarity_graphs([("before training", _graph())], "pFedNet similarity network, data space, k=2 (union)")
    assert "GENERATED" not in figure.get_suptitle()
    add_source(figure, SOURCE)
    assert "GENERATED" in figure.get_suptitle() and figure.get_suptitle().startswith("pFedNet similarity network")
    assert _texts_outside(figure) == []
    before = figure.get_suptitle()
    add_source(figure, SOURCE)  # once is enough, line breaks or not
    assert figure.get_suptitle() == before


@pytest.mark.parametrize("plot", ["roc", "confusion"])
def test_classification_figures_cut_nothing(plot):
    scores = _scores()
    if plot == "roc":
        figure = plot_roc_curves(scores, TITLE)
    else:
        figure = plot_confusion_matrices(scores, TITLE, ("not malignant", "malignant"))
        assert {axis.get_xlabel() for axis in figure.axes} == {"predicted (p > 0.5)"}
    assert _texts_outside(figure) == []
    assert "GENERATED" in figure.get_suptitle()


def test_the_outside_check_sees_a_cut_title():
    figure = plot_similarity_graphs([("before training", _graph())], "x")
    figure.suptitle("a title far too long for a figure this narrow " * 4)  # unwrapped: it runs off both sides
    assert _texts_outside(figure) != []
    assert math.isfinite(figure.get_figwidth())
