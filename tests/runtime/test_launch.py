"""Tests for runtime.launch (spawning gloo ranks safely) and runtime.mesh.

The per-rank functions live at module level so the "spawn" children can import them by name.
Every failure case also checks the wall time: the launcher must fail fast, never hang.
"""

from __future__ import annotations

import os
import signal
import socket
import time

import pytest
import torch
import torch.distributed as dist

from runtime import launch
from runtime.launch import RankFailedError, free_port, spawn
from runtime.mesh import fake_world, init_mesh

# --- per-rank functions (run in the children) ---------------------------------------------


def _sum_ranks(rank: int, world_size: int, scale: int) -> dict:
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return {
        "rank": rank,
        "world": dist.get_world_size(),
        "sum": t.item() * scale,
        "omp": os.environ.get("OMP_NUM_THREADS"),
        "threads": torch.get_num_threads(),
        "extra": os.environ.get("AUTOPAR_TEST_VAR"),
    }


def _raise_on_rank1(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("boom from rank one")
    # Rank 0 blocks in a collective its dead peer will never join: only the launcher's
    # kill-on-failure keeps this from waiting for the process-group timeout.
    dist.barrier()


def _exit_on_rank1(rank: int, world_size: int) -> None:
    if rank == 1:
        os._exit(3)
    dist.barrier()


def _sleep_on_rank1(rank: int, world_size: int) -> int:
    if rank == 1:
        time.sleep(600)
    return rank


def _killed_on_rank1(rank: int, world_size: int) -> None:
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()


def _stopped_on_rank1(rank: int, world_size: int) -> None:
    if rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)
    dist.barrier()


def _group_timeouts(rank: int, world_size: int) -> dict:
    from torch.distributed import distributed_c10d

    sub = dist.new_group([0, 1])
    return {
        "default": distributed_c10d.default_pg_timeout.total_seconds(),
        "sub": sub is not None,
    }


def _unpicklable(rank: int, world_size: int) -> object:
    return lambda: rank


def _build_meshes(rank: int, world_size: int) -> dict:
    mesh = init_mesh((2,), ("dp",))
    try:
        init_mesh((2, 2), ("dp", "tp"))
        bad = ""
    except ValueError as e:
        bad = str(e)
    return {
        "shape": tuple(mesh.shape),
        "names": mesh.mesh_dim_names,
        "local": mesh.get_local_rank("dp"),
        "bad": bad,
    }


# --- tests ---------------------------------------------------------------------------------


def test_free_port() -> None:
    port = free_port()
    assert 0 < port < 65536
    with socket.socket() as s:  # it was free a moment ago, so we can bind it now
        s.bind(("127.0.0.1", port))


def test_results_in_rank_order_four_ranks() -> None:
    out = spawn(_sum_ranks, 4, args=(10,), timeout_s=60)
    assert [o["rank"] for o in out] == [0, 1, 2, 3]
    assert all(o["world"] == 4 for o in out)
    assert all(o["sum"] == 60.0 for o in out)  # (0+1+2+3) * 10
    assert all(o["omp"] == "1" and o["threads"] == 1 for o in out)
    assert all(o["extra"] is None for o in out)


def test_single_rank_and_env_override() -> None:
    env = {"OMP_NUM_THREADS": "2", "AUTOPAR_TEST_VAR": "hello"}
    (out,) = spawn(_sum_ranks, 1, args=(1,), timeout_s=60, env=env)
    assert out["sum"] == 0.0
    assert out["omp"] == "2" and out["threads"] == 2
    assert out["extra"] == "hello"
    assert "AUTOPAR_TEST_VAR" not in os.environ  # the parent's environment is restored


def test_raising_rank_fails_fast_with_traceback() -> None:
    t0 = time.monotonic()
    with pytest.raises(RankFailedError) as info:
        spawn(_raise_on_rank1, 2, timeout_s=60)
    elapsed = time.monotonic() - t0
    err = info.value
    assert err.rank == 1 and err.exitcode is None
    assert "ValueError: boom from rank one" in err.traceback_text
    assert "rank 1" in str(err) and "boom from rank one" in str(err)
    assert "_raise_on_rank1" in str(err)  # a real traceback, with the frame
    assert elapsed < 20, elapsed


def test_dead_rank_detected_by_exit_code() -> None:
    t0 = time.monotonic()
    with pytest.raises(RankFailedError) as info:
        spawn(_exit_on_rank1, 2, timeout_s=60)
    elapsed = time.monotonic() - t0
    assert info.value.rank == 1 and info.value.exitcode == 3
    assert "rank 1" in str(info.value) and "exit code 3" in str(info.value)
    assert elapsed < 20, elapsed  # startup (~2 s) + detection, far below the timeout


def test_killed_rank_names_the_signal() -> None:
    t0 = time.monotonic()
    with pytest.raises(RankFailedError, match="rank 1 died.*SIGKILL"):
        spawn(_killed_on_rank1, 2, timeout_s=60)
    assert time.monotonic() - t0 < 20


def test_global_timeout_names_unfinished_ranks() -> None:
    t0 = time.monotonic()
    # Rank 0 normally finishes well inside the limit; under heavy load it may not, so it may
    # be listed too, but rank 1 (asleep) must be.
    with pytest.raises(TimeoutError, match=r"ranks not finished: \[(0, )?1\]"):
        spawn(_sleep_on_rank1, 2, timeout_s=5)
    assert time.monotonic() - t0 < 10


