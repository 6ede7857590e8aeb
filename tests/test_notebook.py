"""examples/notebooks/quickstart.ipynb runs headless on CPU, top to bottom, without an error: it trains with
``smp_fp16_fork`` on two forked processes, plots loss and loss scale with the skipped steps marked, prints the
memory planner's view of two pipeline stages and trains over them.

It is committed executed, so that its outputs and plots show where it is read (GitHub renders them), and it uses
only the package's public names. After changing it, run it again and commit the result: ``.venv/bin/python
tests/test_notebook.py`` executes it as the test does and writes it back in place.
"""

from __future__ import annotations

import ast
import json
import os
import sys
import tempfile
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

_ROOT = Path(__file__).resolve().parents[1]
_NOTEBOOK = _ROOT / "examples" / "notebooks" / "quickstart.ipynb"
_KERNEL = "lightning-smp-tests"
_PLAIN_KERNEL = {"display_name": "Python 3", "language": "python", "name": "python3"}
_RERUN = "execute it and commit it with its outputs: `.venv/bin/python tests/test_notebook.py`"


def execute(notebook: nbformat.NotebookNode, workdir: Path, jupyter_path: Path) -> None:
    """Run every cell of ``notebook`` in place, in ``workdir``, in a kernel of this interpreter (so that it runs in
    the environment under test) with one thread and no warnings; raises CellExecutionError on any error."""
    spec_dir = jupyter_path / "kernels" / _KERNEL
    spec_dir.mkdir(parents=True, exist_ok=True)
    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "lightning_smp tests",
        "language": "python",
        "env": {"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"},
    }
    (spec_dir / "kernel.json").write_text(json.dumps(spec))
    previous = os.environ.get("JUPYTER_PATH")
    os.environ["JUPYTER_PATH"] = str(jupyter_path)
    try:
        NotebookClient(
            notebook, timeout=300, kernel_name=_KERNEL, resources={"metadata": {"path": str(workdir)}}
        ).execute()
    finally:
        if previous is None:
            os.environ.pop("JUPYTER_PATH")
        else:
            os.environ["JUPYTER_PATH"] = previous


def _outputs(notebook: nbformat.NotebookNode) -> list[dict]:
    return [output for cell in notebook.cells if cell.cell_type == "code" for output in cell.get("outputs", [])]


def _streams(notebook: nbformat.NotebookNode) -> str:
    return "".join(output.get("text", "") for output in _outputs(notebook) if output.get("output_type") == "stream")


@pytest.mark.timeout(600)
def test_quickstart_notebook_executes_without_error(tmp_path: Path) -> None:
    notebook = nbformat.read(_NOTEBOOK, as_version=4)
    workdir = tmp_path / "run"
    workdir.mkdir()
    execute(notebook, workdir, tmp_path / "jupyter")

    text = _streams(notebook)
    assert any("image/png" in output.get("data", {}) for output in _outputs(notebook)), "no plot was drawn"
    assert "Memory per rank, pp=2 x tp=1 x dp=1 on 2 device(s), fp16 with fp32 masters" in text
    assert "Pipeline partition of 'blocks'" in text  # printed by rank 0 of the forked pipeline run
    assert "skipped steps:" in text and "val_acc per epoch over 2 pipeline stages" in text
    assert (workdir / "logs" / "quickstart" / "fp16" / "metrics.csv").exists()


def test_quickstart_notebook_is_committed_executed() -> None:
    """Its outputs show where it is read: every code cell ran, in order, without an error, and the plot is there;
    nothing of the machine that ran it (paths) is in the outputs."""
    notebook = nbformat.read(_NOTEBOOK, as_version=4)
    nbformat.validate(notebook)
    counts = [cell.execution_count for cell in notebook.cells if cell.cell_type == "code"]
    assert counts == list(range(1, len(counts) + 1)), _RERUN
    outputs = _outputs(notebook)
    assert not [output for output in outputs if output.get("output_type") == "error"]
    assert sum("image/png" in output.get("data", {}) for output in outputs) >= 1
    assert "Memory per rank, pp=2" in _streams(notebook)
    assert notebook.metadata.kernelspec == _PLAIN_KERNEL
    shown = json.dumps(outputs)
    assert str(_ROOT) not in shown and "/tmp/" not in shown and "site-packages" not in shown


def _private_uses(source: str, public: set[str]) -> list[str]:
    """The package's names a cell reaches that are not public: an import from a submodule other than ``smp``, a
    name not in ``lightning_smp.__all__``, or an attribute of ``lightning_smp`` outside it."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("lightning_smp"):
            if node.module != "lightning_smp":
                found.append(f"from {node.module} import ...")
            else:
                found += [f"lightning_smp.{alias.name}" for alias in node.names if alias.name not in public]
        elif isinstance(node, ast.Import):
            found += [alias.name for alias in node.names if alias.name.startswith("lightning_smp.")]
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "lightning_smp":
            found += [f"lightning_smp.{node.attr}"] if node.attr not in public else []
    return found


def test_quickstart_notebook_uses_only_the_public_api() -> None:
    import lightning_smp

    public = set(lightning_smp.__all__)
    notebook = nbformat.read(_NOTEBOOK, as_version=4)
    private = [use for cell in notebook.cells if cell.cell_type == "code" for use in _private_uses(cell.source, public)]
    assert not private, f"the notebook reaches private names: {private}"
    assert _private_uses("from lightning_smp.pipeline.partition import plan_outside", public)  # the check sees them
    assert _private_uses("import lightning_smp\nlightning_smp.memory.parse_bytes('1G')", public)


def test_the_docs_link_the_notebook() -> None:
    pages = [
        page for page in (_ROOT / "docs").rglob("*.md") if "examples/notebooks/quickstart.ipynb" in page.read_text()
    ]
    assert pages, "no docs page links examples/notebooks/quickstart.ipynb"


if __name__ == "__main__":
    sys.path.insert(0, str(_ROOT))
    notebook = nbformat.read(_NOTEBOOK, as_version=4)
    with tempfile.TemporaryDirectory() as scratch:
        (Path(scratch) / "run").mkdir()
        execute(notebook, Path(scratch) / "run", Path(scratch) / "jupyter")
    notebook.metadata.kernelspec = _PLAIN_KERNEL
    nbformat.write(notebook, _NOTEBOOK)
    print(f"executed {_NOTEBOOK.relative_to(_ROOT)} and wrote it back with its outputs")
