"""Byte counts as people write them: "40GiB", "80GB", "1.5 MiB". A leaf module (it imports nothing of the package),
so the memory planner, progress reports and export all read sizes the same way without importing each other."""

from __future__ import annotations

import re

__all__ = ["format_bytes", "parse_bytes"]


def format_bytes(count: float) -> str:
    """``count`` bytes in binary units: "0 B", "1.5 KiB", "3.2 GiB"."""
    value = float(count)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024:
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_UNITS.update({"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40})


def parse_bytes(text: str) -> int:
    """``"40GiB"`` (binary), ``"80GB"`` (decimal), ``"40G"`` (binary, as ``nvidia-smi`` and ``ls -h``) or a
    plain number of bytes."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([a-zA-Z]*)\s*", text)
    if match is None or match.group(2).lower() not in _UNITS:
        raise ValueError(
            f"{text!r} is not a size; give a number with a unit, e.g. '40GiB', '80GB' or "
            "'141G' (binary), or a plain number of bytes."
        )
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])
