"""Command line: ``python -m medfed fit --config configs/brats_lack0.yaml [key=value ...]``.

Overrides use OmegaConf's dot-list syntax (``trainer.rounds=3
strategy.pfednet.lam=0.1``); unknown keys are rejected with the key named.
``--config`` takes a path or the name of a config shipped with medfed
(``--config brats_lack0``). ``predict`` applies one site's model of a
finished run to a new scan (:mod:`medfed.predict`). ``--print-config`` prints the full resolved config
(every component default filled in, as ``config.json`` stores it) and exits.
``strategies`` lists the registered algorithms (``--markdown``: the README's table).

Bad input (config or data) ends with a one-line error naming the key or file
and exit status 2, never a traceback; the whole config is checked before any
data is read. So does a failing site under ``federation.on_site_failure:
stop`` (the line names the site, round and reason, and how to resume once
it is fixed). Ctrl-C ends with one line saying how to resume (exit status 130).
"""

from __future__ import annotations

import argparse
import logging
import shlex
import sys
from pathlib import Path

from medfed.errors import ConfigError, DataError, SiteFailure

INTERRUPTED = 130  # the shell's status for a process ended by SIGINT


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
    predict = commands.add_parser("predict", help="segment a new scan with one site's personalised model from a run")
    predict.add_argument("--run", required=True, type=Path, help="the run's output_dir (config.json and checkpoints/)")
    predict.add_argument("--site", required=True, help="whose model, e.g. site3")
    predict.add_argument(
        "--input", required=True, nargs="+", type=Path, help="a case folder, or four NIfTI files in the order FLAIR T1 T1ce T2"
    )
    predict.add_argument("--out", required=True, type=Path, help="the segmentation to write, e.g. pred.nii.gz")
    predict.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    strategies = commands.add_parser("strategies", help="list the registered strategies (strategy.name choices)")
    strategies.add_argument("--markdown", action="store_true", help="as the markdown table of the README")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)  # fit's overrides may come before or after the flags
    stray = [arg for arg in extra if arg.startswith("-") or "=" not in arg or args.command != "fit"]
    if stray:
        parser.error(f"unrecognized arguments: {' '.join(stray)}")
    _show_warnings()
    try:
        if args.command == "strategies":
            from medfed.federated.strategies import strategy_table

            print(strategy_table(markdown=args.markdown))
            return 0
        if args.command == "predict":
            from medfed.predict import predict

            written = predict(args.run, args.site, args.input, args.out, overwrite=args.overwrite)
            print(f"medfed: wrote {written}", file=sys.stderr)
            return 0
        return _fit(args, [*args.overrides, *extra])
    except (ConfigError, DataError) as error:
        print(f"medfed: error: {error}", file=sys.stderr)
        return 2


def _fit(args: argparse.Namespace, overrides: list[str]) -> int:
    from medfed.components import resolve
    from medfed.config import load_config, to_yaml
    from medfed.experiment import run

    cfg = load_config(args.config, overrides)
    if args.print_config:
        print(to_yaml(resolve(cfg).config), end="")
        return 0
    try:
        run(cfg, resume=args.resume, overwrite=args.overwrite, progress=not args.quiet, config_name=Path(args.config).stem)
    except SiteFailure as error:
        print(f"medfed: error: {error}; {_how_to_resume(args.config, overrides, Path(cfg.output_dir))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"medfed: interrupted; {_how_to_resume(args.config, overrides, Path(cfg.output_dir))}", file=sys.stderr)
        return INTERRUPTED
    return 0


def _how_to_resume(config: str, overrides: list[str], output_dir: Path) -> str:
    """What an interrupted user can do next, in one line."""
    from medfed.checkpoint import FOLDER, checkpoints

    found = checkpoints(output_dir / FOLDER)
    if not found:
        return "no round had finished, so there is nothing to resume; run the same command again"
    command = shlex.join(["python", "-m", "medfed", "fit", "--config", config, *overrides, "--resume"])
    return f"every finished round is checkpointed in {found[-1].parent} (newest {found[-1].name}); continue with: {command}"


def _show_warnings() -> None:
    """Send the ``medfed`` logger's records to stderr as ``medfed: warning: ...`` (``info``, ...) lines."""
    logger = logging.getLogger("medfed")
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(_OneLineFormatter())
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)


class _OneLineFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return f"medfed: {record.levelname.lower()}: {record.getMessage()}"
