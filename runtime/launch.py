"""Run a function on N local ``torch.distributed`` ranks, one process each, without hanging.

``spawn(fn, world_size)`` is the launcher used by multi-process tests and by ``autopar
calibrate``: it starts ``world_size`` processes with the multiprocessing "spawn" start method,
initialises a process group in each (gloo by default, over TCP on a free localhost port),
calls ``fn(rank, world_size, *args)`` and returns the ranks' return values in rank order.

What it guarantees, because a hung CI job is worse than a failed one:

- a rank that raises makes the whole launch fail at once with :class:`RankFailedError`
  carrying that rank's formatted traceback; the other ranks (likely blocked in a collective
  waiting for the dead one) are terminated rather than waited for;
- a rank that dies without reporting (``os._exit``, a segfault, a SIGKILL) is noticed through
  its process sentinel within milliseconds, not at the timeout;
- a rank that is alive but stopped (SIGSTOP, SIGTSTP, or SIGTTIN from reading the terminal in
  the background) is noticed through its process state (``/proc/<pid>/stat`` on Linux) and
  fails the launch after ``stopped_grace_s``, naming the rank; a stopped process never closes
  its sockets, so neither the sentinel nor a peer's connection error would ever fire;
- every process group a rank creates (the world group and later ``new_group`` / device-mesh
  groups) has a bounded collective timeout, ``DEFAULT_COLLECTIVE_TIMEOUT_S`` unless overridden,
  so a rank waiting on a silent peer raises instead of waiting for torch's 30-minute default;
- a global ``timeout_s`` bounds the whole launch and names the ranks that had not finished;
- the port race (another process grabbing the port between our probe and the TCP store's
  bind) is retried once with a fresh port;
- where a rank times out waiting for a peer that is alive and silent (a collective the peer
  never reached: ranks out of step), the peer prints every thread's Python stack to stderr
  (`faulthandler`, on SIGUSR1) before it is terminated, and the error says so: the report
  names where each rank was.

Each child pipe carries exactly one message: ``("ok", value)`` or ``("error", phase, text,
summary)``, where ``summary`` is the exception's type and message without the traceback.
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import multiprocessing as mp
import os
import signal
import socket
import time
import traceback
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection, wait
from typing import Any

__all__ = [
    "DEFAULT_COLLECTIVE_TIMEOUT_S",
    "DEFAULT_STOPPED_GRACE_S",
    "RankFailedError",
    "default_collective_timeout_s",
    "free_port",
    "last_exception",
    "spawn",
]

# How long ranks get to exit on their own after reporting success (they only have to destroy
# the process group) before they are killed.
_JOIN_GRACE_S = 10.0
# How long the live ranks get to print their stacks before they are terminated.
_STACKS_WAIT_S = 1.0
# How long a SIGTERM'd rank gets before SIGKILL.
_TERMINATE_GRACE_S = 2.0
# Collective (and rendezvous) timeout of every process group a rank creates, unless the caller
# or $AUTOPAR_COLLECTIVE_TIMEOUT_S says otherwise; never longer than the launch's timeout_s.
DEFAULT_COLLECTIVE_TIMEOUT_S = 90.0
# How long a rank may sit in the stopped state (SIGSTOP, SIGTSTP, SIGTTIN) before the launch
# fails; a job-control stop of the whole job (Ctrl-Z) stops the launcher too and is not seen.
DEFAULT_STOPPED_GRACE_S = 5.0
_COLLECTIVE_TIMEOUT_ENV = "AUTOPAR_COLLECTIVE_TIMEOUT_S"


class RankFailedError(RuntimeError):
    """A rank raised an exception, or its process died without reporting a result.

    Attributes:
        rank: the failing rank.
        traceback_text: the rank's formatted traceback, or a description of how it died.
        exitcode: the process exit code when the rank died without reporting, else ``None``.
        summary: the root cause in one paragraph, without the traceback: the exception's type
            and message, or how the rank died or stopped.
    """

    def __init__(
        self,
        rank: int,
        traceback_text: str,
        exitcode: int | None = None,
        summary: str | None = None,
    ) -> None:
        self.rank = rank
        self.traceback_text = traceback_text
        self.exitcode = exitcode
        self.summary = summary or last_exception(traceback_text)
        if exitcode is None:
            msg = f"rank {rank} failed:\n{traceback_text}"
        else:
            msg = f"rank {rank} died: {traceback_text}"
        super().__init__(msg)

    def __reduce__(self) -> tuple[Any, ...]:
        # Keep the exception picklable (pytest-xdist, nested launchers) despite the custom init.
        return (type(self), (self.rank, self.traceback_text, self.exitcode, self.summary))


def last_exception(text: str) -> str:
    """The final exception of a formatted traceback (``"Type: message"``, all its lines).

    Text that is not a traceback (a description of how a rank died) is returned stripped.
    """
    lines = text.strip().splitlines()
    frames = [i for i, line in enumerate(lines) if line.startswith('  File "')]
    if "Traceback (most recent call last):" not in text or not frames:
        return text.strip()
    rest = lines[frames[-1] + 1:]
    # skip the frame's source line and its ^^^ markers (indented by four spaces)
    while rest and rest[0].startswith("    "):
        rest = rest[1:]
    return "\n".join(rest).strip() or text.strip()


class _AddressInUse(Exception):
    """Internal: rank setup failed because the chosen port was taken; the launch is retried."""


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that was free a moment ago (bound to port 0 and released).

    Another process can still take it before it is used; :func:`spawn` retries once for that.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _is_address_in_use(text: str) -> bool:
    low = text.lower()
    return "address already in use" in low or "eaddrinuse" in low


# Errors a rank gets because a *peer* died (gloo sees the TCP connection drop); when several
# reports arrive together, the one without these is the root cause.
_SECONDARY_ERROR_MARKERS = (
    "connection closed by peer",
    "connection reset",
    "broken pipe",
    "timed out waiting",  # gloo: a peer never joined the collective
    "connection was likely closed",  # the TCPStore: "did the remote worker crash or hang?"
    "remote worker",
)
# When every report is such a symptom, a peer that died without reporting is the root cause;
# under load its exit can land a moment after the symptom: wait this long for it.
_PEER_EXIT_WAIT_S = 3.0


def _is_secondary(text: str) -> bool:
    low = text.lower()
    return any(m in low for m in _SECONDARY_ERROR_MARKERS)


def _dead_peer(procs, ranks: list[int], wait_s: float) -> int | None:
    """The first of ``ranks`` that exits with a failure within ``wait_s`` seconds, if any."""
    deadline = time.monotonic() + wait_s
    while True:
        for r in ranks:
            code = procs[r].exitcode
            if code is not None and code != 0:
                return r
        if time.monotonic() >= deadline:
            return None
        wait([procs[r].sentinel for r in ranks], timeout=0.1)


def _root_cause(errors: list[tuple[int, str, str, str]]) -> tuple[int, str, str, str]:
    """Pick the report to raise from those that arrived together: a primary failure first."""
    for err in errors:
        if not any(m in err[2].lower() for m in _SECONDARY_ERROR_MARKERS):
            return err
    return errors[0]


def _describe_death(code: int | None) -> str:
    """Say how a rank that never reported ended, with the likely reason."""
    if code is not None and code < 0:
        try:
            how = f"killed by {signal.Signals(-code).name} (exit code {code})"
        except ValueError:
            how = f"killed by signal {-code} (exit code {code})"
    else:
        how = f"exited (exit code {code})"
    return (
        f"{how} without reporting a result (a crash, os._exit, the OOM killer, or a failure "
        "before the rank started, e.g. fn not importable by name in a spawned child: see the "
        "rank's stderr)"
    )


def _process_state(pid: int) -> str | None:
    """The kernel's one-letter state of ``pid`` ("R", "S", "T" stopped, ...); None if unknown.

    Reads ``/proc/<pid>/stat`` (Linux); elsewhere stopped ranks are caught by the collective
    timeout of their peers instead.
    """
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    # "pid (comm) S ...": comm may hold spaces and parentheses, so split after the last ")"
    fields = stat[stat.rfind(")") + 1:].split()
    return fields[0] if fields else None


def _describe_stop(stopped_s: float) -> str:
    """Say that a rank was stopped, with the likely reasons and the fix."""
    return (
        f"the rank's process was stopped (state T: SIGSTOP, SIGTSTP, or SIGTTIN/SIGTTOU from "
        f"using the terminal while in the background, e.g. input() or pdb) for {stopped_s:.0f} s "
        "while the other ranks waited for it, so the launch was ended; fix: find what stops "
        "it (a `kill -STOP`, a background job reading stdin), or run the job in the foreground"
    )


def _set_default_group_timeout(seconds: float) -> None:
    """Make groups created later without a timeout (new_group, device meshes) use ``seconds``.

    torch's default is 30 minutes; ``new_group`` reads this module global at call time.
    """
    from torch.distributed import distributed_c10d

    if hasattr(distributed_c10d, "default_pg_timeout"):
        distributed_c10d.default_pg_timeout = datetime.timedelta(seconds=seconds)


def _worker(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    args: tuple[Any, ...],
    port: int,
    backend: str,
    timeout_s: float,
    env: dict[str, str],
    conn: Connection,
) -> None:
    """Child entry point: init the group, run ``fn``, report exactly one message, clean up."""
    # The parent already exported env before starting us (so the OpenMP runtime saw it at load
    # time); setting it again covers variables a caller reads lazily through os.environ.
    os.environ.update(env)
    if hasattr(signal, "SIGUSR1"):  # where this rank is, on request (`_print_stacks`)
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    phase = "init"
    try:
        import torch
        import torch.distributed as dist

        threads = env.get("OMP_NUM_THREADS")
        if threads and threads.isdigit() and int(threads) > 0:
            torch.set_num_threads(int(threads))
        _set_default_group_timeout(timeout_s)
        dist.init_process_group(
            backend,
            rank=rank,
            world_size=world_size,
            init_method=f"tcp://127.0.0.1:{port}",
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        phase = "run"
        value = fn(rank, world_size, *args)
        phase = "result"
        # send() pickles before writing anything, so an unpicklable result becomes a clean
        # error message instead of a torn pipe.
        conn.send(("ok", value))
    except BaseException as exc:  # everything, including SystemExit, must be reported
        text = traceback.format_exc()
        summary = f"{type(exc).__name__}: {exc}".strip().rstrip(":")
        with contextlib.suppress(Exception):
            conn.send(("error", phase, text, summary))
        conn.close()
        # Skip destroy_process_group: peers may be stuck in a collective with us and the parent
        # is about to kill everyone anyway.
        os._exit(1)
    conn.close()
    try:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # the result is already delivered; teardown is best effort
        pass


@contextlib.contextmanager
def _exported_env(env: dict[str, str]) -> Iterator[None]:
    """Temporarily export ``env`` so spawned children inherit it from their first instruction."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _stop(procs: list[mp.process.BaseProcess]) -> None:
    """Terminate every live process at once, then SIGKILL whatever ignores SIGTERM."""
    for p in procs:
        if p.is_alive():
            p.terminate()
            # a stopped process keeps SIGTERM pending until it is continued
            if p.pid is not None:
                with contextlib.suppress(OSError):
                    os.kill(p.pid, signal.SIGCONT)
    deadline = time.monotonic() + _TERMINATE_GRACE_S
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(1.0)


