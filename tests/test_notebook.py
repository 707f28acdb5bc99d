"""The exploration notebook runs end to end and plots inline; medfed leaves matplotlib's backend alone."""

import base64
import os
import subprocess
import sys
from pathlib import Path

import nbformat
from ipykernel.kernelspec import write_kernel_spec
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import AsyncKernelManager
from nbclient import NotebookClient

REPO = Path(__file__).resolve().parents[1]
NOTEBOOK = REPO / "notebooks" / "explore_run.ipynb"


def _kernel(tmp_path: Path) -> AsyncKernelManager:
    """A kernel running this interpreter on this checkout's medfed, whatever kernels or medfed are installed."""
    kernels = tmp_path / "kernels"
    write_kernel_spec(kernels / "medfed-test", overrides={"env": {"PYTHONPATH": str(REPO)}})
    return AsyncKernelManager(kernel_name="medfed-test", kernel_spec_manager=KernelSpecManager(kernel_dirs=[str(kernels)]))


def _inject_parameters(notebook, **values) -> None:
    """Papermill's convention: a cell after the one tagged ``parameters`` sets the given names."""
    at = next(i for i, cell in enumerate(notebook.cells) if "parameters" in cell.metadata.get("tags", []))
    source = "\n".join(f"{name} = {value!r}" for name, value in values.items())
    notebook.cells.insert(at + 1, nbformat.v4.new_code_cell(source, metadata={"tags": ["injected-parameters"]}))


def test_notebook_runs_a_tiny_run_and_shows_its_plots_inline(tiny_run_config, tmp_path):
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    output_dir = tmp_path / "runs" / "pfednet"
    _inject_parameters(notebook, config_path=str(tiny_run_config), overrides=[f"output_dir={output_dir}"],
                       compare_dir=str(output_dir.parent))
    # raises CellExecutionError, with the cell's traceback, if any cell fails
    NotebookClient(notebook, km=_kernel(tmp_path), timeout=300, resources={"metadata": {"path": str(NOTEBOOK.parent)}}).execute()

    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    text = "".join(output.get("text", "") for cell in code for output in cell.outputs if output.output_type == "stream")
    assert "site2: IoU" in text and "mean:" in text
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
