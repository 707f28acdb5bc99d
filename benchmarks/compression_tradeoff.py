"""Compression vs accuracy trade-off of CER, STC and their composition (pFedNet Figs 8 and 10).

For each config (default: ``configs/brats_lack0.yaml`` and, when present,
``configs/luna16_delta4.yaml``) this runs the same federated training once
per communication setting, all in one sitting so the figures are comparable:

* ``dense``: float32 both ways (the reference);
* ``stc``: STC both ways (the paper's "gamma = 0");
* ``cer+stc`` for each gamma: CER then STC from the sites, STC from the server;
* ``cer`` for each gamma: CER + run coding from the sites, dense from the server.

It writes ``<out>/tradeoff.csv`` (one row per run: compression ratios
client-side (up) and server-side (down) against dense float32, the task's
final mean metrics, wall time, the share of round time spent encoding and
decoding) and ``<out>/tradeoff.png``: compression ratio vs gamma, final
metric vs gamma, the metric per round of every setting, and the share of
round time spent encoding + decoding against the 10% target. Generated data
are labelled as such in the plot titles.

    python benchmarks/compression_tradeoff.py --gammas 1e-4 3e-4 1e-3 3e-3
    python benchmarks/compression_tradeoff.py --out DIR --plot-only   # redraw from DIR/tradeoff.csv
"""

from __future__ import annotations

import argparse
import csv
import json
import platform
import sys
from pathlib import Path

from matplotlib.figure import Figure

from medfed.config import load_config
from medfed.experiment import run

DEFAULT_CONFIGS = ("configs/brats_lack0.yaml", "configs/luna16_delta4.yaml")
CODEC_SHARE_TARGET_PERCENT = 10.0
"""Encoding plus decoding should take less than this share of a round's wall time."""
NUMERIC_COLUMNS = ("gamma", "compression_ratio_up", "compression_ratio_down", "bytes_up", "bytes_down", "wall_s", "codec_share")


def settings(gammas: list[float]) -> list[dict]:
    """The communication settings compared: name, codecs per direction, gamma."""
    rows = [
        {"setting": "dense", "up": "dense", "down": "dense", "gamma": 0.0},
        {"setting": "stc", "up": "stc", "down": "stc", "gamma": 0.0},
    ]
    rows += [{"setting": "cer+stc", "up": "cer+stc", "down": "stc", "gamma": g} for g in gammas]
    rows += [{"setting": "cer", "up": "cer", "down": "dense", "gamma": g} for g in gammas]
    return rows


def run_setting(config: Path, setting: dict, out: Path, extra: list[str]) -> dict:
    """One federated run with ``setting``'s codecs; returns its row for the CSV."""
    run_dir = out / config.stem / f"{setting['setting']}-{setting['gamma']:g}"
    overrides = [
        f"codec.up={setting['up']}",
        f"codec.down={setting['down']}",
        f"codec.gamma={setting['gamma']}",
        "logger.wandb=disabled",
        f"output_dir={run_dir}",
        *extra,
    ]
    results = run(load_config(config, overrides), overwrite=True, progress=False)
    comm, timing = results["communication"], results["timing"]
    row = {
        "config": config.stem,
        **setting,
        "compression_ratio_up": comm["compression_ratio_up"],
        "compression_ratio_down": comm["compression_ratio_down"],
        "bytes_up": comm["bytes_up"],
        "bytes_down": comm["bytes_down"],
        **{f"mean_{name}": value for name, value in results["mean"].items()},
        "wall_s": timing["wall_s"],
        "codec_share": timing["codec_share"],
        "data": results["federation"]["description"],
        "results": str(run_dir / "results.json"),
    }
    print(json.dumps({k: v for k, v in row.items() if k not in ("data", "results")}), flush=True)
    return row


