"""Tests for runtime.launch (spawning gloo ranks safely) and runtime.mesh.

The per-rank functions live at module level so the "spawn" children can import them by name.
Every failure case checks that the launcher itself noticed the failure: it raises the failing
rank's `RankFailedError` (a launcher that missed it would end in the launch's `TimeoutError`
at `GUARD_S`, a guard against a hang, not a speed claim), and no rank is left running.
"""

from __future__ import annotations

import multiprocessing
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
    if rank == 1:  # far beyond the launch's limit; a launcher that ignores it returns results
        time.sleep(120)
    return rank


def _lingering_rank1(rank: int, world_size: int) -> None:
    if rank == 1:  # alive and out of step: its peer's collective times out first
        time.sleep(60)
    dist.barrier()


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
    out = spawn(_sum_ranks, 4, args=(10,), timeout_s=180)
    assert [o["rank"] for o in out] == [0, 1, 2, 3]
    assert all(o["world"] == 4 for o in out)
    assert all(o["sum"] == 60.0 for o in out)  # (0+1+2+3) * 10
    assert all(o["omp"] == "1" and o["threads"] == 1 for o in out)
    assert all(o["extra"] is None for o in out)


def test_single_rank_and_env_override() -> None:
    env = {"OMP_NUM_THREADS": "2", "AUTOPAR_TEST_VAR": "hello"}
    (out,) = spawn(_sum_ranks, 1, args=(1,), timeout_s=180, env=env)
    assert out["sum"] == 0.0
    assert out["omp"] == "2" and out["threads"] == 2
    assert out["extra"] == "hello"
    assert "AUTOPAR_TEST_VAR" not in os.environ  # the parent's environment is restored


# The launch's limit in the failure tests: a guard against a hang, not a speed claim. The
# peers' collective timeout is as long (spawn never lets it be longer) and starts later, when
# the ranks reach their first collective; so a launcher that missed a failure would end in
# the launch's TimeoutError, never in a RankFailedError.
GUARD_S = 120


def _launch_fails(fn, world: int, **kwargs) -> RankFailedError:
    """spawn ``fn`` on ``world`` ranks: the RankFailedError it raised, no rank left running."""
    kwargs = {"timeout_s": GUARD_S, "collective_timeout_s": GUARD_S, **kwargs}
    with pytest.raises(RankFailedError) as info:
        spawn(fn, world, **kwargs)
    assert multiprocessing.active_children() == []  # the peers were ended, not left waiting
    return info.value


def test_raising_rank_fails_with_its_traceback() -> None:
    # rank 0 waits in a barrier its peer never joins: only the failure report ends the launch
    err = _launch_fails(_raise_on_rank1, 2)
    assert err.rank == 1 and err.exitcode is None
    assert "ValueError: boom from rank one" in err.traceback_text
    assert "rank 1" in str(err) and "boom from rank one" in str(err)
    assert "_raise_on_rank1" in str(err)  # a real traceback, with the frame


def test_dead_rank_detected_by_exit_code() -> None:
    err = _launch_fails(_exit_on_rank1, 2)
    assert err.rank == 1 and err.exitcode == 3
    assert "rank 1" in str(err) and "exit code 3" in str(err)


def test_killed_rank_names_the_signal() -> None:
    err = _launch_fails(_killed_on_rank1, 2)
    assert err.rank == 1 and err.exitcode == -signal.SIGKILL
    assert "rank 1 died" in str(err) and "SIGKILL" in str(err)


def test_global_timeout_names_unfinished_ranks() -> None:
    # Rank 0 normally finishes well inside the limit; under heavy load it may not, so it may
    # be listed too, but rank 1 (asleep far beyond the limit) must be.
    with pytest.raises(TimeoutError, match=r"ranks not finished: \[(0, )?1\]"):
        spawn(_sleep_on_rank1, 2, timeout_s=5)
    assert multiprocessing.active_children() == []


def test_stopped_rank_is_named() -> None:
    # A SIGSTOP'd rank is alive and holds its sockets open: no sentinel, no peer error; only
    # the process-state watch (2 s grace here) can name it before the launch's limit.
    err = _launch_fails(_stopped_on_rank1, 3, stopped_grace_s=2)
    assert err.rank == 1
    assert "stopped" in str(err) and "SIGSTOP" in err.summary
    assert "fix:" in err.summary


def test_stopped_rank_without_the_watch_ends_at_the_collective_timeout() -> None:
    # With the process-state check off, the peers' bounded collective timeout (8 s, well inside
    # the launch's limit) ends the launch, and the stopped rank is still the one named.
    err = _launch_fails(_stopped_on_rank1, 2, collective_timeout_s=8, stopped_grace_s=None)
    assert err.rank == 1, err
    assert "stopped" in err.summary


def test_a_silent_live_peer_prints_where_it_is(capfd: pytest.CaptureFixture) -> None:
    # rank 0's barrier times out (5 s) while rank 1 is alive elsewhere: rank 1's stack shows
    # where, so a hang out of step names its place
    err = _launch_fails(_lingering_rank1, 2, collective_timeout_s=5)
    assert err.rank == 0 and "ranks [1] were alive" in str(err)
    assert "_lingering_rank1" in capfd.readouterr().err


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
    out = spawn(_group_timeouts, 2, timeout_s=180, collective_timeout_s=42)
    assert all(o["default"] == 42.0 and o["sub"] for o in out)


def test_summary_is_the_root_cause_without_the_traceback() -> None:
    with pytest.raises(RankFailedError) as info:
        spawn(_raise_on_rank1, 2, timeout_s=180)
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
        spawn(_unpicklable, 1, timeout_s=180)


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
        out = spawn(_sum_ranks, 1, args=(1,), timeout_s=180)
    finally:
        squatter.close()
    assert len(handed) == 2  # the first launch failed on the taken port and was retried
    assert out[0]["rank"] == 0


def test_bad_world_size() -> None:
    with pytest.raises(ValueError):
        spawn(_sum_ranks, 0)


def test_init_mesh_on_two_gloo_ranks() -> None:
    out = spawn(_build_meshes, 2, timeout_s=180)
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
