"""Run untrusted Python (a model's code and its tests) in a throwaway sandbox.

`run_python(source, cpu_s=…, memory_mb=…, wall_s=…)` runs `source` as `python -I main.py`:
- in a fresh scratch directory (its cwd, removed afterwards), with an environment of only PATH and LANG;
- without network: under `unshare --net` (a network namespace holding only a loopback that is down), and
  where permitted in a PID namespace too (`--pid --fork --kill-child`: when the sandbox ends, every process
  the program started ends with it, even one that left its process group);
- as `nobody` when we run as root (where that user can run our interpreter);
- under resource limits set in the child: CPU seconds, address space, file size, open files, no core dumps;
- in a session of its own, so a wall-clock timeout kills the whole process tree (`os.killpg`, SIGKILL).

A small bootstrap sits between `unshare` and the program: it forks, applies the limits in the child, execs
the program and reports on a private pipe how the program ended and the CPU time it used, which tells the
CPU limit (SIGXCPU, or SIGKILL at the hard limit) from memory exhaustion (a MemoryError, or the kernel
killing it).
Which `unshare` invocation works is probed once per process, on first use; when none works, every call
raises `SandboxUnavailableError`: code never runs with network.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import shutil
import signal
import sys
import tempfile
from dataclasses import dataclass
from typing import Any, BinaryIO, Literal

KilledBy = Literal["cpu", "memory", "wall"]

TAIL_BYTES = 4096
"""How much of the end of stdout and of stderr a result keeps."""
NOBODY = 65534
FSIZE_BYTES = 64 * 1024 * 1024
NOFILE = 64
_PROGRAM = "main.py"
_READ_CHUNK = 64 * 1024
_DRAIN_S = 2.0
"""How long to wait for the output pipes to close once the program has ended and its group is killed."""
_PROBE_SOURCE = (
    "import socket, sys\n"
    "names = [name for _, name in socket.if_nameindex()]\n"
    "sys.exit(0 if names == ['lo'] else 3)\n"
)
_MEMORY_MARKERS = ("MemoryError", "Cannot allocate memory", "out of memory")

_BOOTSTRAP = """
import json, os, resource, sys
fd, cpu, address_space, fsize, nofile, drop, uid = (int(arg) for arg in sys.argv[1:8])
pid = os.fork()
if pid == 0:
    try:
        os.close(fd)
        if drop and os.geteuid() == 0:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
        resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
        resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))
        resource.setrlimit(resource.RLIMIT_AS, (address_space, address_space))
        os.execv(sys.executable, [sys.executable, "-I", sys.argv[8]])
    except BaseException as exc:
        os.write(2, ("sandbox: the program could not start: %r\\n" % (exc,)).encode())
    finally:
        os._exit(127)
_, status, usage = os.wait4(pid, 0)
os.write(fd, json.dumps({
    "exit_code": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None,
    "signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
    "cpu_s": usage.ru_utime + usage.ru_stime,
    "max_rss_kb": usage.ru_maxrss,
}).encode())
"""


class SandboxUnavailableError(RuntimeError):
    """No way to run code without network works on this machine (`unshare --net` is not permitted)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class SandboxMode:
    """How this process runs sandboxed code: the `unshare` command line, and whether a root caller's
    program runs as `nobody`."""

    prefix: tuple[str, ...]
    drop_root: bool

    @property
    def isolates_pids(self) -> bool:
        """True when the program runs in a PID namespace of its own (nothing it starts outlives it)."""
        return "--pid" in self.prefix


@dataclass(frozen=True, slots=True, kw_only=True)
class SandboxResult:
    """How a sandboxed program ended: its exit code (None when a signal ended it), the signal, the last
    `TAIL_BYTES` of its stdout and stderr, which limit killed it, and the CPU seconds it used (None when
    unknown: it was killed from outside)."""

    exit_code: int | None
    signal: int | None
    stdout: str
    stderr: str
    killed_by: KilledBy | None
    cpu_s: float | None = None

    @property
    def passed(self) -> bool:
        """It exited with status 0 within its limits."""
        return self.exit_code == 0 and self.killed_by is None


@dataclass(frozen=True, slots=True)
class _Limits:
    cpu_s: int
    address_space: int
    wall_s: float


_PREFIXES: tuple[tuple[str, ...], ...] = (
    ("unshare", "--net", "--pid", "--fork", "--kill-child"),
    ("unshare", "--net"),
    ("unshare", "--map-root-user", "--net", "--pid", "--fork", "--kill-child"),
    ("unshare", "--map-root-user", "--net"),
)
_CANDIDATES: tuple[SandboxMode, ...] = tuple(
    SandboxMode(prefix=prefix, drop_root=drop)
    for prefix in _PREFIXES
    for drop in ((True, False) if "--map-root-user" not in prefix else (False,))
)
_probed: list[SandboxMode | SandboxUnavailableError] = []
"""The probe's answer, once known (per process)."""


