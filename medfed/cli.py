"""Command line: ``python -m medfed fit --config configs/brats_lack0.yaml [key=value ...]``.

Overrides use OmegaConf's dot-list syntax (``trainer.rounds=3
strategy.lam=0.1``); unknown keys are rejected with the key named. Bad input
(config or data) ends with a one-line error naming the key or file and exit
status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import sys

from medfed.errors import ConfigError, DataError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="medfed", description="Personalised federated learning for medical imaging.")
    commands = parser.add_subparsers(dest="command", required=True)
    fit = commands.add_parser("fit", help="train and evaluate one federated run")
    fit.add_argument("--config", required=True, help="YAML run config, e.g. configs/brats_lack0.yaml")
    fit.add_argument("--resume", action="store_true", help="continue the interrupted run in output_dir from its checkpoint")
    fit.add_argument("--overwrite", action="store_true", help="replace an earlier run in output_dir")
    fit.add_argument("--quiet", action="store_true", help="no progress bars or final table")
    fit.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. trainer.rounds=3")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)  # overrides may come before or after the flags
    stray = [arg for arg in extra if arg.startswith("-") or "=" not in arg]
    if stray:
        parser.error(f"unrecognized arguments: {' '.join(stray)}")
    overrides = [*args.overrides, *extra]
    from medfed.config import load_config
    from medfed.experiment import run

    try:
        cfg = load_config(args.config, overrides)
        run(cfg, resume=args.resume, overwrite=args.overwrite, progress=not args.quiet)
    except (ConfigError, DataError) as error:
        print(f"medfed: error: {error}", file=sys.stderr)
        return 2
    return 0
