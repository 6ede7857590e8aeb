"""The dependency ranges setup.cfg declares are the ranges CI tests: each has a lower bound (the `--oldest` job installs
it, scripts/oldest_constraints.py) and an upper bound (the newest version that passed); the libraries whose private
names or defaults `lightning_smp._compat` uses are declared exactly as `_compat.CHECKED_VERSIONS` says they were
checked; constraints.txt, the last green run's versions, lies inside the ranges; and this environment does too, with
the test-only library that scripts/setup.sh installs outside setup.cfg (LitGPT) at the version it pins.
"""

import importlib.metadata
import re

import pytest
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from lightning_smp import _compat
from scripts.oldest_constraints import SETUP_CFG, declared_requirements, oldest_pins

DECLARED = declared_requirements()
CONSTRAINTS = SETUP_CFG.parent / "constraints.txt"
SETUP_SH = SETUP_CFG.parent / "scripts" / "setup.sh"


def _pins(path) -> dict[str, str]:
    lines = [line.strip() for line in path.read_text().splitlines()]
    pairs = (line.split("==", 1) for line in lines if line and not line.startswith("#"))
    return {name.lower().replace("_", "-"): version for name, version in pairs}


@pytest.mark.parametrize("name", sorted(DECLARED))
def test_every_declared_range_is_bounded_on_both_sides(name):
    specifiers = SpecifierSet(DECLARED[name])
    operators = {specifier.operator for specifier in specifiers}
    assert operators == {">=", "<"} or operators == {"=="}, (
        f"setup.cfg declares {name}{specifiers}: declare >= the oldest version CI ran and < the release after the "
        "newest that passed (docs/contributing.md)"
    )


def test_the_oldest_pins_are_the_lower_bounds():
    pins = oldest_pins(DECLARED)
    assert set(pins) == set(DECLARED)
    assert all(Version(pins[name]) in SpecifierSet(DECLARED[name]) for name in pins)


@pytest.mark.parametrize("library", sorted(_compat.CHECKED_VERSIONS))
def test_the_libraries_compat_reaches_into_are_declared_as_checked(library):
    assert SpecifierSet(DECLARED[library]) == SpecifierSet(_compat.CHECKED_VERSIONS[library]), (
        f"setup.cfg declares {library}{DECLARED[library]}, _compat.CHECKED_VERSIONS {_compat.CHECKED_VERSIONS[library]}"
    )


def test_the_last_green_runs_versions_lie_inside_the_declared_ranges():
    pins = _pins(CONSTRAINTS)
    for name, specifiers in DECLARED.items():
        assert name in pins, f"constraints.txt lacks {name}: rewrite it with scripts/freeze_constraints.sh"
        assert Version(pins[name]) in SpecifierSet(specifiers), f"constraints.txt: {name}=={pins[name]}"


@pytest.mark.parametrize("name", sorted(DECLARED))
def test_this_environment_lies_inside_the_declared_ranges(name):
    try:
        version = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        pytest.skip(f"{name} is not installed")
    assert SpecifierSet(DECLARED[name]).contains(Version(version).base_version), (
        f"{name} {version} is installed, outside setup.cfg's {name}{DECLARED[name]}: rerun bash scripts/setup.sh "
        "(or raise the bound as docs/contributing.md says)"
    )


def test_litgpt_is_installed_at_the_version_setup_sh_pins():
    pinned = re.search(r'^LITGPT_VERSION="([^"]+)"$', SETUP_SH.read_text(), re.MULTILINE)
    assert pinned is not None, "scripts/setup.sh pins LitGPT in LITGPT_VERSION"
    try:
        version = importlib.metadata.version("litgpt")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("litgpt is not installed (scripts/setup.sh installs it in .venv)")
    assert version == pinned.group(1), (
        f"litgpt {version} is installed, scripts/setup.sh pins {pinned.group(1)}: rerun bash scripts/setup.sh (or "
        "move the pin as docs/contributing.md says)"
    )
