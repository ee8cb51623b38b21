"""torch.profiler sessions that keep torch's own start/stop lines off the console."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator

from torch.profiler import ProfilerActivity, profile


@contextlib.contextmanager
def stderr_silenced() -> Iterator[None]:
    """The process's stderr (file descriptor 2, where C++ prints) sent to /dev/null."""
    sys.stderr.flush()
    saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)


@contextlib.contextmanager
def quiet_profile() -> Iterator[profile]:
    """A CPU `torch.profiler.profile` whose start and stop run with stderr silenced: torch 2.13
    prints a line at each (`SyncActivityProfilerHandler`), two per profiled step; the profiled
    code itself keeps its stderr."""
    prof = profile(activities=[ProfilerActivity.CPU])
    with stderr_silenced():
        prof.start()
    try:
        yield prof
    finally:
        with stderr_silenced():
            prof.stop()