class _StopWatch:
    """Notices ranks that stay in the stopped state: alive, silent, holding their sockets open."""

    def __init__(self, procs: list[mp.process.BaseProcess], grace_s: float | None) -> None:
        self.procs = procs
        self.grace_s = grace_s
        self.since: dict[int, float] = {}  # rank -> when it was first seen stopped

    def stopped(self, ranks: list[int]) -> list[int]:
        """Those of ``ranks`` whose process is stopped right now (and remember since when)."""
        now = time.monotonic()
        found = []
        for r in ranks:
            pid = self.procs[r].pid
            if pid is not None and _process_state(pid) == "T":
                self.since.setdefault(r, now)
                found.append(r)
            else:
                self.since.pop(r, None)
        return found

    def error(self, rank: int) -> RankFailedError:
        """The failure to raise for a stopped ``rank``."""
        text = _describe_stop(time.monotonic() - self.since.get(rank, time.monotonic()))
        return RankFailedError(rank, text, summary=text)

    def check(self, ranks: list[int]) -> None:
        """Raise for the first of ``ranks`` stopped for longer than the grace period."""
        if self.grace_s is None:
            return
        now = time.monotonic()
        for r in self.stopped(ranks):
            if now - self.since[r] >= self.grace_s:
                raise self.error(r)


