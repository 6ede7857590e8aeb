"""examples/notebooks/quickstart.ipynb runs headless on CPU, top to bottom, without an error: it trains with
``smp_fp16_fork`` on two forked processes, plots loss and loss scale, and prints the pipeline partition table."""

import json
import sys
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

_NOTEBOOK = Path(__file__).resolve().parents[1] / "examples" / "notebooks" / "quickstart.ipynb"
_KERNEL = "lightning-smp-tests"


@pytest.fixture
def kernel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A kernel spec for this interpreter, so the notebook runs in the environment under test."""
    spec_dir = tmp_path / "jupyter" / "kernels" / _KERNEL
    spec_dir.mkdir(parents=True)
    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "lightning_smp tests",
        "language": "python",
        "env": {"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"},
    }
    (spec_dir / "kernel.json").write_text(json.dumps(spec))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    return _KERNEL


def test_quickstart_notebook_executes_without_error(kernel: str, tmp_path: Path) -> None:
    notebook = nbformat.read(_NOTEBOOK, as_version=4)
    workdir = tmp_path / "run"
    workdir.mkdir()
    client = NotebookClient(notebook, timeout=300, kernel_name=kernel, resources={"metadata": {"path": str(workdir)}})
    client.execute()  # raises CellExecutionError, with the cell and its traceback, on any error

    outputs = [output for cell in notebook.cells if cell.cell_type == "code" for output in cell.get("outputs", [])]
    text = "".join(output.get("text", "") for output in outputs if output.get("output_type") == "stream")
    assert any("image/png" in output.get("data", {}) for output in outputs), "no plot was drawn"
    assert "Pipeline partition of 'blocks'" in text
    assert "skipped steps:" in text and "val_acc per epoch over 2 pipeline stages" in text
    assert (workdir / "logs" / "quickstart" / "fp16" / "metrics.csv").exists()


def test_quickstart_notebook_is_committed_without_outputs() -> None:
    notebook = nbformat.read(_NOTEBOOK, as_version=4)
    nbformat.validate(notebook)
    assert all(not cell.get("outputs") for cell in notebook.cells if cell.cell_type == "code")
