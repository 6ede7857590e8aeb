"""Progress lines of long host-side work: every interval, with the bytes, the share and the rate; a closing line
when any was written; nothing for work shorter than the interval."""

import pytest

from lightning_smp.progress import Progress


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_line_every_interval_and_a_closing_one():
    lines, clock = [], _Clock()
    with Progress("loading", 4 * 2**30, interval=5.0, report=lines.append, clock=clock) as progress:
        clock.now += 1
        progress.advance(2**30)
        assert lines == []
        clock.now += 4
        progress.advance(2**30)
        clock.now += 5
        progress.advance(2**30)
    assert lines[0] == "lightning_smp: loading: 2.0 GiB of 4.0 GiB (50%), 409.6 MiB/s, 5 s"
    assert lines[1] == "lightning_smp: loading: 3.0 GiB of 4.0 GiB (75%), 307.2 MiB/s, 10 s"
    assert lines[2] == "lightning_smp: loading: done, 3.0 GiB in 10 s (307.2 MiB/s)"


def test_short_work_and_failed_work_write_no_closing_line():
    lines, clock = [], _Clock()
    with Progress("saving", 10, report=lines.append, clock=clock) as progress:
        progress.advance(10)
    assert lines == []
    with pytest.raises(RuntimeError), Progress("saving", 10, interval=0.0, report=lines.append, clock=clock) as p:
        clock.now += 1
        p.advance(5)
        raise RuntimeError
    assert lines == ["lightning_smp: saving: 5 B of 10 B (50%), 5 B/s, 1 s"]