def _launch_once(
    fn: Callable[..., Any],
    world_size: int,
    args: tuple[Any, ...],
    timeout_s: float,
    backend: str,
    env: dict[str, str],
    collective_timeout_s: float,
    stopped_grace_s: float | None,
) -> list[Any]:
    ctx = mp.get_context("spawn")
    port = free_port()
    procs: list[mp.process.BaseProcess] = []
    readers: list[Connection] = []
    results: dict[int, Any] = {}
    # Ranks whose pipe hit EOF without a report; their death is confirmed by the sentinel.
    silent: set[int] = set()
    watch = _StopWatch(procs, stopped_grace_s)
    deadline = time.monotonic() + timeout_s
    try:
        with _exported_env(env):
            for rank in range(world_size):
                r, w = ctx.Pipe(duplex=False)
                p = ctx.Process(
                    target=_worker,
                    args=(fn, rank, world_size, args, port, backend, collective_timeout_s, env, w),
                    name=f"autopar-rank{rank}",
                )
                p.start()
                # Close our copy of the write end so a dead child reads as EOF, not silence.
                w.close()
                procs.append(p)
                readers.append(r)

        while len(results) < world_size:
            pending = [r for r in range(world_size) if r not in results]
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                stopped = watch.stopped(pending)
                note = f" (stopped: {stopped})" if stopped else ""
                raise TimeoutError(
                    f"spawn timed out after {timeout_s:g} s; ranks not finished: {pending}{note}"
                )
            waitables: list[Any] = [readers[r] for r in pending if r not in silent]
            waitables += [procs[r].sentinel for r in pending]
            ready = wait(waitables, timeout=min(remaining, 1.0))
            if not ready:
                watch.check(pending)
                continue
            # Read reports before looking at exits: a rank that reported and then exited has
            # its message sitting in the pipe when its sentinel fires.
            errors = []
            for r in pending:
                if r in silent:
                    continue
                if readers[r] in ready or (procs[r].exitcode is not None and readers[r].poll()):
                    err = _read_report(readers[r], r, results, silent)
                    if err is not None:
                        errors.append(err)
            if errors:
                _raise_failure(errors, [r for r in pending if r not in results], procs, watch)
            for r in pending:
                if r not in results and procs[r].exitcode is not None:
                    code = procs[r].exitcode
                    raise RankFailedError(r, _describe_death(code), code)
            watch.check([r for r in pending if r not in results])

        # Everyone reported; let them tear down their process groups, but don't wait forever.
        join_deadline = time.monotonic() + min(_JOIN_GRACE_S, max(1.0, deadline - time.monotonic()))
        for p in procs:
            p.join(max(0.0, join_deadline - time.monotonic()))
        return [results[r] for r in range(world_size)]
    finally:
        _stop(procs)
        for r in readers:
            r.close()


