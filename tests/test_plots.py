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


def test_a_metric_of_the_last_round_only_shares_the_rounds_axis_of_the_others():
    figure = plot_learning_curves(_history(rounds=20, volume_rounds=(20,)), TITLE)
    limits = {axis.get_xlim() for axis in figure.axes}
    assert len(limits) == 1 and next(iter(limits))[0] <= 1 and next(iter(limits))[1] >= 20
    assert _texts_outside(figure) == []


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
