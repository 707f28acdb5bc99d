"""The strategy registry: the CLI list, the README's table and the configs' comments all derive from it."""

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest

from medfed.components import STRATEGY_CATALOG, strategy_table
from medfed.federated.strategies import REGISTERED, STRATEGIES
from medfed.federated.strategies.base import ServerHalf, SiteHalf, Strategy

ROOT = Path(__file__).resolve().parents[1]


def test_every_entry_is_complete_and_named_once():
    assert len(STRATEGIES) == len(REGISTERED)
    for cls in REGISTERED:
        assert issubclass(cls, Strategy) and issubclass(cls.Server, ServerHalf) and issubclass(cls.Site, SiteHalf)
        assert re.fullmatch(r"[a-z][a-z0-9_]*", cls.name) and cls.summary and "\n" not in cls.summary
        assert cls.evaluated_slot in cls.slots and len(set(cls.slots)) == len(cls.slots)
        assert dataclasses.is_dataclass(cls.Options)
        cls.Options()  # the defaults are valid


def test_the_catalog_that_lists_strategies_without_torch_is_the_registry():
    assert [tuple(entry) for entry in STRATEGY_CATALOG] == [(cls.name, cls.summary, cls.reference) for cls in REGISTERED]


def test_the_cli_lists_every_strategy():
    printed = subprocess.run([sys.executable, "-m", "medfed", "strategies"], capture_output=True, text=True, check=True).stdout
    listed = [line.split()[0] for line in printed.splitlines() if line and not line.startswith(" ")]
    assert listed == [cls.name for cls in REGISTERED]


def test_the_readme_table_is_the_registry():
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"<!-- strategies:[^\n]*-->\n(.*?)\n<!-- /strategies -->", readme, re.S)
    assert block is not None, "README.md lost its strategies block"
    assert block.group(1) == strategy_table(markdown=True), "regenerate it with: python -m medfed strategies --markdown"


@pytest.mark.parametrize("config", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.stem)
def test_configs_name_a_registered_strategy_and_list_none_by_hand(config):
    text = config.read_text()
    name = re.search(r"^strategy:\n  name: (\w+) +# (.*)$", text, re.M)
    assert name is not None and name.group(1) in STRATEGIES
    assert name.group(2).startswith("any of `python -m medfed strategies`")  # no hand-written list to go stale
    groups = re.findall(r"^  (\w+):$", text[text.index("strategy:\n"):].split("\n\n")[0].split("\ntrainer:")[0], re.M)
    assert set(groups) <= set(STRATEGIES)