def plot(rows: list[dict], path: Path) -> None:
    """Per config: ratio vs gamma, metric vs gamma, metric per round (the shape of Figs 8/10), codec share vs gamma."""
    configs = sorted({row["config"] for row in rows})
    figure = Figure(figsize=(20, 4 * len(configs)))
    axes = figure.subplots(len(configs), 4, squeeze=False)
    for (ratio_axis, metric_axis, curve_axis, share_axis), config in zip(axes, configs):
        mine = [row for row in rows if row["config"] == config]
        metric = _headline_metric(mine[0])
        dense = next(row for row in mine if row["setting"] == "dense")
        stc = next(row for row in mine if row["setting"] == "stc")
        for setting, marker in (("cer+stc", "o-"), ("cer", "s--")):
            series = sorted((row for row in mine if row["setting"] == setting), key=lambda row: row["gamma"])
            gammas = [row["gamma"] for row in series]
            for direction, colour in (("up", "C0"), ("down", "C1")):
                if setting == "cer" and direction == "down":
                    continue  # dense downstream: ratio 1
                ratio_axis.plot(gammas, [row[f"compression_ratio_{direction}"] for row in series], marker, color=colour,
                                label=f"{setting} {'client (up)' if direction == 'up' else 'server (down)'}")
            metric_axis.plot(gammas, [row[metric] for row in series], marker, label=setting)
            share_axis.plot(gammas, [100 * row["codec_share"] for row in series], marker, label=setting)
        for direction, colour in (("up", "C0"), ("down", "C1")):
            ratio_axis.axhline(stc[f"compression_ratio_{direction}"], color=colour, ls=":", label=f"stc alone {direction}")
        metric_axis.axhline(dense[metric], color="k", ls="-", label="dense")
        metric_axis.axhline(stc[metric], color="gray", ls=":", label="stc alone")
        share_axis.axhline(100 * dense["codec_share"], color="k", ls="-", label="dense")
        share_axis.axhline(100 * stc["codec_share"], color="gray", ls=":", label="stc alone")
        share_axis.axhline(CODEC_SHARE_TARGET_PERCENT, color="red", ls="--", label="target")
        for row in mine:
            history = json.loads(Path(row["results"]).read_text())["history"]
            curve_axis.plot([r["round"] for r in history], [r["mean"][metric.removeprefix("mean_")] for r in history],
                            lw=1, label=f"{row['setting']} {row['gamma']:g}" if row["gamma"] else row["setting"])
        ratio_axis.set(xscale="log", yscale="log", xlabel="gamma (CER weight)", ylabel="compression ratio vs float32")
        metric_axis.set(xscale="log", xlabel="gamma (CER weight)", ylabel=metric)
        curve_axis.set(xlabel="round", ylabel=metric)
        share_axis.set(xscale="log", ylim=(0, None), xlabel="gamma (CER weight)",
                       ylabel="% of round wall time encoding + decoding")
        for axis in (ratio_axis, metric_axis, curve_axis, share_axis):
            axis.grid(alpha=0.3)
            axis.legend(fontsize=7)
        ratio_axis.set_title(f"{config}: {mine[0]['data']}", fontsize=8, loc="left")
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def read_rows(path: Path) -> list[dict]:
    """The rows of a tradeoff.csv written by this script, numbers as floats."""
    with path.open(newline="") as handle:
        rows = list(csv.DictReader(handle))
    for row in rows:
        for key in list(row):
            if row[key] == "":  # a metric of the other task
                del row[key]
            elif key in NUMERIC_COLUMNS or key.startswith("mean_"):
                row[key] = float(row[key])
    return rows


def _headline_metric(row: dict) -> str:
    return "mean_label_iou" if "mean_label_iou" in row else "mean_accuracy"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+", default=[c for c in DEFAULT_CONFIGS if Path(c).is_file()])
    parser.add_argument("--gammas", nargs="+", type=float, default=[1e-4, 3e-4, 1e-3, 3e-3])
    parser.add_argument("--out", type=Path, default=Path("outputs/benchmarks/compression"))
    parser.add_argument("--plot-only", action="store_true", help="redraw tradeoff.png from <out>/tradeoff.csv")
    parser.add_argument("overrides", nargs="*", help="extra config overrides for every run, e.g. trainer.rounds=10")
    args = parser.parse_args(argv)
    if args.plot_only:
        plot(read_rows(args.out / "tradeoff.csv"), args.out / "tradeoff.png")
        print(f"wrote {args.out / 'tradeoff.png'}")
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    print(f"machine: {platform.machine()} {platform.processor()} python {sys.version.split()[0]}", flush=True)
    rows = [run_setting(Path(config), setting, args.out, args.overrides) for config in args.configs for setting in settings(args.gammas)]
    with (args.out / "tradeoff.csv").open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=sorted({key for row in rows for key in row}))
        writer.writeheader()
        writer.writerows(rows)
    plot(rows, args.out / "tradeoff.png")
    print(f"wrote {args.out / 'tradeoff.csv'} and {args.out / 'tradeoff.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
