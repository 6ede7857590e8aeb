"""The built site: ``mkdocs build --strict`` passes, and every public name has an API page.

The site is built once per session (a few seconds; mkdocstrings reads the package's docstrings). The public names
are ``lightning_smp.__all__``, ``lightning_smp.smp.__all__`` and every name the README's API section shows in
backticks that resolves to one of them; each must have its anchor on an API page (mkdocstrings gives every
rendered object an ``id`` equal to its dotted path).
"""

from __future__ import annotations

import enum
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
    ``SMPStrategy.from_smp_options(...)``); what does not resolve (``dp_``, a command line) is prose."""
    readme = (_ROOT / "README.md").read_text(encoding="utf-8")
    section = readme.split("## API", 1)[1].split("\n## ", 1)[0]
    found = set()
    for token in re.findall(r"`([A-Za-z_][\w.]*)(?:\([^`]*\))?`", section):
        owner: object = lightning_smp
        for part in token.split("."):
            owner = getattr(owner, part, None)
        if owner is not None:
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
