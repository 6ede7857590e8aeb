"""Progress of long host-side work (materialising and loading a model; saving, consolidating, exporting one): a line
on rank 0 every few seconds with the bytes done, the total and the rate, so that minutes of work at 70B parameters
do not look like a hang.

Owns only the reporting: the caller says what it does and how many bytes it will handle, then how many it has
handled as it goes. Lines go through Lightning's ``rank_zero_info`` (shown by default in a Lightning run, once per
job); work that ends before the first interval prints nothing.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from types import TracebackType

from lightning.fabric.utilities.rank_zero import rank_zero_info

from lightning_smp.units import format_bytes

__all__ = ["Progress"]


class Progress:
    """Reports ``what`` (e.g. "materialising the model") as ``total`` bytes are handled.

    Use it as a context manager and call `advance` with the bytes of each piece done; a line is written when
    ``interval`` seconds have passed since the last one, and a closing line when at least one was written::

        with Progress("exporting the model", total) as progress:
            for tensor in tensors:
                write(tensor)
                progress.advance(tensor.nbytes)
    """

    def __init__(
        self,
        what: str,
        total: int,
        *,
        interval: float = 5.0,
        report: Callable[[str], None] = rank_zero_info,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._what = what
        self._total = total
        self._interval = interval
        self._report = report
        self._clock = clock
        self._done = 0
        self._start = self._last = clock()
        self._reported = False

    def advance(self, nbytes: int) -> None:
        """``nbytes`` more are done; write a line if the interval has passed."""
        self._done += nbytes
        now = self._clock()
        if now - self._last >= self._interval:
            self._last = now
            self._reported = True
            self._report(self._line(now))

    def __enter__(self) -> Progress:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        if kind is None and self._reported:
            elapsed = self._clock() - self._start
            self._report(
                f"lightning_smp: {self._what}: done, {format_bytes(self._done)} in {elapsed:.0f} s "
                f"({format_bytes(self._done / max(elapsed, 1e-9))}/s)"
            )

    def _line(self, now: float) -> str:
        elapsed = now - self._start
        share = f" ({100 * self._done / self._total:.0f}%)" if self._total else ""
        return (
            f"lightning_smp: {self._what}: {format_bytes(self._done)} of {format_bytes(self._total)}{share}, "
            f"{format_bytes(self._done / max(elapsed, 1e-9))}/s, {elapsed:.0f} s"
        )
