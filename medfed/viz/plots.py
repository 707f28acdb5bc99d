"""Figures a run writes next to its results (learning curves, segmentation overlays, similarity graphs, ROC curves,
confusion matrices), and the bars of a comparison of methods (:mod:`medfed.compare`).

Each carries the data's provenance in its title, so a figure made from
generated data says so wherever it is shown (:func:`add_source` adds it to
a figure drawn without it). Axes say what they show in words and units
(:func:`metric_label`: "HD95, whole tumour (mm; whole volumes)", not
``hd95_wt``); rounds are whole numbers; titles are wrapped to the figure's
width, and the layout is matplotlib's constrained one, so no title, label or
legend is cut or covers data.

Every function builds a :class:`matplotlib.figure.Figure` directly rather
than through pyplot: no backend is chosen or switched, so files are written
on machines without a display, and the same figure shows inline when a
notebook cell returns it (pyplot is left to whoever imports medfed).
"""

from __future__ import annotations

import math
import re
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import torch
from matplotlib.figure import Figure
from matplotlib.text import Text
from matplotlib.ticker import FuncFormatter, MaxNLocator, NullFormatter
from torchmetrics.functional.classification import binary_auroc, binary_confusion_matrix, binary_roc

REGION_NAMES = {"wt": "whole tumour", "tc": "tumour core", "et": "enhancing tumour"}
METRIC_LABELS = {
    "iou": "IoU, mean of tumour and background\n(test patches)",
    "label_iou": "tumour IoU (test patches)",
    "accuracy": "accuracy (p > 0.5)",
    "balanced_accuracy": "balanced accuracy (p > 0.5)",
    "auroc": "AUROC",
}
"""Axis labels of the metrics with fixed names; :func:`metric_label` builds the per-region ones."""


def metric_label(name: str) -> str:
    """A metric key in words and units: ``hd95_wt`` -> "HD95, whole tumour (mm; whole volumes)"; unknown keys with spaces."""
    if name in METRIC_LABELS:
        return METRIC_LABELS[name]
    match = re.fullmatch(r"(dice|iou|hd95|label_iou)_(wt|tc|et)", name)
    if match is None:
        return name.replace("_", " ")
    metric, region = match.groups()
    if metric == "label_iou":
        return f"{REGION_NAMES[region]} IoU (test patches)"
    unit = "mm; " if metric == "hd95" else ""
    return f"{ {'dice': 'Dice', 'iou': 'IoU', 'hd95': 'HD95'}[metric]}, {REGION_NAMES[region]}\n({unit}whole volumes)"


def wrap_to_width(text: str, figure: Figure, fontsize: float) -> str:
    """``text`` broken into lines of similar length that fit the figure's width at ``fontsize`` (points; about 0.6 em a character)."""
    fits = max(20, int(figure.get_figwidth() * 72 / (0.6 * fontsize)))
    lines = []
    for paragraph in text.split("\n"):
        count = math.ceil(len(paragraph) / fits)  # as few lines as fit, then as even as they go
        lines += textwrap.wrap(paragraph, min(fits, math.ceil(len(paragraph) / max(count, 1)) + 8)) or [""]
    return "\n".join(lines)


def add_source(figure: Figure, source: str, fontsize: float = 8) -> Figure:
    """Add ``data: <source>`` under the figure's title unless some text of the figure already holds ``source``."""
    words = " ".join(source.split())
    if any(words in " ".join(text.get_text().split()) for text in figure.findobj(Text)):  # across line breaks too
        return figure
    title = figure.get_suptitle()
    figure.suptitle(wrap_to_width(f"{title}\ndata: {source}" if title else f"data: {source}", figure, fontsize), fontsize=fontsize)
    return figure


