"""Every log record a block of a test emits, from the proxy's loggers and from uvicorn's (which do not
propagate to the root logger, so pytest's caplog never sees them): what a server's log would hold."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

_LOGGERS = ("", "uvicorn")  # uvicorn.error propagates to uvicorn, which stops there


class LogTap(logging.Handler):
    """Keeps the records it is handed."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def tracebacks(self) -> list[str]:
        """The records that carry a traceback, formatted as a log would show them."""
        formatter = logging.Formatter("%(name)s %(levelname)s %(message)s")
        return [formatter.format(record) for record in self.records
                if record.exc_info or "Traceback (most recent call last)" in record.getMessage()]

    def at_least(self, level: int) -> list[str]:
        return [f"{r.name} {r.levelname} {r.getMessage()}" for r in self.records if r.levelno >= level]


@contextmanager
def tapped_logs() -> Iterator[LogTap]:
    """A `LogTap` on the root logger and uvicorn's for the block."""
    tap = LogTap()
    loggers = [logging.getLogger(name) for name in _LOGGERS]
    for logger in loggers:
        logger.addHandler(tap)
    try:
        yield tap
    finally:
        for logger in loggers:
            logger.removeHandler(tap)