async def run_python(
    source: str, *, cpu_s: float, memory_mb: int, wall_s: float, stdin: str = ""
) -> SandboxResult:
    """Run `source` in the sandbox with these limits (CPU seconds are whole seconds, rounded up) and return
    how it ended. A program killed by a limit is a result, not an error; raises SandboxUnavailableError
    when code cannot run without network here."""
    if cpu_s <= 0 or memory_mb <= 0 or wall_s <= 0:
        raise ValueError("cpu_s, memory_mb and wall_s must be positive")
    mode = await sandbox_mode()
    limits = _Limits(max(1, math.ceil(cpu_s)), memory_mb * 1024 * 1024, wall_s)
    return await _execute(mode, source, limits, stdin)


async def sandbox_mode() -> SandboxMode:
    """The first way of running code without network that works here (probed once per process)."""
    if not _probed:
        _probed.append(await _probe())
    answer = _probed[0]
    if isinstance(answer, SandboxUnavailableError):
        raise answer
    return answer


async def _probe() -> SandboxMode | SandboxUnavailableError:
    failures: list[str] = []
    for mode in _CANDIDATES:
        try:
            result = await _execute(mode, _PROBE_SOURCE, _Limits(10, 1024 * 1024 * 1024, 30.0), "")
        except OSError as exc:
            failures.append(f"{' '.join(mode.prefix)}: {exc}")
            continue
        if result.passed:
            return mode
        failures.append(f"{' '.join(mode.prefix)} (drop_root={mode.drop_root}): {_describe(result)}")
    return SandboxUnavailableError(
        "cannot run code without network: no `unshare --net` variant works here (" + "; ".join(failures) + ")"
    )


def _describe(result: SandboxResult) -> str:
    ending = f"signal {result.signal}" if result.signal is not None else f"exit {result.exit_code}"
    return f"{ending}, {result.stderr.strip()[-300:]!r}"


async def _execute(mode: SandboxMode, source: str, limits: _Limits, stdin: str) -> SandboxResult:
    scratch = tempfile.mkdtemp(prefix="flywheel-sandbox-")
    try:
        _write_program(scratch, source, mode.drop_root)
        return await _spawn_and_wait(mode, scratch, limits, stdin)
    finally:
        await asyncio.to_thread(shutil.rmtree, scratch, True)


def _write_program(scratch: str, source: str, drop_root: bool) -> None:
    """Put the program in the scratch directory; both are `nobody`'s when the program will run as it."""
    program = os.path.join(scratch, _PROGRAM)
    with open(program, "w", encoding="utf-8") as handle:
        handle.write(source)
    if drop_root and os.geteuid() == 0:
        os.chown(scratch, NOBODY, NOBODY)
        os.chown(program, NOBODY, NOBODY)


def _environment() -> dict[str, str]:
    return {"PATH": os.environ.get("PATH", os.defpath), "LANG": os.environ.get("LANG", "C.UTF-8")}


def _command(mode: SandboxMode, status_fd: int, scratch: str, limits: _Limits) -> list[str]:
    drop = int(mode.drop_root)
    arguments = (status_fd, limits.cpu_s, limits.address_space, FSIZE_BYTES, NOFILE, drop, NOBODY)
    return [
        *mode.prefix,
        "--",
        sys.executable,
        "-I",
        "-c",
        _BOOTSTRAP,
        *(str(argument) for argument in arguments),
        os.path.join(scratch, _PROGRAM),
    ]


async def _spawn_and_wait(mode: SandboxMode, scratch: str, limits: _Limits, stdin: str) -> SandboxResult:
    """Start the bootstrap with pipes of our own for its output and status (the event loop's subprocess
    pipes would keep `wait()` waiting for every process holding them) and supervise it."""
    with contextlib.ExitStack() as stack:
        stdin_file = stack.enter_context(tempfile.TemporaryFile())
        stdin_file.write(stdin.encode())
        stdin_file.seek(0)
        (status_pipe, status_write), (out_pipe, out_write), (err_pipe, err_write) = (
            _pipe(stack) for _ in range(3)
        )
        try:
            process = await asyncio.create_subprocess_exec(
                *_command(mode, status_write, scratch, limits),
                cwd=scratch,
                env=_environment(),
                stdin=stdin_file,
                stdout=out_write,
                stderr=err_write,
                start_new_session=True,
                pass_fds=(status_write,),
            )
        finally:
            for fd in (status_write, out_write, err_write):
                os.close(fd)
        report, outputs, wall_killed = await _supervise(
            process, (status_pipe, out_pipe, err_pipe), limits.wall_s
        )
    status = None if wall_killed else _parse_status(report)
    stdout, stderr = (_decode(output) for output in outputs)
    return _result(status, process.returncode, stdout, stderr, wall_killed, limits)


