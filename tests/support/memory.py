"""The test process's peak resident memory over a stretch of a test (the proxy under test runs in it, in
a thread): Linux's high-water mark, reset through /proc/self/clear_refs, or, where the kernel refuses
the reset, the resident size sampled from a background thread."""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

_STATUS = Path("/proc/self/status")
_SAMPLE_EVERY_S = 0.002


def _status_kib(field: str) -> int:
    match = re.search(rf"^{field}:\s+(\d+) kB", _STATUS.read_text(), re.MULTILINE)
    assert match is not None, f"no {field} in {_STATUS}"
    return int(match.group(1))


@dataclass
class PeakGrowth:
    """How far resident memory rose above where it stood when the measurement began, in bytes."""

    bytes: int = 0


@contextmanager
def peak_rss_growth() -> Iterator[PeakGrowth]:
    """Measure the peak resident memory of the block above its start (filled in when the block ends)."""
    growth = PeakGrowth()
    try:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current resident size
    except OSError:
        with _sampled_peak() as peak:
            start = _status_kib("VmRSS")
            yield growth
        growth.bytes = max(0, peak[0] - start) * 1024
        return
    start = _status_kib("VmRSS")
    yield growth
    growth.bytes = max(0, _status_kib("VmHWM") - start) * 1024


@contextmanager
def _sampled_peak() -> Iterator[list[int]]:
    peak = [_status_kib("VmRSS")]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(_SAMPLE_EVERY_S):
            peak[0] = max(peak[0], _status_kib("VmRSS"))

    sampler = threading.Thread(target=sample, name="rss-sampler", daemon=True)
    sampler.start()
    try:
        yield peak
    finally:
        done.set()
        sampler.join()
        peak[0] = max(peak[0], _status_kib("VmRSS"))
