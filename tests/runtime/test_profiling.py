"""`runtime.profiling.quiet_profile`: torch.profiler's own start/stop lines stay off stderr,
the profiled code keeps its stderr, and the events are recorded."""

from __future__ import annotations

import os

import torch

from runtime.profiling import quiet_profile


def test_quiet_profile_keeps_torch_lines_off_stderr_only(capfd):
    with quiet_profile() as prof:
        torch.ones(8).sum()
        os.write(2, b"the profiled code's own line\n")
    err = capfd.readouterr().err
    assert "profiler_start" not in err and "profiler_stop" not in err
    assert "the profiled code's own line" in err
    assert any(e.key == "aten::sum" for e in prof.key_averages())
