"""HTTP/1.1 requests written by hand on a socket, for what `httpx` cannot show: whether a server answers
a request before it has received all of its body. `send_body` streams a body from one reused buffer,
so the test process never holds it, and stops as soon as the answer arrives."""

from __future__ import annotations

import json
import selectors
import socket
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

_CHUNK = 1 << 20


@dataclass(frozen=True)
class RawAnswer:
    """A server's answer to `send_body` and how much of the body had been sent when it arrived."""

    status: int
    headers: dict[str, str]
    body: bytes
    sent: int
    """Body bytes written to the socket before the answer could be read."""

    def json(self) -> Any:
        return json.loads(self.body)


def send_body(
    base_url: str, path: str, headers: dict[str, str], size: int, *, chunked: bool = False,
    timeout_s: float = 120.0,
) -> RawAnswer:
    """POST a body of `size` bytes (with its Content-Length, or `chunked` without one), writing only while
    no answer is readable, then read the answer. `timeout_s` bounds the whole exchange (a server that
    neither reads nor answers fails the call instead of hanging it)."""
    url = urlsplit(base_url)
    deadline = time.monotonic() + timeout_s
    with socket.create_connection((url.hostname, url.port or 80), timeout=timeout_s) as sock:
        lines = [f"POST {path} HTTP/1.1", f"Host: {url.netloc}", *(f"{k}: {v}" for k, v in headers.items())]
        lines.append("Transfer-Encoding: chunked" if chunked else f"Content-Length: {size}")
        sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
        sent = _write_until_answered(sock, size, chunked, deadline)
        sock.settimeout(max(deadline - time.monotonic(), 0.1))
        status, answer_headers, body = _read_answer(sock)
    return RawAnswer(status, answer_headers, body, sent)


def _write_until_answered(sock: socket.socket, size: int, chunked: bool, deadline: float) -> int:
    block = b"x" * _CHUNK
    pending = b""
    sent = 0
    sock.setblocking(False)
    # A selector, not select(): a long test session may hold file descriptors past select()'s 1024.
    watch = selectors.DefaultSelector()
    watch.register(sock, selectors.EVENT_READ | selectors.EVENT_WRITE)
    try:
        while sent < size or pending:
            if time.monotonic() > deadline:
                raise TimeoutError(f"no answer after sending {sent} of {size} body bytes")
            events = next((mask for _key, mask in watch.select(1.0)), 0)
            if events & selectors.EVENT_READ:
                return sent
            if not events & selectors.EVENT_WRITE:
                continue
            if not pending:
                piece = block[: min(_CHUNK, size - sent)]
                pending = f"{len(piece):x}\r\n".encode() + piece + b"\r\n" if chunked else piece
                sent += len(piece)
            try:
                written = sock.send(pending)
            except (BrokenPipeError, ConnectionResetError):
                return sent  # the server stopped reading: its answer may still be readable
            pending = pending[written:]
        if chunked:
            sock.sendall(b"0\r\n\r\n")
        return sent
    finally:
        watch.close()
        sock.setblocking(True)


def _read_answer(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    data = b""
    while b"\r\n\r\n" not in data:
        piece = sock.recv(65536)
        if not piece:
            raise ConnectionError(f"connection closed before an answer ({data!r})")
        data += piece
    head, _, body = data.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in header_lines:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    length = int(headers.get("content-length", "0"))
    while len(body) < length:
        piece = sock.recv(65536)
        if not piece:
            break
        body += piece
    return int(status_line.split()[1]), headers, body[:length]