def _read_report(reader: Connection, rank: int, results: dict[int, Any],
                 silent: set[int]) -> tuple[int, str, str, str] | None:
    """Read ``rank``'s report: store a result, or return (rank, phase, traceback, summary)."""
    try:
        msg = reader.recv()
    except (EOFError, OSError):
        # Died mid-report or without one: the sentinel check reports it. Stop waiting
        # on this pipe, which would otherwise read as ready forever.
        silent.add(rank)
        return None
    if msg[0] == "ok":
        results[rank] = msg[1]
        return None
    return (rank, msg[1], msg[2], msg[3])


def _raise_failure(errors: list[tuple[int, str, str, str]], unfinished: list[int],
                   procs: list[mp.process.BaseProcess], watch: _StopWatch) -> None:
    """Raise the error that explains the ranks' reports (``errors``): a stopped peer, a port
    taken at init, a dead peer behind secondary errors, else the root cause's rank.
    ``unfinished``: the ranks with no result yet."""
    # a peer that is stopped explains the others' timeouts: name it instead
    stopped = watch.stopped(unfinished)
    if stopped:
        raise watch.error(stopped[0])
    rank, phase, text, summary = _root_cause(errors)
    if phase == "init" and _is_address_in_use(text):
        raise _AddressInUse(text)
    if _is_secondary(text):
        reported = {e[0] for e in errors}
        quiet = [r for r in unfinished if r not in reported]
        dead = _dead_peer(procs, quiet, _PEER_EXIT_WAIT_S) if quiet else None
        if dead is not None:
            code = procs[dead].exitcode
            raise RankFailedError(dead, _describe_death(code), code)
        asked = _print_stacks(procs, quiet)
        if asked:
            text += (f"\n(ranks {asked} were alive and had not reported: each printed every "
                     "thread's Python stack to stderr above, where it was when this rank gave up)")
    raise RankFailedError(rank, text, summary=summary)


