"""Every command in a code block of the README runs as written: dry-run, not trained.

``fit`` commands resolve with ``--print-config`` appended (every key, every
refusal a run would meet before reading data: a strategy DP does not fit, an
unknown key); ``compare`` commands plan their whole grid (each run's config
resolved, its folder inspected) with the runs themselves left out;
``predict`` and ``deploy`` commands parse with their own flags (their data
are the user's); ``pip install`` lines name extras pyproject.toml declares.
The notebook's command runs in tests/test_notebook.py.
"""

import re
import shlex
import tomllib
from pathlib import Path

import pytest

import medfed.compare
from medfed.cli import build_parser, main

REPO = Path(__file__).resolve().parents[1]


def readme_commands() -> list[str]:
    """The commands of the README's code blocks, one per line (continuations joined, comments dropped, ``&&`` split)."""
    text = (REPO / "README.md").read_text()
    commands = []
    for block in re.findall(r"```(?:bash|sh|console)?\n(.*?)```", text, flags=re.S):
        block = block.replace("\\\n", " ")
        for line in block.splitlines():
            line = line.split(" #", 1)[0].strip() if not line.lstrip().startswith("#") else ""
            commands += [part.strip() for part in line.split("&&") if part.strip()]
    return [command for command in commands if re.match(r"(python|pip|jupyter) ", command)]


COMMANDS = readme_commands()


def test_the_readme_has_its_commands():
    assert any(c.startswith("python -m medfed fit") for c in COMMANDS) and any(c.startswith("python -m medfed compare") for c in COMMANDS)
    assert any("privacy.dp" in c for c in COMMANDS) and any("predict" in c for c in COMMANDS)


@pytest.mark.parametrize("command", [c for c in COMMANDS if c.startswith("python -m medfed fit")])
def test_a_fit_command_resolves_as_written(command, capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(REPO)  # the README's paths start at the repository root
    arguments = shlex.split(command)[3:]
    assert main([*arguments, "--print-config"]) == 0, capsys.readouterr().err
    assert capsys.readouterr().out.startswith("data:")


@pytest.mark.parametrize(
    "command",
    [pytest.param(c, marks=[pytest.mark.slow] if "--grid" in c else []) for c in COMMANDS if c.startswith("python -m medfed compare")],
)  # a shipped grid plans ~200 runs: over 20 s on two busy cores
def test_a_compare_command_plans_its_whole_grid(command, capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(REPO)
    planned = []

    def plan_only(grid, overrides, runs, *rest, **options):
        planned.extend(runs)
        return {}, [], [], []

    monkeypatch.setattr(medfed.compare, "_run_and_tabulate", plan_only)
    arguments = shlex.split(command)[3:]
    assert main([*arguments, "--output", str(tmp_path / "compare")]) == 0, capsys.readouterr().err
    assert planned and all(run.output_dir.is_relative_to(tmp_path) for run in planned)


@pytest.mark.parametrize("command", [c for c in COMMANDS if re.match(r"python -m medfed (predict|deploy|strategies)", c)])
def test_a_predict_or_deploy_command_parses_with_its_own_flags(command):
    arguments = shlex.split(command)[3:]
    parsed, extra = build_parser().parse_known_args(arguments)
    assert extra == [] and parsed.command == arguments[0]


@pytest.mark.parametrize("command", [c for c in COMMANDS if c.startswith("pip install")])
def test_a_pip_command_names_extras_pyproject_declares(command):
    declared = set(tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    for match in re.finditer(r"\.\[([^\]]+)\]", command):
        assert set(match[1].split(",")) <= declared, command
