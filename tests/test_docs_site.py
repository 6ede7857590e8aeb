"""The built site: ``mkdocs build --strict`` passes, every public name has an API page, every picture is drawn by
a command in the repository and shown on a page, and every test a page cites exists (each row of the comparison
page cites one).

The site is built once per session (a few seconds; mkdocstrings reads the package's docstrings). The public names
are ``lightning_smp.__all__``, ``lightning_smp.smp.__all__`` and every name the README's API section shows in
backticks that resolves to one of them; each must have its anchor on an API page (mkdocstrings gives every
rendered object an ``id`` equal to its dotted path). The pictures are ``scripts/pictures.py``'s: each of its files
must be in docs/images/ and shown by a page, every picture a page shows must be one of them, and the cheap ones are
drawn again here; the expensive ones (measured runs) run a few steps, to show that their commands still work.
"""

from __future__ import annotations

import ast
import enum
import importlib.util
import json
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest

import lightning_smp
from lightning_smp import smp

_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("site")
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(directory)],
        cwd=_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return directory


def test_mkdocs_build_is_clean_with_warnings_as_errors(site: Path) -> None:
    assert (site / "configuration" / "index.html").exists()
    assert (site / "api" / "smp" / "index.html").exists()


def _anchor(owner: str, name: str, value: object) -> str:
    """The id mkdocstrings gives ``owner.name`` where the API pages render it: an enum member under its class, a
    module under its own path (``smp.nn`` is ``lightning_smp.tensor_parallel.nn``)."""
    if isinstance(value, enum.Enum):
        return f"{owner}.{type(value).__name__}.{value.name}"
    if isinstance(value, types.ModuleType):
        return value.__name__
    return f"{owner}.{name}"


def _public_names() -> dict[str, str]:
    """Every public name, as it is written (``SMPStrategy``, ``smp.tp_rank``), with its expected anchor."""
    names = {name: _anchor("lightning_smp", name, getattr(lightning_smp, name)) for name in lightning_smp.__all__}
    names |= {f"smp.{name}": _anchor("lightning_smp.smp", name, getattr(smp, name)) for name in smp.__all__}
    return names


def _readme_api_names() -> set[str]:
    """The dotted names in backticks in the README's API section that resolve in the package (``smp.rank()``,
    ``SMPStrategy.from_smp_options(...)``); what does not resolve (``dp_``, a command line) is prose, and so is a
    word that happens to name a submodule (``smp_options``, SageMaker's dict; public modules are in ``__all__``)."""
    readme = (_ROOT / "README.md").read_text(encoding="utf-8")
    section = readme.split("## API", 1)[1].split("\n## ", 1)[0]
    found = set()
    for token in re.findall(r"`([A-Za-z_][\w.]*)(?:\([^`]*\))?`", section):
        owner: object = lightning_smp
        for part in token.split("."):
            owner = getattr(owner, part, None)
        if owner is not None and not isinstance(owner, types.ModuleType):
            found.add(token)
    return found


def test_every_public_name_has_an_api_page(site: Path) -> None:
    anchors = set()
    for page in (site / "api").rglob("index.html"):
        anchors |= set(re.findall(r'id="(lightning_smp[\w.]*)"', page.read_text(encoding="utf-8")))
    names = _public_names()
    readme = _readme_api_names()
    assert {"SMPStrategy", "SMPStrategy.from_smp_options", "smp.model_creation", "estimate_memory"} <= readme
    for token in readme - names.keys():  # a method of a public class: its anchor under the class
        names[token] = f"lightning_smp.{token}"
    missing = sorted(name for name, anchor in names.items() if anchor not in anchors)
    assert not missing, f"no API page renders {missing}: add them to a page under docs/api/ (`::: lightning_smp.X`)"


# -- citations ------------------------------------------------------------------------------------------------

_TEST_CITED = re.compile(r"`(tests/test_\w+\.py)::(\w+)`")
_BENCHMARK_CITED = re.compile(r"`(benchmarks/\w+\.py)`")


