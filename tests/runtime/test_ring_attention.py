"""Ring attention (runtime/ring_attention.py) against one process's SDPA: forward output and
the gradients of q, k, v, on a ring simulated in one process and on real gloo ranks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from runtime import ring_attention as ra
from runtime.launch import spawn


def _reference(q, k, v, causal: bool, dout):
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def _inputs(seed: int, seq: int = 24):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, 3, seq, 8, generator=g) for _ in range(4)]  # q, k, v, dout


def _close(a, b) -> bool:
    return torch.allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("causal", [True, False])
def test_simulated_ring_matches_sdpa(n, causal):
    q, k, v, dout = _inputs(n + 10 * causal)
    want = _reference(q, k, v, causal, dout)
    qs, ks, vs, ds = (t.chunk(n, dim=2) for t in (q, k, v, dout))
    fwd = ra.simulate_ring_forward(qs, ks, vs, causal)
    out = torch.cat([o for o, _ in fwd], dim=2)
    assert _close(out, want[0])
    bwd = ra.simulate_ring_backward(ds, qs, ks, vs, [o for o, _ in fwd], [lse for _, lse in fwd], causal)
    for i, name in enumerate(("dq", "dk", "dv")):
        got = torch.cat([b[i] for b in bwd], dim=2)
        assert _close(got, want[1 + i]), name


def test_math_blocks_match_the_cpu_kernel():
    """The device-agnostic block attention (used off CPU) computes what the CPU flash kernel does."""
    q, k, v, dout = _inputs(3, seq=8)
    for causal in (True, False):
        out, lse = ra.block_attention(q, k, v, causal, None)
        s = ra._scores(q, k, causal, ra._scale(q, None))
        lse_m = torch.logsumexp(s, -1)
        out_m = torch.matmul(torch.exp(s - lse_m[..., None]), v)
        assert _close(out, out_m) and _close(lse, lse_m)
        flash = ra.block_attention_backward(dout, q, k, v, out, lse, causal, None)
        p = torch.exp(s - lse[..., None])
        dv = p.transpose(-1, -2) @ dout
        ds = p * (dout @ v.transpose(-1, -2) - (dout * out).sum(-1, keepdim=True)) * ra._scale(q, None)
        for got, want in zip(flash, (ds @ k, ds.transpose(-1, -2) @ q, dv)):
            assert _close(got, want)


def test_merge_is_the_softmax_over_both_blocks():
    q, k, v, _ = _inputs(5, seq=8)
    a = ra.block_attention(q, k[:, :, :4], v[:, :, :4], False, None)
    b = ra.block_attention(q, k[:, :, 4:], v[:, :, 4:], False, None)
    out, lse = ra.merge(*ra.merge(None, None, *a), *b)
    want_out, want_lse = ra.block_attention(q, k, v, False, None)
    assert _close(out, want_out) and _close(lse, want_lse)


def test_unequal_shapes_are_refused():
    q = torch.randn(1, 4, 8, 8)
    with pytest.raises(ValueError, match="repeat grouped"):
        ra.ring_attention_forward(q, q[:, :2], q[:, :2], True, None, None, 0, 2)


def _ring_worker(rank: int, world: int):
    import torch.distributed as dist

    group = dist.new_group(list(range(world)))
    failures = []
    for causal in (True, False):
        q, k, v, dout = _inputs(20 + causal, seq=6 * world)
        want = _reference(q, k, v, causal, dout)
        mine = [t.chunk(world, dim=2)[rank].contiguous() for t in (q, k, v, dout)]
        # through the registered op, as the context-parallel pass calls it
        out, lse = torch.ops.autopar.ring_attention(*mine[:3], causal, None, group.group_name, rank, world)
        grads = torch.ops.autopar.ring_attention_backward(mine[3], *mine[:3], out, lse, causal, None,
                                                          group.group_name, rank, world)
        for name, got, full in zip(("out", "dq", "dk", "dv"), (out, *grads), want):
            if not _close(got, full.chunk(world, dim=2)[rank]):
                failures.append((rank, causal, name, (got - full.chunk(world, dim=2)[rank]).abs().max().item()))
    failures += _grouped_query_ring(rank, world, group)
    return failures


def _grouped_query_ring(rank: int, world: int, group) -> list:
    """The op with ``kv_group`` 3 on K/V repeating one kv head: one device's output and kv-head
    gradients, and every K/V block sent holds one head, not three."""
    q, k, v, dout = _inputs(30, seq=6 * world)
    k, v = (t[:, :1].repeat_interleave(3, dim=1) for t in (k, v))
    want = _reference(q, k, v, True, dout)
    mine = [t.chunk(world, dim=2)[rank].contiguous() for t in (q, k, v, dout)]
    sent, start = [], ra._RingLink.start
    ra._RingLink.start = lambda self, t, tag=0: (sent.append((tag, t.shape[1])), start(self, t, tag))[1]
    try:
        out, lse = torch.ops.autopar.ring_attention(*mine[:3], True, None, group.group_name, rank, world,
                                                    None, False, 3)
        grads = torch.ops.autopar.ring_attention_backward(mine[3], *mine[:3], out, lse, True, None,
                                                          group.group_name, rank, world, None, False, 3)
    finally:
        ra._RingLink.start = start
    failures = [] if sent and all(heads == 1 for _, heads in sent) else [(rank, "sent heads", sent)]
    for name, got, full in zip(("out", "dq", "dk", "dv"), (out, *grads), want):
        full = full.chunk(world, dim=2)[rank]
        if name in ("dk", "dv"):
            got, full = ra._group_sum(got, 3), ra._group_sum(full, 3)
        if not _close(got, full):
            failures.append((rank, "grouped", name, (got - full).abs().max().item()))
    return failures


def test_ring_on_two_gloo_ranks():
    results = spawn(_ring_worker, 2, timeout_s=240)
    assert all(r == [] for r in results), results


@pytest.mark.slow
def test_ring_on_four_gloo_ranks():
    results = spawn(_ring_worker, 4, timeout_s=300)
    assert all(r == [] for r in results), results


def _padding_mask(seq: int, dtype):
    """Causal and a padded prefix of the second sequence, [2, 1, S, S]: bool or additive."""
    allowed = torch.ones(seq, seq, dtype=torch.bool).tril()[None, None].repeat(2, 1, 1, 1)
    allowed[1, :, :, : seq // 3] = False
    allowed[1, :, : seq // 3, 0] = True  # every query keeps a key (as HF's padding masks do)
    if dtype == torch.bool:
        return allowed
    return torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf"))


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("dtype", [torch.bool, torch.float32])
def test_simulated_ring_with_an_explicit_mask(n, dtype):
    q, k, v, dout = _inputs(7 + n)
    mask = _padding_mask(q.shape[2], dtype)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    want = F.scaled_dot_product_attention(*leaves, attn_mask=mask)
    want.backward(dout)
    qs, ks, vs, ds = (t.chunk(n, dim=2) for t in (q, k, v, dout))
    fwd = ra.simulate_ring_forward(qs, ks, vs, False, mask=mask)
    assert _close(torch.cat([o for o, _ in fwd], dim=2), want.detach())
    bwd = ra.simulate_ring_backward(ds, qs, ks, vs, [o for o, _ in fwd], [lse for _, lse in fwd], False, mask=mask)
    for i, leaf in enumerate(leaves):
        assert _close(torch.cat([b[i] for b in bwd], dim=2), leaf.grad)


@pytest.mark.parametrize("balanced", [False, True])
@pytest.mark.parametrize("causal", [True, False])
def test_grouped_query_ring_sends_kv_heads_and_matches_sdpa(causal, balanced):
    """Under ``kv_group`` g the ring carries the kv heads alone and repeats them on arrival:
    the output and the kv heads' gradients (the expansion's backward: a sum over each group's
    copies) equal one process's SDPA over the expanded K and V; the dK/dV it returns differ
    only in how each group's sum is spread over its copies."""
    g, n = 3, 2
    gen = torch.Generator().manual_seed(7 + causal + 2 * balanced)
    q, dout = (torch.randn(2, 6, 16, 8, generator=gen) for _ in range(2))
    kv_k, kv_v = (torch.randn(2, 2, 16, 8, generator=gen) for _ in range(2))
    k, v = (t.repeat_interleave(g, dim=1) for t in (kv_k, kv_v))
    want = _reference(q, k, v, causal, dout)

    def split(t):
        if not balanced:
            return t.chunk(n, dim=2)
        c = t.chunk(2 * n, dim=2)
        return [torch.cat([c[r], c[2 * n - 1 - r]], dim=2) for r in range(n)]

    def join(parts):
        if not balanced:
            return torch.cat(parts, dim=2)
        halves = [p.chunk(2, dim=2) for p in parts]
        return torch.cat([halves[r][0] for r in range(n)] + [halves[r][1] for r in reversed(range(n))], dim=2)

    qs, ks, vs, ds = (split(t.detach()) for t in (q, k, v, dout))
    fwd = ra.simulate_ring_forward(qs, ks, vs, causal, balanced=balanced, kv_group=g)
    assert _close(join([o for o, _ in fwd]), want[0])
    bwd = ra.simulate_ring_backward(ds, qs, ks, vs, [o for o, _ in fwd], [lse for _, lse in fwd], causal,
                                    balanced=balanced, kv_group=g)
    assert _close(join([b[0] for b in bwd]), want[1])
    for i in (1, 2):
        got = join([b[i] for b in bwd])
        assert got.shape == want[1 + i].shape
        assert _close(ra._group_sum(got, g), ra._group_sum(want[1 + i], g))
        assert not got.unflatten(1, (-1, g))[:, :, 1:].any()  # copies past the first carry nothing
    with pytest.raises(ValueError, match="kv_group 4 does not divide the 6 heads"):
        ra._check(qs[0], ks[0], vs[0], 4)
