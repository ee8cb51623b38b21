"""A pipeline's stages on ranks that time-share a host's cores
(`cost.terms.pipeline_parallel.shared_host_factor`): the schedule's slots one by one, the busy
ranks of each slot sharing the cores (processor sharing), each rank capped at its threads."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cost import Cluster, Layout
from cost.cluster import HostShare
from cost.terms.pipeline_parallel import shared_host_factor


def _host(ranks: int = 4, cores: int = 2, threads_per_rank: int = 1) -> Cluster:
    """A local cluster of ``ranks`` ranks on one host of ``cores`` cores."""
    cluster = Cluster("cpu", nodes=1, gpus_per_node=ranks)
    cluster.host_share = HostShare(cores=cores, threads=cores, threads_per_rank=threads_per_rank)
    return cluster


def _layout(pp: int, dp: int, m: int, **kw) -> Layout:
    return Layout(pp=pp, dp=dp, microbatch=1, grad_accum=m, precision="fp32", **kw)


def test_two_pipelines_side_by_side_fill_and_drain_together():
    """PP2 x DP2, 4 micro-batches, 4 ranks on 2 cores: in the fill (drain) slot only the two
    first-stage (last-stage) ranks compute, a core each, twice their all-busy speed; in the
    3 full slots all four share the cores, and where stage 0 is lighter its ranks finish first
    and lend their cores. Stages t0 <= t1: slots t0/2 + 3 (t0 + t1)/2 + t1/2 = 2 (t0 + t1),
    over 5 t1."""
    cluster = _host()
    lay = _layout(pp=2, dp=2, m=4)
    assert shared_host_factor(cluster, lay, [1.0, 1.0]) == pytest.approx(4 / 5)
    assert shared_host_factor(cluster, lay, [0.5, 1.0]) == pytest.approx(3 / 5)
    # the same whichever stage is the slowest
    assert shared_host_factor(cluster, lay, [1.0, 0.5]) == pytest.approx(3 / 5)


def test_a_lone_rank_uses_only_its_threads():
    """PP4, 8 micro-batches, one pipeline of 4 ranks on 2 cores, one thread per rank: the fill's
    first two slots run 1 and 2 ranks (a core each: half a slot), the third 3 ranks (2/3 of a
    core: 3/4 of a slot), the 5 full slots all four; the drain mirrors the fill:
    (0.5 + 0.5 + 0.75) 2 + 5 = 8.5 slots of 11. Two threads per rank let a lone rank use both
    cores: its slot takes a quarter."""
    lay = _layout(pp=4, dp=1, m=8)
    assert shared_host_factor(_host(), lay, [1.0] * 4) == pytest.approx(8.5 / 11)
    two_threads = shared_host_factor(_host(threads_per_rank=2), lay, [1.0] * 4)
    assert two_threads == pytest.approx((0.25 + 0.5 + 0.75) * 2 / 11 + 5 / 11)


def test_no_sharing_no_pipeline_no_factor():
    lay = _layout(pp=2, dp=2, m=4)
    devices = Cluster("cpu", nodes=1, gpus_per_node=4)
    assert devices.host_share is None and shared_host_factor(devices, lay, [1.0, 1.0]) == 1.0
    assert shared_host_factor(_host(), _layout(pp=1, dp=4, m=1), [1.0]) == 1.0
    # as many cores as ranks: nobody waits for a core, nobody gains one; the fill slot lasts
    # as long as the lighter first stage (the unbalanced pipeline's (m - 1) t* + sum t_i)
    assert shared_host_factor(_host(cores=4), lay, [1.0, 1.0]) == pytest.approx(1.0)
    assert shared_host_factor(_host(cores=4), lay, [0.5, 1.0]) == pytest.approx((0.5 + 4) / 5)


def test_interleaved_slots_are_chunks():
    """Interleaved 1F1B, v = 2: 2 m + p - 1 slots of half a stage each, a smaller bubble, so
    fewer slots where a lone stage runs fast: a larger factor than 1F1B's."""
    plain = shared_host_factor(_host(), _layout(pp=4, dp=1, m=8), [1.0] * 4)
    chunks = shared_host_factor(_host(), _layout(pp=4, dp=1, m=8, schedule="interleaved-1f1b",
                                                 virtual_stages=2), [1.0] * 4)
    # slots: fill 0.5, 0.5, 0.75; 13 full; drain 0.75, 0.5, 0.5: of 19
    assert chunks == pytest.approx((1.75 * 2 + 13) / 19) and chunks > plain


@settings(max_examples=60, derandomize=True, deadline=None)
@given(times=st.lists(st.floats(0.05, 2.0), min_size=2, max_size=4),
       m=st.integers(1, 9), dp=st.sampled_from([1, 2]), cores=st.sampled_from([1, 2, 3]),
       grow=st.floats(0.0, 0.5))
def test_factor_between_its_floor_and_one_and_monotone(times, m, dp, cores, grow):
    """The factor never exceeds 1 (sharing never slows a stage), never falls below the floor
    the search's lower bound uses, and never falls when a stage other than the slowest does
    more work (more ranks compete for the cores)."""
    pp = len(times)
    cluster = _host(ranks=pp * dp, cores=cores)
    lay = _layout(pp=pp, dp=dp, m=m)
    factor = shared_host_factor(cluster, lay, times)
    assert shared_host_factor(cluster, lay) <= factor * (1 + 1e-12) and factor <= 1 + 1e-12
    slowest = times.index(max(times))
    light = (slowest + 1) % pp
    heavier = list(times)
    heavier[light] = min(times[light] + grow, max(times))
    assert shared_host_factor(cluster, lay, heavier) >= factor * (1 - 1e-12)


def test_zero_bubble_keeps_all_its_work_on_the_cores():
    """Zero-bubble prices a third of 1F1B's bubble slots; the fill's and drain's spare cores
    cannot make its step shorter than its work on the host's cores: PP4, 8 micro-batches of 1
    (all-busy) second per stage, 4 ranks on 2 cores: 8 x 4 x 0.5 core-seconds / 2 cores."""
    from cost.terms.pipeline_parallel import pipeline_time

    lay = _layout(pp=4, dp=1, m=8, schedule="zero-bubble")
    factor = shared_host_factor(_host(), lay, [1.0] * 4)
    assert pipeline_time(factor, 0.0, lay)[0] == pytest.approx(8.0)
    assert shared_host_factor(_host(), lay) <= factor  # the search's floor still below