def test_stopped_rank_is_named_within_seconds() -> None:
    # A SIGSTOP'd rank is alive and holds its sockets open: no sentinel, no peer error.
    t0 = time.monotonic()
    with pytest.raises(RankFailedError) as info:
        spawn(_stopped_on_rank1, 3, timeout_s=60, stopped_grace_s=2)
    elapsed = time.monotonic() - t0
    assert info.value.rank == 1
    assert "stopped" in str(info.value) and "SIGSTOP" in info.value.summary
    assert "fix:" in info.value.summary
    assert elapsed < 20, elapsed


def test_stopped_rank_without_the_watch_ends_at_the_collective_timeout() -> None:
    # With the process-state check off, the peers' bounded collective timeout ends the launch,
    # and the stopped rank is still the one named.
    t0 = time.monotonic()
    with pytest.raises(RankFailedError) as info:
        spawn(_stopped_on_rank1, 2, timeout_s=90, collective_timeout_s=8, stopped_grace_s=None)
    elapsed = time.monotonic() - t0
    assert info.value.rank == 1, info.value
    assert "stopped" in info.value.summary
    assert elapsed < 45, elapsed  # start-up + 8 s + teardown; far below the 90 s launch limit


def test_default_timeouts_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    assert launch.DEFAULT_COLLECTIVE_TIMEOUT_S <= 100
    assert launch.DEFAULT_STOPPED_GRACE_S < 120
    monkeypatch.delenv("AUTOPAR_COLLECTIVE_TIMEOUT_S", raising=False)
    assert launch.default_collective_timeout_s() == launch.DEFAULT_COLLECTIVE_TIMEOUT_S
    monkeypatch.setenv("AUTOPAR_COLLECTIVE_TIMEOUT_S", "30")
    assert launch.default_collective_timeout_s() == 30.0
    monkeypatch.setenv("AUTOPAR_COLLECTIVE_TIMEOUT_S", "soon")
    with pytest.raises(ValueError, match="fix: set it to"):
        launch.default_collective_timeout_s()


def test_groups_created_later_get_the_bounded_timeout() -> None:
    out = spawn(_group_timeouts, 2, timeout_s=60, collective_timeout_s=42)
    assert all(o["default"] == 42.0 and o["sub"] for o in out)


def test_summary_is_the_root_cause_without_the_traceback() -> None:
    with pytest.raises(RankFailedError) as info:
        spawn(_raise_on_rank1, 2, timeout_s=60)
    assert info.value.summary == "ValueError: boom from rank one"
    text = (
        "Traceback (most recent call last):\n  File \"x.py\", line 1, in f\n    g()\n"
        "    ^^^\nKeyError: 'a'\nsecond line\n"
    )
    assert launch.last_exception(text) == "KeyError: 'a'\nsecond line"
    assert launch.last_exception("exited (exit code 3)") == "exited (exit code 3)"
    err = RankFailedError(2, text)
    assert err.summary == "KeyError: 'a'\nsecond line"
    import pickle

    assert pickle.loads(pickle.dumps(err)).summary == err.summary


def test_unpicklable_result_is_a_rank_failure() -> None:
    with pytest.raises(RankFailedError, match="pickle"):
        spawn(_unpicklable, 1, timeout_s=60)


def test_address_in_use_is_retried(monkeypatch: pytest.MonkeyPatch) -> None:
    # Hand the first launch a port someone is listening on; the second gets a free one.
    squatter = socket.socket()
    squatter.bind(("127.0.0.1", 0))
    squatter.listen()
    ports = [squatter.getsockname()[1]]
    handed: list[int] = []
    real = launch.free_port

    def fake_free_port() -> int:
        handed.append(ports.pop() if ports else real())
        return handed[-1]

    monkeypatch.setattr(launch, "free_port", fake_free_port)
    try:
        out = spawn(_sum_ranks, 1, args=(1,), timeout_s=60)
    finally:
        squatter.close()
    assert len(handed) == 2  # the first launch failed on the taken port and was retried
    assert out[0]["rank"] == 0


def test_bad_world_size() -> None:
    with pytest.raises(ValueError):
        spawn(_sum_ranks, 0)


def test_init_mesh_on_two_gloo_ranks() -> None:
    out = spawn(_build_meshes, 2, timeout_s=60)
    assert [o["local"] for o in out] == [0, 1]
    for o in out:
        assert o["shape"] == (2,) and o["names"] == ("dp",)
        assert o["bad"].startswith("mesh (2, 2) has 4 ranks but the process group has 2:")


def test_fake_world_builds_8x8_mesh() -> None:
    assert not dist.is_initialized()
    with fake_world(64) as n:
        assert n == 64 and dist.get_world_size() == 64
        mesh = init_mesh((8, 8), ("dp", "tp"))
        assert tuple(mesh.shape) == (8, 8)
        assert mesh.mesh_dim_names == ("dp", "tp")
        assert mesh["tp"].size() == 8
        with pytest.raises(ValueError, match="has 16 ranks but the process group has 64"):
            init_mesh((4, 4), ("a", "b"))
        with pytest.raises(RuntimeError, match="already initialised"):
            with fake_world(4):
                pass
    assert not dist.is_initialized()


def test_init_mesh_without_group() -> None:
    with pytest.raises(RuntimeError, match="no process group"):
        init_mesh((2,), ("dp",))
