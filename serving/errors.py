"""Typed failures of a call to a serving worker, so callers can tell "unreachable" from "refused"."""

from __future__ import annotations


class WorkerError(Exception):
    """Any failure talking to a worker. `url` is the worker's base URL."""

    def __init__(self, message: str, *, url: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.url = url


class WorkerConnectionError(WorkerError):
    """The worker could not be reached, or the connection dropped before a complete answer.

    `request_sent` is False only when no connection was ever made (refused, unresolvable, connect
    timed out): then the worker cannot have seen the request, and resending it is always safe.
    """

    def __init__(self, message: str, *, url: str = "", request_sent: bool = True) -> None:
        super().__init__(message, url=url)
        self.request_sent = request_sent


class WorkerTimeout(WorkerError):
    """No (complete) answer within the client's connect or request timeout."""


class WorkerProtocolError(WorkerError):
    """The worker answered, but not in SGLang's protocol (bad JSON, bad SSE, wrong shape)."""


class WorkerHTTPError(WorkerError):
    """The worker answered with a non-2xx status. `message` is the server's own error text."""

    def __init__(self, status: int, message: str, *, url: str = "", path: str = "") -> None:
        super().__init__(f"{path or url} -> HTTP {status}: {message}", url=url)
        self.status = status
        self.message = message
        self.path = path


class WorkerBadRequest(WorkerHTTPError):
    """HTTP 400: the worker rejected the request (e.g. an unknown `sampling_params` key)."""


class WorkerLaunchError(WorkerError):
    """A worker process we started exited, or never became healthy. `output_tail` holds its last lines."""

    def __init__(self, message: str, *, url: str = "", output_tail: list[str] | None = None) -> None:
        tail = output_tail or []
        detail = "\n".join(tail)
        super().__init__(f"{message}\n--- last output lines ---\n{detail}" if tail else message, url=url)
        self.output_tail = tail
