"""The exploration notebook runs end to end and plots inline; medfed leaves matplotlib's backend alone."""

import base64
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import nbformat
from ipykernel.kernelspec import write_kernel_spec

REPO = Path(__file__).resolve().parents[1]
NOTEBOOK = REPO / "notebooks" / "explore_run.ipynb"


def _write_kernel(tmp_path: Path) -> None:
    """Kernel ``medfed-test`` under ``tmp_path/kernels`` (JUPYTER_PATH=tmp_path finds it): this interpreter on this checkout's
    medfed, whatever kernels or medfed are installed."""
    write_kernel_spec(tmp_path / "kernels" / "medfed-test", overrides={"env": {"PYTHONPATH": str(REPO)}})


def _inject_parameters(notebook, **values) -> None:
    """Papermill's convention: a cell after the one tagged ``parameters`` sets the given names."""
    at = next(i for i, cell in enumerate(notebook.cells) if "parameters" in cell.metadata.get("tags", []))
    source = "\n".join(f"{name} = {value!r}" for name, value in values.items())
    notebook.cells.insert(at + 1, nbformat.v4.new_code_cell(source, metadata={"tags": ["injected-parameters"]}))


def test_the_documented_command_runs_the_notebook_whose_numbers_come_from_its_own_run(tiny_run_config, tmp_path):
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    prose = " ".join(cell.source for cell in notebook.cells if cell.cell_type == "markdown")
    assert "jupyter execute --inplace notebooks/explore_run.ipynb" in prose  # the command the notebook and README give
    assert not re.search(r"(?<![\w/])\.\d{2}\b|\d+ ?(s|min)\b", prose)  # no metric or time written into the text
    output_dir = tmp_path / "runs" / "pfednet"
    _inject_parameters(notebook, config_path=str(tiny_run_config), overrides=[f"output_dir={output_dir}"],
                       compare_dir=str(output_dir.parent))
    copy = NOTEBOOK.parent / f".test-{os.getpid()}-{tmp_path.name}.ipynb"  # beside the original: the same working folder
    nbformat.write(notebook, copy)
    _write_kernel(tmp_path)
    jupyter = Path(sys.executable).with_name("jupyter")  # the one this interpreter's environment installed
    try:  # the documented command, on this interpreter's kernel
        done = subprocess.run(
            [str(jupyter) if jupyter.exists() else "jupyter", "execute", "--inplace", "--kernel_name=medfed-test", "--timeout=300", str(copy)],
            env={**os.environ, "JUPYTER_PATH": str(tmp_path), "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        notebook = nbformat.read(copy, as_version=4)
    finally:
        copy.unlink(missing_ok=True)

    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    text = "".join(output.get("text", "") for cell in code for output in cell.outputs if output.output_type == "stream")
    assert "site2: IoU" in text and "mean:" in text
    results = json.loads((output_dir / "results.json").read_text())
    stated = re.search(r"pfednet, 3 rounds: mean label IoU (\d\.\d{3}) over 3 sites; (\d+) s wall", text)
    assert stated and float(stated[1]) == round(results["mean"]["label_iou"], 3)  # the number it states is its run's
    assert abs(int(stated[2]) - results["timing"]["wall_s"]) <= 1
    images = [
        [base64.b64decode(output.data["image/png"]) for output in cell.outputs if "image/png" in output.get("data", {})]
        for cell in code
    ]
    # learning curves (a Figure as the cell's value), the run's two files, the comparison of strategies
    assert [len(shown) for shown in images if shown] == [1, 2, 1]
    curves, files, comparison = (shown for shown in images if shown)
    assert files == [(output_dir / "examples.png").read_bytes(), (output_dir / "similarity_graph.png").read_bytes()]
    assert all(png.startswith(b"\x89PNG") for png in curves + comparison)


def test_medfed_leaves_the_matplotlib_backend_alone(tiny_run_config, tmp_path):
    """A pFedNet run imports medfed and makes and saves every figure, under a backend that is not Agg."""
    script = (
        "import sys, matplotlib\n"
        "from medfed.config import load_config\n"
        "from medfed.experiment import run\n"
        "run(load_config(sys.argv[1]), progress=False)\n"
        "print(matplotlib.get_backend(), matplotlib.rcParams['backend'])\n"
    )
    env = {**os.environ, "MPLBACKEND": "template", "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", script, str(tiny_run_config)], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "template template"
    assert sorted(path.name for path in (tmp_path / "run").glob("*.png")) == ["examples.png", "learning_curves.png", "similarity_graph.png"]