def _pipe(stack: contextlib.ExitStack) -> tuple[BinaryIO, int]:
    """A pipe: its read end as a file the stack closes, and its write end's descriptor."""
    read_fd, write_fd = os.pipe()
    try:
        reader = stack.enter_context(os.fdopen(read_fd, "rb", buffering=0))
    except BaseException:
        os.close(read_fd)
        os.close(write_fd)
        raise
    return reader, write_fd


async def _supervise(
    process: asyncio.subprocess.Process, pipes: tuple[BinaryIO, BinaryIO, BinaryIO], wall_s: float
) -> tuple[bytes, tuple[bytes, bytes], bool]:
    """Wait for the bootstrap to end (its status pipe closing), killing the group past `wall_s` or when
    we are cancelled; then kill whatever is left of the group and collect the tails of the output (for at
    most `_DRAIN_S`: a process that left the group may hold the pipes open). Returns the bootstrap's report,
    the output tails and whether the wall-clock limit killed the program."""
    kept = (bytearray(), bytearray(), bytearray())
    status, *readers = (
        asyncio.create_task(_read_pipe(pipe, into)) for pipe, into in zip(pipes, kept, strict=True)
    )
    try:
        done, _ = await asyncio.wait({status}, timeout=wall_s)
        wall_killed = not done
        _kill_group(process.pid)
        deadline = asyncio.get_running_loop().time() + _DRAIN_S
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(process.wait(), _DRAIN_S)
        await asyncio.wait(readers, timeout=max(0.0, deadline - asyncio.get_running_loop().time()))
    finally:
        if process.returncode is None:
            _kill_group(process.pid)
        for task in (status, *readers):
            task.cancel()
        await asyncio.gather(status, *readers, return_exceptions=True)
    return bytes(kept[0]), (bytes(kept[1]), bytes(kept[2])), wall_killed


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


async def _read_pipe(pipe: BinaryIO, kept: bytearray) -> None:
    """Read a pipe until every writer has closed it, keeping its last TAIL_BYTES in `kept`; the pipe is
    closed when this returns or is cancelled."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    transport, _ = await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), pipe)
    try:
        while chunk := await reader.read(_READ_CHUNK):
            kept += chunk
            if len(kept) > TAIL_BYTES:
                del kept[:-TAIL_BYTES]
    finally:
        transport.close()


def _parse_status(report: bytes) -> dict[str, Any] | None:
    """The bootstrap's report on how the program ended (None when it wrote none: it was killed)."""
    try:
        status = json.loads(report) if report else None
    except ValueError:
        return None
    return status if isinstance(status, dict) else None


def _decode(output: bytes) -> str:
    return output.decode("utf-8", errors="replace")


def _result(
    status: dict[str, Any] | None,
    returncode: int | None,
    stdout: str,
    stderr: str,
    wall_killed: bool,
    limits: _Limits,
) -> SandboxResult:
    if status is None:
        exit_code = returncode if returncode is not None and returncode >= 0 else None
        died_of = -returncode if returncode is not None and returncode < 0 else None
        cpu_s, max_rss_kb = None, 0
    else:
        exit_code, died_of = status.get("exit_code"), status.get("signal")
        cpu_s, max_rss_kb = float(status.get("cpu_s", 0.0)), int(status.get("max_rss_kb", 0))
    killed_by = "wall" if wall_killed else _limit_hit(exit_code, died_of, cpu_s, max_rss_kb, stderr, limits)
    return SandboxResult(
        exit_code=exit_code, signal=died_of, stdout=stdout, stderr=stderr, killed_by=killed_by, cpu_s=cpu_s
    )


def _limit_hit(
    exit_code: int | None,
    died_of: int | None,
    cpu_s: float | None,
    max_rss_kb: int,
    stderr: str,
    limits: _Limits,
) -> KilledBy | None:
    """Which limit ended a program that we did not kill: SIGXCPU (or the SIGKILL of the hard CPU limit,
    one second past the soft one) is the CPU limit; a MemoryError (or the like) in its last words, a SIGKILL
    well within the CPU limit (the kernel's OOM killer) or a crash near the memory limit is memory. The CPU
    time the bootstrap reports (rusage) can fall short of what the kernel's limit counts, hence the margin."""
    cpu_spent = cpu_s is not None and cpu_s >= limits.cpu_s / 2
    if died_of == signal.SIGXCPU or (died_of == signal.SIGKILL and cpu_spent):
        return "cpu"
    if died_of == signal.SIGKILL:
        return "memory"
    near_memory_limit = max_rss_kb * 1024 * 2 >= limits.address_space
    if died_of in (signal.SIGSEGV, signal.SIGBUS, signal.SIGABRT) and near_memory_limit:
        return "memory"
    last_words = stderr[-1024:]
    if exit_code not in (None, 0) and any(marker in last_words for marker in _MEMORY_MARKERS):
        return "memory"
    return None