def _test_names(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return {node.name for node in tree.body if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")}


@pytest.mark.parametrize("page", sorted(p.relative_to(_ROOT).as_posix() for p in (_ROOT / "docs").rglob("*.md")))
def test_every_test_and_benchmark_a_page_cites_exists(page: str) -> None:
    text = (_ROOT / page).read_text(encoding="utf-8")
    missing = [f"{file}::{name}" for file, name in _TEST_CITED.findall(text) if name not in _test_names(_ROOT / file)]
    missing += [file for file in _BENCHMARK_CITED.findall(text) if not (_ROOT / file).is_file()]
    assert not missing, f"{page} cites tests or benchmarks that do not exist: {missing}"


def test_every_row_of_the_comparison_cites_a_test_or_a_benchmark() -> None:
    lines = (_ROOT / "docs" / "comparison.md").read_text(encoding="utf-8").splitlines()
    rows = [line for line in lines if line.startswith("| ") and not line.startswith(("| |", "| ---"))]
    assert len(rows) >= 15
    uncited = [
        row.split("|")[1].strip() for row in rows if not (_TEST_CITED.search(row) or _BENCHMARK_CITED.search(row))
    ]
    assert not uncited, f"these rows of docs/comparison.md cite no test or benchmark: {uncited}"


# -- pictures -------------------------------------------------------------------------------------------------

_IMAGE = re.compile(r"!\[[^\]]*\]\(([^)\s]+)\)")


def _pictures_module() -> types.ModuleType:
    spec = importlib.util.spec_from_file_location("pictures", _ROOT / "scripts" / "pictures.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


pictures = _pictures_module()


def _shown_pictures() -> dict[str, list[str]]:
    """Each picture file the docs pages show, with the pages that show it."""
    shown: dict[str, list[str]] = {}
    for page in sorted((_ROOT / "docs").rglob("*.md")):
        for target in _IMAGE.findall(page.read_text(encoding="utf-8")):
            file = (page.parent / target).resolve()
            shown.setdefault(file.relative_to(pictures.IMAGES).as_posix(), []).append(page.name)
    return shown


def test_every_picture_is_drawn_by_a_command_and_shown_on_a_page(site: Path) -> None:
    drawn = {file for picture in pictures.PICTURES.values() for file in picture.files}
    shown = _shown_pictures()
    missing = sorted(file for file in drawn if not (pictures.IMAGES / file).is_file())
    assert not missing, f"draw them with `python scripts/pictures.py`: {missing}"
    assert not drawn - shown.keys(), f"no page shows {sorted(drawn - shown.keys())}"
    assert not shown.keys() - drawn, f"pictures that no command in scripts/pictures.py draws: {shown.keys() - drawn}"
    for file in drawn:
        assert (site / "images" / file).is_file(), file  # the site carries it


def test_every_pipeline_schedule_has_its_picture() -> None:
    from lightning_smp import config

    assert set(pictures.PIPELINES) == set(config._PIPELINES), "add the new pipeline value to scripts/pictures.py"


def test_the_cheap_pictures_are_drawn_again(tmp_path: Path) -> None:
    for name, picture in pictures.PICTURES.items():
        if picture.cheap:
            picture.draw(tmp_path)
            for file in picture.files:
                assert (tmp_path / file).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", (name, file)


@pytest.mark.timeout(300)
def test_the_loss_scale_picture_still_draws_from_a_short_run(tmp_path: Path) -> None:
    pictures.draw_loss_scale(tmp_path, max_steps=3)
    assert (tmp_path / "fp16_loss_scale.png").stat().st_size > 0


def _timeline_render() -> types.ModuleType:
    sys.path.insert(0, str(_ROOT / "benchmarks"))
    try:
        import timeline_render
    finally:
        sys.path.remove(str(_ROOT / "benchmarks"))
    return timeline_render


def test_a_timeline_becomes_a_perfetto_trace_and_a_picture(tmp_path: Path) -> None:
    """benchmarks/timeline_render.py on the events pipeline_timeline.py records (tests/test_benchmarks.py runs the
    script itself with --trace and --plot): two steps of two ranks, the second stage waiting for the first."""
    render = _timeline_render()
    events = {
        0: [("F", 0.000, 0.010, 0), ("F", 0.010, 0.020, 1), ("B", 0.030, 0.040, 0), ("B", 0.040, 0.050, 1)],
        1: [("recv_activation", 0.001, 0.010, None), ("F", 0.001, 0.015, 0), ("B", 0.015, 0.025, 0)],
    }
    for rank, step_start in ((0, 0.0), (1, 0.001)):
        events[rank] += [("STEP", step_start, step_start + 0.055, None), ("STEP", step_start + 0.06, 0.1, None)]
    render.write_chrome_trace(events, tmp_path / "trace.json")
    trace = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    slices = {(e["tid"], e["name"]): e for e in trace if e["ph"] == "X"}
    assert slices[(0, "F1")] == {
        "name": "F1",
        "cat": "forward",
        "ph": "X",
        "ts": 10000.0,
        "dur": 10000.0,
        "pid": 0,
        "tid": 0,
    }
    assert slices[(1, "recv_activation")]["cat"] == "wait" and slices[(1, "B0")]["cat"] == "backward"
    assert {e["args"]["name"] for e in trace if e["ph"] == "M"} == {"rank 0", "rank 1"}
    render.plot_step(events, tmp_path / "step.png", step=0, title="test")
    assert (tmp_path / "step.png").read_bytes()[:4] == b"\x89PNG"
