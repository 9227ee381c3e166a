"""Progress bars of the long `flywheel` commands (`demo`, `db purge-json`; `export` draws its own the same
way). They go to stderr, so that stdout stays what a script reads, and by default they are drawn only when
stderr is a terminal, so that a log file or CI output gets no bar frames.

`serving` and `integrations` may not import this package: their bars (the model conversion, the OpenClaw
task driver, the Scaffolding example) call tqdm directly with the same conventions.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any, TextIO

if TYPE_CHECKING:
    from tqdm import tqdm


def bar_disabled(enabled: bool | None) -> bool | None:
    """tqdm's `disable` for `enabled`: None (draw only on a terminal) stays None, True draws always
    (tests), False never."""
    return None if enabled is None else not enabled


def progress_bar(
    total: int | None, *, desc: str, unit: str, enabled: bool | None = None, file: TextIO | None = None
) -> tqdm[object]:
    """A bar counting `unit`s up to `total` (None: a counter) on `file` (default: stderr at the time of
    the call), drawn as `enabled` says (`bar_disabled`). Close it when done (or use it as a context
    manager)."""
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, file=file if file is not None else sys.stderr,
                disable=bar_disabled(enabled), dynamic_ncols=True, leave=True)


class PhaseBar:
    """`start_stack`'s `on_phase` drawn on `bar`: a phase is done when the next one begins."""

    def __init__(self, bar: tqdm[Any]) -> None:
        self.bar = bar
        self.begun = False

    def __call__(self, name: str) -> None:
        if self.begun:
            self.bar.update(1)
        self.begun = True
        self.bar.set_description_str(f"start-up: {name}")

    def finish(self) -> None:
        """The last phase is done too."""
        if self.begun:
            self.bar.update(1)
        self.bar.set_description_str("start-up")
