"""Adding a strategy takes its module and one registration line (docs/strategies.md), and then it is everywhere.

A copy of the package gets exactly those two things: a module in a package
of its own (outside medfed), and one ``StrategySpec`` line in the copy's
``STRATEGY_SPECS``. Run from the copy, the new strategy is in the CLI's list
and every generated table, a config may name it and set its options, a
compare grid's ``all`` holds it, it runs, and the registry-driven tests
(partial participation, checkpoint round trip) take it up under its name.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

MODULE = '''
"""A throwaway strategy: FedAvg, defined outside medfed."""

from medfed.federated.strategies.fedavg import FedAvg


class Throwaway(FedAvg):
    """FedAvg under another name."""
'''

LINE = (
    '    StrategySpec("throwaway", "throwaway_methods.throwaway:Throwaway", "FedAvg again, registered from outside medfed", '
    '"a test"),\n'
)

CHECK = '''
import json
from medfed.components import STRATEGY_NAMES, generated_markdown, resolve
from medfed.config import load_config
from medfed.federated.strategies import registered
from medfed.options.strategies import strategy_spec
from throwaway_methods.throwaway import Throwaway

resolved = resolve(load_config("clinical_delta1", ["strategy.name=throwaway", "strategy.throwaway={}"]))
markdown = generated_markdown()
print(json.dumps({
    "registered": registered()["throwaway"] is Throwaway and Throwaway.name == "throwaway",
    "spec": Throwaway.spec is strategy_spec("throwaway"),
    "config": resolved.strategy_cls is Throwaway and resolved.config["strategy"]["name"] == "throwaway",
    "grid": STRATEGY_NAMES[-1] == "throwaway",
    "tables": [line.split("|")[2].strip() for line in markdown.splitlines() if "`throwaway`" in line],
}))
'''


@pytest.fixture(scope="module")
def copy_with_a_new_strategy(tmp_path_factory) -> Path:
    """A copy of medfed with the throwaway module beside it and its registration line added, nothing else."""
    root = tmp_path_factory.mktemp("adding")
    shutil.copytree(ROOT / "medfed", root / "medfed", ignore=shutil.ignore_patterns("__pycache__"))
    (root / "throwaway_methods").mkdir()
    (root / "throwaway_methods" / "__init__.py").write_text("")
    (root / "throwaway_methods" / "throwaway.py").write_text(textwrap.dedent(MODULE))
    catalog = root / "medfed" / "options" / "strategies.py"
    text = catalog.read_text()
    head, tail = text.split("\nSTRATEGY_SPECS: tuple[StrategySpec, ...] = (\n", 1)
    body, rest = tail.split("\n)\n", 1)
    catalog.write_text(f"{head}\nSTRATEGY_SPECS: tuple[StrategySpec, ...] = (\n{body}\n{LINE})\n{rest}")
    return root


def _run(root: Path, *args: str) -> str:
    """``python *args`` from ``root`` (its copy of medfed first on the path); the standard output."""
    done = subprocess.run([sys.executable, *args], cwd=root, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_the_new_strategy_is_listed_configured_tabulated_and_gridded(copy_with_a_new_strategy):
    root = copy_with_a_new_strategy
    listed = [line.split()[0] for line in _run(root, "-m", "medfed", "strategies").splitlines() if line and not line.startswith(" ")]
    assert listed[-1] == "throwaway" and "fedavg" in listed
    found = json.loads(_run(root, "-c", CHECK))
    assert found == {
        "registered": True, "spec": True, "config": True, "grid": True,
        # the README's list, then the privacy table (FedAvg's declarations, inherited)
        "tables": ["FedAvg again, registered from outside medfed", "yes", "yes"],  # the README's, privacy's, robust aggregation's
    }


@pytest.mark.slow  # a pytest of its own: about 30 s on two busy cores
def test_the_registry_driven_tests_take_it_up(copy_with_a_new_strategy):
    out = _run(
        copy_with_a_new_strategy, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(ROOT), "-o", "pythonpath=",
        str(ROOT / "tests" / "test_strategy_lifecycle.py"), "-k", "throwaway",
    )
    assert "3 passed" in out, out[-2000:]