def _print_stacks(procs: list[mp.process.BaseProcess], ranks: list[int]) -> list[int]:
    """Ask the live ones of ``ranks`` to print their threads' Python stacks to stderr (SIGUSR1,
    `faulthandler`); the ranks asked, after a moment for them to write."""
    if not hasattr(signal, "SIGUSR1"):
        return []
    asked = []
    for r in ranks:
        if procs[r].is_alive() and procs[r].pid is not None:
            with contextlib.suppress(OSError):
                os.kill(procs[r].pid, signal.SIGUSR1)
                asked.append(r)
    if asked:
        time.sleep(_STACKS_WAIT_S)
    return asked


def default_collective_timeout_s() -> float:
    """``$AUTOPAR_COLLECTIVE_TIMEOUT_S`` if set (seconds), else ``DEFAULT_COLLECTIVE_TIMEOUT_S``."""
    text = os.environ.get(_COLLECTIVE_TIMEOUT_ENV, "").strip()
    if not text:
        return DEFAULT_COLLECTIVE_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if value <= 0:
        raise ValueError(
            f"${_COLLECTIVE_TIMEOUT_ENV}={text!r} is not a positive number of seconds; "
            f"fix: set it to e.g. 90, or unset it for the default {DEFAULT_COLLECTIVE_TIMEOUT_S:g} s"
        )
    return value


def spawn(
    fn: Callable[..., Any],
    world_size: int,
    args: tuple[Any, ...] = (),
    timeout_s: float = 120.0,
    backend: str = "gloo",
    env: dict[str, str] | None = None,
    collective_timeout_s: float | None = None,
    stopped_grace_s: float | None = DEFAULT_STOPPED_GRACE_S,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` fresh processes, one per rank.

    Each process initialises ``torch.distributed`` (``backend``, TCP rendezvous on a free
    127.0.0.1 port, process-group timeout ``collective_timeout_s``) before calling ``fn`` and
    destroys the group afterwards. ``fn`` and ``args`` must be picklable by reference (a
    module-level function), as with any "spawn" start method; the caller's ``__main__`` must be
    guarded by ``if __name__ == "__main__"`` because the children re-import it.

    Args:
        fn: the per-rank function; its return value must be picklable.
        world_size: number of ranks (processes).
        args: extra positional arguments passed to ``fn`` after ``rank, world_size``.
        timeout_s: wall-clock limit for the whole launch, process start-up included.
        backend: ``torch.distributed`` backend ("gloo" on CPU).
        env: environment variables for the children. ``OMP_NUM_THREADS=1`` is set by default
            (a few ranks share few cores; oversubscribed OpenMP threads make everything slower)
            unless ``env`` gives another value.
        collective_timeout_s: how long one collective (and the rendezvous) may wait for a
            peer before it raises, in the world group and in every group the ranks create
            later. Default: ``$AUTOPAR_COLLECTIVE_TIMEOUT_S`` or
            ``DEFAULT_COLLECTIVE_TIMEOUT_S`` (90 s), and never more than ``timeout_s``.
        stopped_grace_s: how long a rank may stay stopped (SIGSTOP and the like) before the
            launch fails naming it; ``None`` disables the check (the peers' collective
            timeout still ends the launch).

    Returns:
        The ranks' return values, ordered by rank.

    Raises:
        RankFailedError: a rank raised (its traceback is in the message, the root cause in
            ``summary``), died without reporting (its exit code is in the message) or stayed
            stopped; the other ranks are terminated.
        TimeoutError: ``timeout_s`` passed; the message lists the unfinished ranks.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if collective_timeout_s is None:
        collective_timeout_s = default_collective_timeout_s()
    if collective_timeout_s <= 0:
        raise ValueError(f"collective_timeout_s must be > 0, got {collective_timeout_s}")
    collective_timeout_s = min(collective_timeout_s, timeout_s)
    child_env = {"OMP_NUM_THREADS": "1"}
    child_env.update({str(k): str(v) for k, v in (env or {}).items()})
    start = time.monotonic()
    options = (backend, child_env, collective_timeout_s, stopped_grace_s)
    try:
        return _launch_once(fn, world_size, tuple(args), timeout_s, *options)
    except _AddressInUse:
        # Someone took the probed port before rank 0's store bound it: one retry, new port,
        # within what is left of the caller's time budget.
        left = max(1.0, timeout_s - (time.monotonic() - start))
        try:
            return _launch_once(fn, world_size, tuple(args), left, *options)
        except _AddressInUse as e:
            raise RankFailedError(0, f"address already in use twice in a row:\n{e}") from None
