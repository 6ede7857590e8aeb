"""Print a pip constraints file that pins every dependency setup.cfg declares to the oldest version its range allows.

CI's second job installs with it (`bash scripts/test.sh --oldest`), so the lower bounds we declare are versions a
test ran on, as the upper bounds are (the first job resolves the newest the ranges allow). Every requirement must
have a lower bound (``>=X`` or ``==X``); extras are dropped (pip's constraints cannot name them). Standard library
only: it runs before the virtual environment has anything installed.

    python scripts/oldest_constraints.py > oldest.txt && pip install -c oldest.txt -e ".[test]"
"""

from __future__ import annotations

import configparser
import re
import sys
from pathlib import Path

SETUP_CFG = Path(__file__).resolve().parents[1] / "setup.cfg"
_REQUIREMENT = re.compile(r"^(?P<name>[A-Za-z0-9_.-]+)(\[[^\]]*\])?\s*(?P<specifiers>.*)$")


def declared_requirements(setup_cfg: Path = SETUP_CFG) -> dict[str, str]:
    """Every requirement of setup.cfg (install_requires and each extra) as ``{name: specifiers}``; a name declared in
    several places must have the same specifiers in each."""
    config = configparser.ConfigParser()
    config.read(setup_cfg)
    lines = config["options"]["install_requires"].splitlines()
    for extra in config["options.extras_require"].values():
        lines += extra.splitlines()
    declared: dict[str, str] = {}
    for line in filter(None, (line.strip() for line in lines)):
        match = _REQUIREMENT.match(line)
        if match is None:
            raise ValueError(f"setup.cfg: cannot read the requirement {line!r}")
        name, specifiers = match["name"].lower(), match["specifiers"].replace(" ", "")
        if declared.setdefault(name, specifiers) != specifiers:
            raise ValueError(f"setup.cfg declares {name} as {declared[name]} and as {specifiers}: make them one range")
    return declared


def oldest_pins(declared: dict[str, str]) -> dict[str, str]:
    """``{name: version}``: the lower bound of each declared range."""
    pins = {}
    for name, specifiers in declared.items():
        lower = re.search(r"(?:>=|==)([^,]+)", specifiers)
        if lower is None:
            raise ValueError(f"setup.cfg declares {name}{specifiers} without a lower bound: add `>=` the oldest tested")
        pins[name] = lower.group(1)
    return pins


def main() -> None:
    pins = oldest_pins(declared_requirements())
    sys.stdout.write("".join(f"{name}=={version}\n" for name, version in sorted(pins.items())))


if __name__ == "__main__":
    main()
