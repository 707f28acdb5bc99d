"""``python -m medfed fit``: one federated run from a config, as the command line runs it.

:func:`fit` loads and checks the config (the fixed groups before torch is even
imported; a bad key raises :class:`~medfed.errors.ConfigError` naming it),
prints it resolved (``--print-config``) or runs it
(:func:`medfed.experiment.run`), and turns the ways a run stops early into an
exit status and one line saying how to resume: a failing site under
``federation.on_site_failure: stop`` (2) and Ctrl-C (130). ``compare`` runs
each of its runs through :func:`fit` as well.
"""

from __future__ import annotations

import errno
import shlex
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from medfed.components import resolve
from medfed.config import load_config, to_yaml
from medfed.console import error_line
from medfed.errors import INTERRUPTED, RunFailed, SiteFailure
from medfed.output_dir import check_output_dir, hold_output_dir


def fit(
    config: str, overrides: list[str], *, resume: bool = False, overwrite: bool = False, quiet: bool = False, print_config: bool = False
) -> int:
    """Run (or with ``print_config`` print) the config; the exit status: 0 done, 2 a site failed or the disk is full, 130 Ctrl-C.

    Args:
        config: a YAML path or a bundled config's name.
        overrides: ``key=value`` overrides.
        resume, overwrite: continue, or replace, the run in ``output_dir``.
        quiet: no progress bars or final table.
        print_config: print the full resolved config and return without running.

    Raises:
        ConfigError, DataError: bad input, before any data is read where the config is at fault.
    """
    cfg = load_config(config, overrides)
    resolved = resolve(cfg)  # every component checked before a run's modules are imported
    if print_config:
        print(to_yaml(resolved.config), end="")
        return 0
    output_dir = Path(resolved.run.output_dir)
    with hold_output_dir(output_dir):  # a folder another run writes, or an earlier run in it: refused before the heavy imports
        check_output_dir(output_dir, resume=resume, overwrite=overwrite)
    if not quiet:
        run_cfg = resolved.run
        print(
            f"medfed: fit {Path(config).stem}: {resolved.strategy_name} on {resolved.task_name}, {run_cfg.trainer.rounds} rounds, "
            f"seed {run_cfg.trainer.seed} (config checked)",
            file=sys.stderr,
            flush=True,
        )
    run = import_run(progress=not quiet)

    try:
        run(cfg, resume=resume, overwrite=overwrite, progress=not quiet, config_name=Path(config).stem)
    except RunFailed as error:  # resuming would fail the same way
        print(error_line(error), file=sys.stderr)
        return 2
    except SiteFailure as error:
        print(error_line(f"{error}; {how_to_resume(config, overrides, Path(cfg.output_dir))}"), file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"medfed: interrupted; {how_to_resume(config, overrides, Path(cfg.output_dir))}", file=sys.stderr)
        return INTERRUPTED
    except OSError as error:
        if error.errno not in FULL_DISK:
            raise
        print(error_line(f"{full_disk(error, Path(cfg.output_dir))}; {how_to_resume(config, overrides, Path(cfg.output_dir))}"), file=sys.stderr)
        return 2
    return 0


HEAVY_IMPORTS = (("torch", "torch"), ("lightning.fabric", "Lightning"), ("monai.networks.nets", "MONAI"), ("medfed.experiment", "medfed"))
"""What a run imports before its first step, in order, with the name the loading bar shows (about 10 s on a busy 2-core VM)."""


def import_run(progress: bool = True) -> Callable[..., Any]:
    """:func:`medfed.experiment.run`, its heavy imports (torch, Lightning, MONAI) under a labelled bar on stderr."""
    import importlib

    from tqdm import tqdm  # text bars: tqdm.auto warns in a notebook without ipywidgets

    bar = tqdm(HEAVY_IMPORTS, desc="loading", unit="package", leave=False, disable=not progress, file=sys.stderr)
    for module, name in bar:
        bar.set_description_str(f"loading {name}")
        importlib.import_module(module)
    bar.close()
    from medfed.experiment import run

    return run


FULL_DISK = (errno.ENOSPC, errno.EDQUOT)
"""The errors of a write that found no space: a run stops with one line, whichever file it was writing (results,
CSV and W&B logs, figures, the data cache; checkpoints say so themselves, :func:`medfed.checkpoint.save_checkpoint`)."""


def full_disk(error: OSError, output_dir: Path) -> str:
    """One line for a write that found the disk (or the quota) full: the file, the reason and the space left."""
    folder = next((path for path in (output_dir, *output_dir.parents) if path.exists()), Path("."))
    free_mib = shutil.disk_usage(folder).free / 2**20
    return f"{error.filename or 'a file of the run'} could not be written ({error.strerror}); {free_mib:.0f} MiB free under {folder}"


def how_to_resume(config: str, overrides: list[str], output_dir: Path) -> str:
    """What an interrupted user can do next, in one line."""
    from medfed.checkpoint import FOLDER, checkpoints  # torch; needed only once a run has stopped

    found = checkpoints(output_dir / FOLDER)
    if not found:
        return "no round had finished, so there is nothing to resume; run the same command again"
    command = shlex.join(["python", "-m", "medfed", "fit", "--config", config, *overrides, "--resume"])
    return f"every finished round is checkpointed in {found[-1].parent} (newest {found[-1].name}); continue with: {command}"
