"""docs/choosing-a-layout.md shows the planner's real output: every ``$ lightning-smp estimate ...`` block on the
page is run (in this process, from the repository root) and must print what the page shows, less the closing
``Assumes ...`` lines. The worked examples' chosen layouts must fit, and must be rows of the listing they were
picked from.

After a change to the planner's figures or format, rewrite the blocks (`_REWRITE`).
"""

from __future__ import annotations

import contextlib
import io
import re
import shlex
import sys
from pathlib import Path

import pytest

_ROOT = Path(__file__).resolve().parents[1]
_PAGE = _ROOT / "docs" / "choosing-a-layout.md"
_PROMPT = "$ lightning-smp estimate "
_REWRITE = "rewrite the page's outputs with `.venv/bin/python tests/test_choosing_a_layout.py`"
# a ```text block whose first line is the command, then the output shown
_BLOCK = re.compile(r"```text\n(\$ lightning-smp estimate [^\n]*)\n(.*?)```", re.DOTALL)


def _estimate(command: str) -> str:
    """What ``command`` prints, without its ``Assumes ...`` lines."""
    from lightning_smp import cli

    out = io.StringIO()
    with contextlib.chdir(_ROOT), contextlib.redirect_stdout(out):
        cli.main(["estimate", *shlex.split(command.removeprefix(_PROMPT))])
    lines = [line.rstrip() for line in out.getvalue().splitlines() if not line.startswith("Assumes ")]
    return "\n".join(lines).strip() + "\n"


def _blocks() -> list[tuple[str, str]]:
    return _BLOCK.findall(_PAGE.read_text(encoding="utf-8"))


def test_the_page_has_both_worked_examples() -> None:
    commands = [command for command, _ in _blocks()]
    for config in ("gpt_7b", "gpt_7b_pp2_tp4", "gpt_70b", "gpt_70b_pp4_tp8_dp2"):
        assert any(f"examples/planning/{config}.yaml " in command for command in commands), config


@pytest.mark.timeout(900)  # the 70B listing: ~3 CPU s (63 before the trace of two layers), minutes at load 24
@pytest.mark.parametrize("command", [command for command, _ in _blocks()])
def test_each_estimate_on_the_page_prints_what_the_page_shows(command: str) -> None:
    shown = dict(_blocks())[command]
    assert _estimate(command) == shown, f"the output of `{command}` changed; {_REWRITE}"


@pytest.mark.parametrize(
    ("listing", "chosen", "row"),
    [
        ("gpt_7b.yaml", "gpt_7b_pp2_tp4.yaml", (2, 4, 1, "whole")),
        ("gpt_70b.yaml", "gpt_70b_pp4_tp8_dp2.yaml", (4, 8, 2, "whole")),
    ],
)
def test_each_chosen_layout_fits_and_is_a_row_of_the_listing_it_was_picked_from(listing, chosen, row) -> None:
    shown = {Path(command.split("--config ")[1].split()[0]).name: output for command, output in _blocks()}
    assert "does NOT fit" in shown[listing] and "Layouts of" in shown[listing]
    rows = {
        tuple(line.split()[:4])
        for line in shown[listing].split("smallest model-parallel degree first:\n")[1].splitlines()
    }
    assert tuple(map(str, row)) in rows
    pp, tp, dp, _ = row
    assert f"pp={pp} x tp={tp} x dp={dp}" in shown[chosen].splitlines()[0]
    assert re.search(r"^Largest rank: .*; fits in ", shown[chosen], re.MULTILINE)


def rewrite_page() -> None:
    """Replace each block's output with what its command prints now."""
    page = _PAGE.read_text(encoding="utf-8")
    page = _BLOCK.sub(lambda match: f"```text\n{match.group(1)}\n{_estimate(match.group(1))}```", page)
    _PAGE.write_text(page, encoding="utf-8")


if __name__ == "__main__":
    sys.path.insert(0, str(_ROOT))
    rewrite_page()
    print(f"rewrote the planner's outputs on {_PAGE.relative_to(_ROOT)}")
