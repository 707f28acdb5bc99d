"""Command line: ``python -m medfed fit --config configs/brats_lack0.yaml [key=value ...]`` (:mod:`medfed.fit`).

``compare`` runs every (config, strategy, seed) of a grid as its own ``fit``
and tabulates them (:mod:`medfed.compare`)::

    python -m medfed compare --grid table3_brats [key=value ...]
    python -m medfed compare --config brats_lack0 --strategies all --seeds 0 1 2 [key=value ...]
    python -m medfed compare --config clinical_delta1 --strategies all --tune [--tune-space strategy.fedprox.mu=0.01,0.1,1]

Overrides use OmegaConf's dot-list syntax (``trainer.rounds=3
strategy.pfednet.lam=0.1``); unknown keys are rejected with the key named.
``--config`` takes a path or the name of a config shipped with medfed
(``--config brats_lack0``). ``predict`` applies one site's model of a
finished run to a new scan (:mod:`medfed.predict`). ``--print-config`` prints the full resolved config
(every component default filled in, as ``config.json`` stores it) and exits.
``strategies`` lists the registered algorithms (``--markdown``: the README's table).
``deploy submit <app-dir> <superlink> --run-config '...'`` submits a run to
a Flower deployment after checking its config here, and exits with the run's
outcome (:mod:`medfed.deploy.submit`; needs the ``deploy`` extra).

Bad input (config or data) ends with a one-line error naming the key or file
and exit status 2, never a traceback; the whole config is checked before any
data is read. So does a failing site under ``federation.on_site_failure:
stop`` (the line names the site, round and reason, and how to resume once
it is fixed). Ctrl-C ends with one line saying how to resume (exit status 130).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from medfed.console import error_line, one_line_errors, show_warnings
from medfed.errors import INTERRUPTED, ConfigError

# Each command's module is imported when that command runs: ``--help``, ``strategies`` and a config error
# answer without importing torch, Lightning or MONAI (tests/test_cli_start.py, benchmarks/cli_start.py).


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="medfed", description="Personalised federated learning for medical imaging.")
    commands = parser.add_subparsers(dest="command", required=True)
    fit = commands.add_parser("fit", help="train and evaluate one federated run")
    fit.add_argument(
        "--config", required=True, help="YAML run config: a path, or a bundled config's name (e.g. brats_lack0, luna16_delta4)"
    )
    fit.add_argument("--resume", action="store_true", help="continue the interrupted run in output_dir from its checkpoint")
    fit.add_argument("--overwrite", action="store_true", help="replace an earlier run in output_dir")
    fit.add_argument("--quiet", action="store_true", help="no progress bars or final table")
    fit.add_argument(
        "--print-config", action="store_true", help="print the full resolved config (every default) and exit without running"
    )
    fit.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. trainer.rounds=3")
    compare = commands.add_parser("compare", help="run every (config, strategy, seed) of a grid and tabulate them")
    source = compare.add_mutually_exclusive_group(required=True)
    source.add_argument("--grid", help="grid YAML: a path, or a bundled grid's name (table2_luna16, table3_brats, table5_clinical)")
    source.add_argument("--config", nargs="+", help="run configs, the settings (paths or bundled names), instead of a grid")
    compare.add_argument("--strategies", nargs="+", help="strategy names or 'all' (default: the grid's; without a grid, all)")
    compare.add_argument("--seeds", nargs="+", type=int, help="seeds (default: the grid's; without a grid, 0)")
    compare.add_argument("--metrics", nargs="+", help="metrics to tabulate, the first chooses the validation round (default: the grid's, else all)")
    compare.add_argument("--output", help="comparison folder (default: the grid's, else outputs/compare/<configs>)")
    compare.add_argument("--jobs", type=int, help="runs at once (default: the cores available); each gets cores // jobs threads")
    compare.add_argument("--quiet", action="store_true", help="no progress bar")
    compare.add_argument("--reference", metavar="NAME", help="the method the tables pair every other against (default: fedavg, else the grid's first)")
    compare.add_argument("--allow-unequal-compute", action="store_true", help="tabulate runs whose training epochs per round differ (named in the tables) instead of refusing them")
    compare.add_argument(
        "--budgets", nargs="+", type=float, metavar="B",
        help="the compute frontier: the grid once per budget B (trainer.local_epochs=B, in <output>/budget-B), then frontier.png",
    )
    compare.add_argument(
        "--tune", action="store_true",
        help="choose every method's hyperparameters on the validation split first (its search space, medfed/options/search.py), "
        "then run the grid with the chosen values",
    )
    compare.add_argument(
        "--tune-space", action="append", default=[], metavar="KEY=V1,V2",
        help="with --tune: the values tried for a key (model.<option> or strategy.<name>.<option>; x<f> = f times the config's "
        "value), e.g. strategy.fedprox.mu=0.01,0.1,1 (repeatable)",
    )
    compare.add_argument(
        "--fuse", choices=("auto", "on", "off"), default="auto",
        help="run the runs that share a strategy and a model shape in one process and one stacked step (auto: on cuda, "
        "and for the clinical model on a CPU; off: one process per run)",
    )
    compare.add_argument("--tune-rounds", type=int, metavar="R", help="with --tune: the tuning runs' trainer.rounds (default: the grid's)")
    compare.add_argument("--tune-seeds", nargs="+", type=int, metavar="S", help="with --tune: the tuning runs' seeds (default: the grid's first)")
    compare.add_argument(
        "--new-data-per-seed", action="store_true",
        help="each seed draws its own generated data set (data.generate.seed = the seed): the seeds' intervals cover new patients",
    )
    compare.add_argument(
        "--tune-budget", type=int, metavar="K",
        help="with --tune: exactly K configurations for every method (a larger space sampled evenly, a smaller one's learning rates widened)",
    )
    compare.add_argument(
        "--tune-extend", type=int, default=0, metavar="N",
        help="with --tune: where a chosen value is the largest or smallest tried, try up to N steps beyond it, one at a time",
    )
    compare.add_argument("overrides", nargs="*", metavar="key=value", help="overrides for every run, after the grid's (anywhere on the line)")
    predict = commands.add_parser("predict", help="segment a new scan with one site's personalised model from a run")
    predict.add_argument("--run", required=True, type=Path, help="the run's output_dir (config.json and checkpoints/)")
    predict.add_argument("--site", required=True, help="whose model, e.g. site3")
    predict.add_argument(
        "--input", required=True, nargs="+", type=Path, help="a case folder, or four NIfTI files in the order FLAIR T1 T1ce T2"
    )
    predict.add_argument("--out", required=True, type=Path, help="the segmentation to write, e.g. pred.nii.gz")
    predict.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    predict.add_argument(
        "--truth", type=Path, help="the scan's segmentation: score the prediction against it per region (Dice, HD95, lesion-wise scores)"
    )
    predict.add_argument("--quiet", action="store_true", help="no progress lines or bars")
    strategies = commands.add_parser("strategies", help="list the registered strategies (strategy.name choices)")
    strategies.add_argument(
        "--markdown", action="store_true", help="every table generated from the registry (the README's list, docs/privacy.md's)"
    )
    strategies.add_argument(
        "files", nargs="*", type=Path, help="with --markdown: markdown files whose generated tables to rewrite in place (README.md docs/*.md)"
    )
    deploy = commands.add_parser("deploy", help="a Flower deployment across machines (docs/deploy.md; the deploy extra)")
    deploy_commands = deploy.add_subparsers(dest="deploy_command", required=True)
    submit = deploy_commands.add_parser(
        "submit", help="check a run config, submit the run (flwr run --stream), exit 0 if it finished, 1 if it failed"
    )
    submit.add_argument("app_dir", type=Path, help="the Flower app: medfed's repository (its pyproject.toml)")
    submit.add_argument("superlink", help="the flwr CLI's SuperLink connection name ($FLWR_HOME/config.toml)")
    submit.add_argument(
        "--run-config", action="append", default=[], metavar="'key=value ...'",
        help="run config overrides as flwr run takes them, e.g. 'config=\"/abs/clinical.yaml\" run-name=\"r1\"' (repeatable)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    moved = []
    if argv[:1] == ["compare"]:  # its key=value overrides may follow --seeds 0 1 2 etc., which would take them as values
        kept = argv[:1]
        for index, arg in enumerate(argv[1:], start=1):
            is_override = "=" in arg and not arg.startswith("-") and argv[index - 1] != "--tune-space"  # a space entry is key=values too
            (moved if is_override else kept).append(arg)
        argv = kept
    args, extra = parser.parse_known_args(argv)  # fit's overrides may come before or after the flags
    extra = [*moved, *extra]
    stray = [arg for arg in extra if arg.startswith("-") or "=" not in arg or args.command not in ("fit", "compare")]
    if stray:
        parser.error(f"unrecognized arguments: {' '.join(stray)}")
    show_warnings(quiet=getattr(args, "quiet", False))
    return one_line_errors(lambda: _run_command(args, extra))


def _run_command(args: argparse.Namespace, extra: list[str]) -> int:
    if args.command == "strategies":
        return _strategies(args.markdown, args.files)
    if args.command == "predict":
        return _predict(args)
    if args.command == "compare":
        return _compare(args, [*args.overrides, *extra])
    if args.command == "deploy":
        return _deploy_submit(args)
    from medfed.fit import fit

    overrides = [*args.overrides, *extra]
    return fit(args.config, overrides, resume=args.resume, overwrite=args.overwrite, quiet=args.quiet, print_config=args.print_config)


def _strategies(markdown: bool, files: list[Path]) -> int:
    """``strategies``: the list; with ``markdown`` every generated table, or those tables rewritten in ``files``."""
    if files and not markdown:
        raise ConfigError("strategies: files are rewritten with --markdown only")
    if not markdown:
        from medfed.components import strategy_table

        print(strategy_table())
        return 0
    from medfed.atomic import atomic_write
    from medfed.components import generated_markdown, regenerate_tables

    if not files:
        print(generated_markdown())
    for path in files:
        text, found = regenerate_tables(path.read_text(encoding="utf-8"))
        with atomic_write(path) as file:
            file.write(text)
        print(f"{path}: {', '.join(found) or 'no generated table'}")
    return 0


def _compare(args: argparse.Namespace, overrides: list[str]) -> int:
    """``compare``: 0 when every run finished, 1 when some failed (the tables hold the others), 130 on Ctrl-C."""
    if not args.quiet and sys.stderr.isatty():  # at once, on a terminal: the statistics load and a large grid's check take a while
        what = f"grid {args.grid}" if args.grid is not None else f"{' '.join(args.config)} x {' '.join(args.strategies or ['all'])}"
        print(f"medfed: compare: {what}: checking every run before any starts", file=sys.stderr, flush=True)
    from medfed.compare import compare
    from medfed.compare.grid import make_grid, read_grid

    if args.grid is not None:
        grid, source = read_grid(args.grid), args.grid
        changes = {key: getattr(args, key) for key in ("strategies", "seeds", "metrics", "output") if getattr(args, key) is not None}
        if changes:
            values = {**vars(grid), **changes}
            grid = make_grid(
                values["configs"], values["strategies"], values["seeds"], values["overrides"], values["metrics"], values["output"], grid.settings,
                grid.new_data_per_seed,
            )
    else:
        output = args.output or f"outputs/compare/{'+'.join(Path(config).stem for config in args.config)}"
        grid, source = make_grid(args.config, args.strategies or "all", args.seeds or [0], [], args.metrics or [], output), "command line"
    if args.new_data_per_seed:
        grid = dataclasses.replace(grid, new_data_per_seed=True)
    tune = None
    if args.tune:
        from medfed.compare.tune import TuneSpec, parse_space

        seeds = None if args.tune_seeds is None else tuple(args.tune_seeds)
        tune = TuneSpec(parse_space(args.tune_space), args.tune_rounds, seeds, args.tune_budget, args.tune_extend)
    elif args.tune_space or args.tune_rounds is not None or args.tune_seeds is not None or args.tune_budget is not None or args.tune_extend:
        raise ConfigError("--tune-space, --tune-rounds, --tune-seeds, --tune-budget and --tune-extend shape the tuning: add --tune")
    try:
        failed = compare(grid, overrides, jobs=args.jobs, source=source, progress=not args.quiet, reference=args.reference,
                         allow_unequal_compute=args.allow_unequal_compute, budgets=args.budgets, tune=tune, fuse=args.fuse)
    except KeyboardInterrupt:
        print("medfed: interrupted; run the same command again: finished runs are kept, interrupted ones resume", file=sys.stderr)
        return INTERRUPTED
    except OSError as error:  # compare's own files (tuning.csv, the tables, figures); a run's full disk is its own one line
        from medfed.fit import FULL_DISK, full_disk

        if error.errno not in FULL_DISK:
            raise
        print(error_line(f"{full_disk(error, grid.output)}; the finished runs are kept: free some space and run the same "
                         "command again (it tabulates them without running them again)"), file=sys.stderr)
        return 2
    if failed:
        print(error_line(f"{len(failed)} run(s) failed: {', '.join(failed)} (their logs are in {grid.output / 'logs'})"), file=sys.stderr)
        return 1
    return 0


def _predict(args: argparse.Namespace) -> int:
    """``predict``: on a terminal, a line once the run folder is checked and a labelled bar over each wait; the written
    file and, with ``--truth``, its scores (:func:`medfed.predict.predict`)."""
    from medfed.predict import predict, score_table

    progress = not args.quiet and sys.stderr.isatty()
    scores = predict(args.run, args.site, args.input, args.out, overwrite=args.overwrite, truth=args.truth, progress=progress)
    print(f"medfed: wrote {args.out}", file=sys.stderr)
    if scores is not None:
        print(score_table(scores, f"{args.out} against {args.truth}"))
    return 0


def _deploy_submit(args: argparse.Namespace) -> int:
    """``deploy submit``: 0 when the run finished, 1 when it failed, 2 for a bad run config (nothing submitted), 130 on Ctrl-C."""
    try:
        from medfed.deploy.submit import submit
    except ModuleNotFoundError as error:  # flwr is the deploy extra's; the simulator never imports it
        print(f"medfed: error: deploy submit needs Flower: pip install 'medfed[deploy]' ({error})", file=sys.stderr)
        return 2
    return submit(args.app_dir, args.superlink, args.run_config)