def plot_learning_curves(history: list[dict[str, Any]], title: str) -> Figure:
    """One panel per metric: every site's test metric per round, and the mean over sites.

    Args:
        history: the loop's per-round records (``record["metrics"][site][name]``); a metric
            evaluated on some rounds only (whole-volume scores) is drawn on those rounds, with markers;
            one evaluated on a single round of several (the default job's whole volumes, after the last)
            has no curve: the title names it and the round (its values are in the table and results.json).
        title: figure title (strategy, task, data provenance).
    """
    names = list(dict.fromkeys(name for record in history for name in record["mean"]))  # some only on some rounds
    rounds_of = {name: [record["round"] for record in history if name in record["mean"]] for name in names}
    once = [name for name in names if len(rounds_of[name]) == 1 and len(history) > 1]
    names = [name for name in names if name not in once]
    if once:
        at = sorted({rounds_of[name][0] for name in once})
        title += f"\n{', '.join(once)}: evaluated after round {', '.join(map(str, at))} only (no curve): see the table and results.json"
    figure = Figure(figsize=(3.6 * len(names) + 1.2, 3.8), layout="constrained")
    axes = figure.subplots(1, len(names), squeeze=False, sharex=True)  # one round axis: a metric of the last round only sits there
    for axis, name in zip(axes[0], names):
        records = [record for record in history if name in record["mean"]]
        rounds = [record["round"] for record in records]
        marker = "o" if len(records) < len(history) else None
        for site in history[0]["metrics"]:
            axis.plot(rounds, [r["metrics"][site][name] for r in records], lw=1, alpha=0.7, marker=marker, ms=3, label=site)
        axis.plot(rounds, [r["mean"][name] for r in records], "k-", lw=2.2, marker=marker, label="mean")
        axis.set_xlabel("round")
        axis.set_ylabel(metric_label(name), fontsize=9)
        axis.xaxis.set_major_locator(MaxNLocator(integer=True))
        axis.grid(alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    figure.legend(handles, labels, fontsize=8, loc="outside right upper")  # beside the panels: it covers no point
    figure.suptitle(wrap_to_width(title, figure, 9), fontsize=9)
    return figure


@torch.no_grad()
def plot_segmentation_examples(
    sites: list, title: str, per_site: int = 4, channel: int = 0, channel_names: tuple[str, ...] | None = None
) -> Figure | None:
    """Test patches of every site with the true (solid) and predicted (dashed) outlines of each region.

    With the whole tumour alone the truth is red and the prediction cyan; with
    the BraTS regions each region has its colour (WT yellow, TC red, ET cyan).
    A site without the displayed sequence (a missing channel) shows its first
    non-zero one, and its row label says so.

    Args:
        sites: the run's sites; each site's model predicts on its own first test patches.
        title: figure title.
        per_site: patches shown per site.
        channel: image channel drawn as background (0 = FLAIR for BraTS); if
            that channel is all zero at a site (a missing sequence) the
            first non-zero channel is drawn instead.
        channel_names: names of the channels (e.g. FLAIR, T1, T1ce, T2) for the row labels;
            None labels them by number.

    Returns:
        The figure, or ``None`` when the targets are not images (not a segmentation task).
    """
    x, y = sites[0].data.test.tensors
    if y.ndim not in (3, 4):  # (n, P, P) classes or (n, R, P, P) region masks
        return None
    figure = Figure(figsize=(2.1 * per_site, 2.2 * len(sites) + 0.6), layout="constrained")
    axes = figure.subplots(len(sites), per_site, squeeze=False)
    name = (lambda c: channel_names[c]) if channel_names else (lambda c: f"channel {c}")
    regions = sites[0].module.region_names
    colours = {"wt": "yellow", "tc": "red", "et": "cyan"} if len(regions) > 1 else None
    for row, site in zip(axes, sites):
        x, y = (t[:per_site] for t in site.data.test.tensors)
        site.module.eval()
        prediction = site.module.region_masks(site.module(site.fabric.to_device(x))).cpu()  # (B, R, P, P)
        truth = y.bool() if y.ndim == 4 else (y == 1).unsqueeze(1)
        shown = displayed_channel(x, channel)
        for axis, image, true_masks, predicted_masks in zip(row, x[:, shown], truth, prediction):
            axis.imshow(image.numpy().T, cmap="gray", origin="lower")
            for region, true_mask, predicted_mask in zip(regions, true_masks, predicted_masks):
                drawn = ((true_mask, "red", "solid"), (predicted_mask, "cyan", "dashed" if colours else "solid"))
                for mask, colour, style in drawn:
                    if mask.any():
                        axis.contour(mask.numpy().T.astype(float), levels=[0.5], colors=colours[region] if colours else colour,
                                     linewidths=1.0, linestyles=style, origin="lower")
            axis.set_xticks([])
            axis.set_yticks([])
        label = name(shown) if shown == channel else f"{name(shown)}: no {name(channel)}\nat this site"
        row[0].set_ylabel(f"{site.name}\n({label})", fontsize=8)
    legend = "solid: truth, dashed: prediction; WT yellow, TC red, ET cyan" if colours else "red: truth, cyan: prediction"
    figure.suptitle(wrap_to_width(title, figure, 8) + f"\n{legend}", fontsize=8)
    return figure


def displayed_channel(x: torch.Tensor, channel: int) -> int:
    """``channel`` of the ``(B, C, H, W)`` patches, or their first non-zero channel if it is all zero (a missing sequence)."""
    if x[:, channel].abs().sum() > 0:
        return channel
    return int((x.abs().sum(dim=(0, 2, 3)) > 0).float().argmax())


def plot_similarity_graphs(panels: list[tuple[str, Any]], title: str) -> Figure:
    """One panel per graph: the sites on a circle, each edge drawn with width and label by its weight.

    Args:
        panels: ``(label, SimilarityGraph)`` pairs, e.g. one per rebuild of the graph.
        title: figure title.
    """
    figure = Figure(figsize=(4.2 * len(panels), 4.6), layout="constrained")
    axes = figure.subplots(1, len(panels), squeeze=False)
    for axis, (label, graph) in zip(axes[0], panels):
        n = graph.n_sites
        angle = 2 * math.pi * torch.arange(n, dtype=torch.float64, device="cpu") / n
        xy = torch.stack([torch.sin(angle), torch.cos(angle)], dim=1).tolist()
        for (i, j), weight in zip(graph.edges, graph.weights):
            (x0, y0), (x1, y1) = xy[i], xy[j]
            axis.plot([x0, x1], [y0, y1], "-", color="tab:blue", lw=0.5 + 4.5 * weight, alpha=0.4 + 0.6 * weight, zorder=1)
            axis.text((x0 + x1) / 2, (y0 + y1) / 2, f"{weight:.2f}", fontsize=8, ha="center", va="center",
                      bbox={"boxstyle": "round,pad=0.15", "fc": "white", "ec": "none", "alpha": 0.8}, zorder=3)
        for index, (x, y) in enumerate(xy):
            axis.scatter([x], [y], s=600, color="white", edgecolors="black", zorder=2)
            axis.text(x, y, f"site{index}", fontsize=8, ha="center", va="center", zorder=4)
        axis.set_xlim(-1.35, 1.35)
        axis.set_ylim(-1.35, 1.35)
        axis.set_aspect("equal")
        axis.axis("off")
        axis.set_title(f"{label}: {len(graph.edges)} edges", fontsize=9)
    figure.suptitle(wrap_to_width(f"{title}; edge labels = weights", figure, 9), fontsize=9)
    return figure


def plot_roc_curves(scores: dict[str, tuple[torch.Tensor, torch.Tensor]], title: str, threshold: float = 0.5) -> Figure:
    """Every site's ROC curve on its test split, its AUROC in the legend and its operating point marked.

    Args:
        scores: ``{site: (p(positive), label)}``, one entry per test sample.
        title: figure title.
        threshold: the operating point, predicted positive iff p > threshold
            (what the accuracy metrics count).
    """
    figure = Figure(figsize=(5.6, 5.4), layout="constrained")
    axis = figure.subplots()
    for site, (probability, label) in scores.items():
        fpr, tpr, _ = binary_roc(probability, label)
        auroc = float(binary_auroc(probability, label))
        (line,) = axis.plot(fpr.numpy(), tpr.numpy(), lw=1.4, label=f"{site} (AUROC {auroc:.3f})")
        (tn, fp), (fn, tp) = binary_confusion_matrix(probability, label, threshold).tolist()
        axis.plot([fp / (fp + tn)], [tp / (tp + fn)], "o", ms=5, color=line.get_color())
    axis.plot([0, 1], [0, 1], ":", color="grey", lw=1, label="chance")
    axis.set_xlabel("false positive rate (1 - specificity)")
    axis.set_ylabel("true positive rate (sensitivity)")
    axis.set_xlim(-0.01, 1.01)
    axis.set_ylim(-0.01, 1.01)
    axis.set_aspect("equal")
    axis.grid(alpha=0.3)
    axis.legend(fontsize=8, loc="lower right")
    figure.suptitle(wrap_to_width(f"{title}; dots: p > {threshold}", figure, 8), fontsize=8)
    return figure


def plot_confusion_matrices(
    scores: dict[str, tuple[torch.Tensor, torch.Tensor]], title: str, class_names: tuple[str, str], threshold: float = 0.5
) -> Figure:
    """One panel per site: test counts by true class (rows) and predicted class (columns), shaded by row share.

    Args:
        scores: ``{site: (p(positive), label)}``, one entry per test sample.
        title: figure title.
        class_names: names of label 0 and label 1.
        threshold: predicted positive iff p > threshold.
    """
    figure = Figure(figsize=(2.9 * len(scores), 3.6), layout="constrained")
    axes = figure.subplots(1, len(scores), squeeze=False)
    for axis, (site, (probability, label)) in zip(axes[0], scores.items()):
        counts = binary_confusion_matrix(probability, label, threshold)
        share = counts / counts.sum(dim=1, keepdim=True).clamp(min=1)
        axis.imshow(share.numpy(), cmap="Blues", vmin=0.0, vmax=1.0)
        for (row, column), count in np.ndenumerate(counts.numpy()):
            colour = "white" if share[row, column] > 0.5 else "black"
            axis.text(column, row, f"{count}\n{share[row, column]:.0%}", ha="center", va="center", fontsize=9, color=colour)
        axis.set_xticks([0, 1], class_names, fontsize=7)
        axis.set_yticks([0, 1], class_names, fontsize=7, rotation=90, va="center")
        axis.set_xlabel(f"predicted (p > {threshold})", fontsize=8)
        axis.set_ylabel("true", fontsize=8)
        axis.set_title(site, fontsize=9)
    figure.suptitle(wrap_to_width(title, figure, 8), fontsize=8)
    return figure


def save_figure(figure: Figure, path: Path) -> None:
    """Write ``figure`` as PNG via a temporary file (renamed into place, so no half-written file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp.png")
    figure.savefig(tmp, dpi=110)
    tmp.replace(path)

def plot_comparison(
    rows: list[dict[str, Any]], metrics: list[str], settings: list[str], strategies: list[str], title: str, jitter_seed: int = 0
) -> Figure:
    """Each method's mean with its 95% interval over seeds and every site's value, one panel per metric (rows) and round choice (columns).

    Args:
        rows: compare's long table (one row per run and site, columns
            ``last_<metric>`` and ``selected_<metric>``; see :mod:`medfed.compare_stats`);
            rows whose strategy is ``baseline:<name>`` (the trivial baselines) are drawn as dashed lines across their setting.
        metrics: the metrics, one row of panels each.
        settings: the groups along x (the grid's configs).
        strategies: the methods in each group, one colour each: a marker at the mean over seeds of the mean over
            sites and a bar of the 95% t interval over seeds (none for one seed); dots: every (seed, site) value,
            spread sideways at random (``jitter_seed``) so equal values stay visible.
        title: the figure's title (the data's provenance included).

    The y axis spans the drawn values (means, intervals, dots, baselines) with a margin, not 0-1, so that
    differences of 0.01 between methods are visible.
    """
    from medfed.compare_stats import seed_values, site_values, summarise

    baselines = list(dict.fromkeys(r["strategy"] for r in rows if str(r["strategy"]).startswith("baseline:")))
    figure = Figure(figsize=(max(8.0, 2.4 * len(settings)), 3.2 * len(metrics) + 1.4), layout="constrained")
    axes = figure.subplots(len(metrics), 2, squeeze=False)
    width = 0.8 / max(len(strategies), 1)
    colours = [f"C{i % 10}" for i in range(len(strategies))]
    jitter = np.random.default_rng(jitter_seed)
    for row, metric in enumerate(metrics):
        for column, (prefix, when) in enumerate((("last", "last round"), ("selected", "validation-selected round"))):
            axis = axes[row][column]
            runs, sites = seed_values(rows, f"{prefix}_{metric}"), site_values(rows, f"{prefix}_{metric}")
            drawn: list[float] = []
            for index, strategy in enumerate(strategies):
                x = np.arange(len(settings)) - 0.4 + width * (index + 0.5)
                summaries = [summarise(list(runs.get((setting, strategy), {}).values())) for setting in settings]
                means = np.array([s.mean for s in summaries])
                below = [s.mean - s.low if s.n > 1 else 0.0 for s in summaries]
                above = [s.high - s.mean if s.n > 1 else 0.0 for s in summaries]
                axis.errorbar(x, means, yerr=[below, above], fmt="o", markersize=5, capsize=3, color=colours[index], label=strategy, zorder=4)
                drawn += [v for s in summaries for v in (s.mean, s.low, s.high) if np.isfinite(v)]
                for position, setting in zip(x, settings):
                    points = np.array(list(sites.get((setting, strategy), {}).values()))
                    spread = jitter.uniform(-0.3 * width, 0.3 * width, points.size)
                    axis.scatter(position + spread, points, s=7, color=colours[index], alpha=0.5, linewidths=0, zorder=3)
                    drawn += [float(v) for v in points if np.isfinite(v)]
            for style, baseline in zip(("--", ":", "-."), baselines):
                for position, setting in enumerate(settings):
                    summary = summarise(list(runs.get((setting, baseline), {}).values()))
                    if summary.n:
                        axis.hlines(summary.mean, position - 0.45, position + 0.45, colors="grey", linestyles=style,
                                    label=baseline if position == 0 else None, zorder=2)
                        drawn.append(summary.mean)
            if drawn:
                low, high = min(drawn), max(drawn)
                margin = max(0.05 * (high - low), 0.005)
                axis.set_ylim(low - margin, high + margin)
            axis.set_xticks(np.arange(len(settings)), settings, rotation=20, ha="right")
            axis.set_title(f"{metric}, {when}", fontsize=9)
            axis.set_ylabel(metric_label(metric), fontsize=9)
            axis.grid(axis="y", alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    figure.legend(handles, labels, loc="outside lower center", ncols=min(len(labels), 8), fontsize=8)
    caption = "markers: mean over seeds of the mean over sites, bars: 95% t interval over seeds; dots: each seed's sites; grey lines: trivial baselines"
    figure.suptitle(wrap_to_width(f"{title}; {caption}", figure, 9), fontsize=9)
    return figure


def plot_frontier(rows: list[dict[str, Any]], metrics: list[str], settings: list[str], strategies: list[str], title: str) -> Figure:
    """The compute frontier: one panel per metric (rows) and setting (columns), each method's metric against its budget.

    Args:
        rows: :func:`medfed.compare.frontier.frontier_rows` (``config, strategy, metric, epochs_per_round, mean, low, high``).
        metrics, settings: the panels' rows and columns.
        strategies: one line each, one colour each: x the measured training
            epochs per site and round (log scale, base 2), y the mean over seeds of the mean over
            sites (last round); the band is the 95% t interval over seeds
            (none where a budget has fewer than 2 seeds). A point without a
            measured budget is left out.
        title: the figure's title (the data's provenance included).
    """
    figure = Figure(figsize=(max(6.0, 4.2 * len(settings)), 3.4 * len(metrics) + 1.4), layout="constrained")
    axes = figure.subplots(len(metrics), len(settings), squeeze=False)
    for row, metric in enumerate(metrics):
        for column, setting in enumerate(settings):
            axis = axes[row][column]
            for index, strategy in enumerate(strategies):
                points = sorted(
                    (r["epochs_per_round"], r["mean"], r["low"], r["high"]) for r in rows
                    if (r["config"], r["strategy"], r["metric"]) == (setting, strategy, metric) and r["epochs_per_round"] is not None
                )
                if not points:
                    continue
                x, mean, low, high = (np.array(values, dtype=np.float64) for values in zip(*points))
                axis.plot(x, mean, marker="o", markersize=4, color=f"C{index % 10}", label=strategy)
                banded = np.isfinite(low) & np.isfinite(high)
                if banded.any():
                    axis.fill_between(x, low, high, where=banded, color=f"C{index % 10}", alpha=0.15, linewidth=0)
            axis.set_xscale("log", base=2)  # budgets come in doublings (0.5 1 2 4): evenly spaced
            axis.xaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
            axis.xaxis.set_minor_formatter(NullFormatter())
            axis.set_title(f"{setting}: {metric}, last round", fontsize=9)
            axis.set_xlabel("training epochs per site and round\n(measured; log scale)", fontsize=9)
            axis.set_ylabel(metric_label(metric), fontsize=9)
            axis.grid(alpha=0.3)
    legend = {label: handle for axis in figure.axes for handle, label in zip(*axis.get_legend_handles_labels())}
    figure.legend(list(legend.values()), list(legend), loc="outside lower center", ncols=min(max(len(legend), 1), 8), fontsize=8)
    caption = "lines: mean over seeds of the mean over sites; bands: 95% t interval over seeds"
    figure.suptitle(wrap_to_width(f"{title}; {caption}", figure, 9), fontsize=9)
    return figure
