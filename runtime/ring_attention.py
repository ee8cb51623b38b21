"""Ring attention: scaled-dot-product attention over a sequence split across context-parallel ranks.

Rank r of n holds part of the sequence: its r-th contiguous block, or, load-balanced, chunks r
and 2n-1-r of 2n (`rank_chunks`; every rank then attends the same number of causal (query,
key) pairs): queries Q_r, keys K_r, values V_r, each [b, h, s/n, d], the chunks in position
order. Attention of Q_r over the whole sequence is a merge of per-block
attentions. For one block j, with S_rj = scale * Q_r K_j^T (masked above the diagonal when
causal),

    lse_rj = logsumexp_k S_rj[:, k]              O_rj = softmax(S_rj) V_j

and the blocks merge by the log-sum-exp rule (exact, in any order):

    lse_r = log sum_j exp(lse_rj)                O_r = sum_j exp(lse_rj - lse_r) O_rj

Forward: the K/V blocks travel round the ring (rank r sends to r+1, receives from r-1), so at
step t rank r holds block j = (r - t) mod n; the transfer of the next block is started before
the local block's attention and waited for after it (communication overlapped with compute).
Causal, per pair of chunks (query chunk i, key chunk j): j < i attended fully (one call over
every such key chunk of the step), j = i with the causal mask (equal chunk sizes: the diagonal
is aligned), j > i skipped (every key after every query). An explicit mask M (boolean, or
additive float; a value of the data only: every rank holds it whole, [.., S, S]) is sliced per
pair, M[.., rows of i, columns of j]; a pair it masks entirely is skipped, and a query row it
masks entirely within one call contributes nothing (O = 0, lse = -inf).

Backward, with the merged O_r and lse_r and the output gradient dO_r: per block,
P_rj = exp(S_rj - lse_r), D_r = rowsum(dO_r * O_r), dS_rj = P_rj * (dO_r V_j^T - D_r) and

    dQ_r += scale * dS_rj K_j      dK_j += scale * dS_rj^T Q_r      dV_j += P_rj^T dO_r

(the flash kernels' backward computes exactly these from O and lse). The K/V blocks travel
round the ring again, each with its dK/dV accumulator; after n steps the accumulator comes
home to the block's owner with every rank's contribution.

Grouped-query attention (``kv_group`` g > 1: K and V are the h_kv = h / g heads of the model
repeated, expanded[:, i] = kv[:, i // g], `passes.kv_expansion`): the blocks travel as their
h_kv heads, K_j[:, ::g], repeated on arrival, g times fewer bytes; the dK/dV accumulators travel
summed over each group's copies, and come home as the gradient of the expanded tensor with
each group's sum on its first copy, zeros on the others (the expansion's backward sums over
the copies: the K/V heads' gradient is exact).

The per-block attention is PyTorch's CPU flash kernel on CPU tensors, its CUDA
FlashAttention-2 kernels on half-precision CUDA tensors without a mask (`_fused`), and the same
formulas in plain matmuls elsewhere; communication is torch.distributed point-to-point (``isend`` /
``irecv``), which gloo and NCCL both run. `ring_attention_forward` / `_backward` are
registered as the custom ops ``autopar::ring_attention`` and ``autopar::ring_attention_backward``
(fake implementations for tracing), which the context-parallel pass puts in the rank's graph.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

__all__ = ["block_attention", "block_attention_backward", "measure_waits", "merge", "rank_chunks",
           "ring_attention_forward", "ring_attention_backward", "simulate_ring_forward", "simulate_ring_backward"]

aten = torch.ops.aten

FULL, CAUSAL, SKIP = "full", "causal", "skip"

_WAITS: list[float] | None = None  # seconds this process waited for ring transfers, while measured


@contextlib.contextmanager
def measure_waits() -> Iterator[list[float]]:
    """Collect the seconds each wait for a ring transfer took in this process (the exposed
    ring time: a transfer that finished behind the block's attention waits ~0)."""
    global _WAITS
    previous, _WAITS = _WAITS, []
    try:
        yield _WAITS
    finally:
        _WAITS = previous


def block_kind(rank: int, block: int, causal: bool) -> str:
    """How queries of sequence chunk ``rank`` attend keys of chunk ``block`` (chunk indices in
    position order)."""
    if not causal or block < rank:
        return FULL
    return CAUSAL if block == rank else SKIP


def rank_chunks(rank: int, size: int, balanced: bool) -> tuple[int, ...]:
    """The sequence chunks rank ``rank`` of ``size`` holds, in position order: its contiguous
    block (``size`` chunks), or, load-balanced, chunks ``rank`` and ``2 size - 1 - rank`` of
    ``2 size`` (every rank then attends the same number of causal (query, key) pairs)."""
    return (rank, 2 * size - 1 - rank) if balanced else (rank,)


def _groups(q_chunks, kv_chunks, causal: bool):
    """The attention calls of one ring step: [(query sub-blocks, key sub-blocks, causal)],
    sub-blocks as local indices into the rank's chunks (adjacent ones: a contiguous range).
    The rank's own K/V under a causal mask: one causal call (its chunks are in position order
    and of equal size, so the local diagonal is the global one); else per query chunk one
    call over the key chunks before it, query chunks attending the same keys merged."""
    if causal and q_chunks == kv_chunks:
        every = tuple(range(len(q_chunks)))
        return [(every, every, True)]
    calls = []
    for a, qc in enumerate(q_chunks):
        full = tuple(b for b, kc in enumerate(kv_chunks) if block_kind(qc, kc, causal) == FULL)
        if not full:
            continue
        if calls and calls[-1][1] == full and calls[-1][0][-1] == a - 1:
            calls[-1] = (calls[-1][0] + (a,), full, False)
        else:
            calls.append(((a,), full, False))
    return calls


def _scale(q: torch.Tensor, scale: float | None) -> float:
    return 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale


def block_attention(q, k, v, causal: bool, scale: float | None,
                    mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(O, lse) of ``q`` over one block ``k``, ``v`` (``mask``: that block's): O [b, h, sq, d]
    in q's dtype, lse [b, h, sq] in fp32; a row masked entirely has O = 0, lse = -inf."""
    if q.device.type == "cpu":
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal,
                                                                    attn_mask=_additive(mask, q.dtype),
                                                                    scale=scale)[:2]
    elif _fused(q, mask):
        out, lse = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)[:2]
    else:
        s = _scores(q, k, causal, _scale(q, scale), mask)
        lse = torch.logsumexp(s, dim=-1)
        out = torch.matmul(torch.exp(s - lse[..., None]), v.float()).to(q.dtype)
    if mask is not None:  # rows with no key in this block: nothing to merge (the kernel says lse 0)
        allowed = mask if mask.dtype == torch.bool else ~torch.isneginf(mask)
        dead = (~allowed.any(-1)).expand(lse.shape)
        lse = torch.where(dead, torch.full((), float("-inf"), dtype=lse.dtype), lse)
        out = torch.where(dead[..., None], torch.zeros((), dtype=out.dtype), out)
    return out, lse


def _additive(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """A boolean mask as the additive one the CPU kernel takes (0 kept, -inf masked)."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    return torch.zeros(mask.shape, dtype=dtype).masked_fill(~mask, float("-inf"))


def block_attention_backward(dout, q, k, v, out, lse, causal: bool, scale: float | None,
                             mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dQ, dK, dV) of one block's share, given the *merged* O and lse of q's rows. A row
    masked in every block (merged lse = -inf, O = 0) has P = 0: its lse is taken as +inf, so
    exp(S - lse) = 0 for every S (as one device, whose such rows give O = 0, zero gradients)."""
    lse = torch.where(torch.isneginf(lse), float("inf"), lse)
    if q.device.type == "cpu":
        dq, dk, dv = aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal, attn_mask=_additive(mask, q.dtype), scale=scale)
        return dq, dk, dv
    if _fused(q, mask):  # dense inputs: no sequence offsets; no dropout: the RNG state unused
        seed = torch.zeros(2, dtype=torch.uint64, device=q.device)
        offset = torch.zeros((), dtype=torch.uint64, device=q.device)
        return aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out.to(q.dtype), lse.contiguous(), None, None, q.shape[2], k.shape[2], 0.0, causal,
            seed, offset, scale=scale)[:3]
    sc = _scale(q, scale)
    p = torch.exp(_scores(q, k, causal, sc, mask) - lse[..., None])
    do, vf = dout.float(), v.float()
    dv = torch.matmul(p.transpose(-1, -2), do)
    dp = torch.matmul(do, vf.transpose(-1, -2))
    d = (do * out.float()).sum(-1, keepdim=True)
    ds = p * (dp - d) * sc
    dq = torch.matmul(ds, k.float())
    dk = torch.matmul(ds.transpose(-1, -2), q.float())
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _fused(q: torch.Tensor, mask: torch.Tensor | None) -> bool:
    """A block runs FlashAttention-2's CUDA kernels (PyTorch's flash backend; what the cost
    model prices): half-precision CUDA tensors, head dim a multiple of 8 up to 256, no mask;
    others the plain matmuls of `_scores`."""
    return (q.is_cuda and mask is None and q.dtype in (torch.float16, torch.bfloat16)
            and q.shape[-1] % 8 == 0 and q.shape[-1] <= 256)


def _scores(q, k, causal: bool, scale: float, mask: torch.Tensor | None = None) -> torch.Tensor:
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask.float()
    if causal:
        sq, sk = s.shape[-2:]
        s = s.masked_fill(torch.ones(sq, sk, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return s


def merge(out, lse, block_out, block_lse) -> tuple[torch.Tensor, torch.Tensor]:
    """The log-sum-exp merge of a running (O, lse) (None: nothing yet) with one block's, in fp32."""
    if out is None:
        return block_out.float(), block_lse
    new = torch.logaddexp(lse, block_lse)
    # a row masked in both (new = -inf) keeps O = 0: exp(-inf - -inf) would be NaN
    dead = torch.isneginf(new)
    w_old = torch.where(dead, 0.0, torch.exp(lse - new))
    w_new = torch.where(dead, 0.0, torch.exp(block_lse - new))
    out = out * w_old[..., None] + block_out.float() * w_new[..., None]
    return out, new


def block_mask(mask: torch.Tensor | None, q_chunks: tuple[int, ...], kv_chunks: tuple[int, ...],
               chunks: int) -> torch.Tensor | None:
    """The whole mask's [.., rows of ``q_chunks``, columns of ``kv_chunks``] (the sequence in
    ``chunks`` equal chunks); None where no mask is given; ``SKIP`` where it masks every
    entry."""
    if mask is None:
        return None
    seq = mask.shape[-1]
    mask = torch.broadcast_to(mask, (*mask.shape[:-2], seq, seq))  # a key-padding row [.., 1, S]
    c = seq // chunks
    rows = torch.cat([mask[..., q * c:(q + 1) * c, :] for q in q_chunks], dim=-2)
    part = torch.cat([rows[..., k * c:(k + 1) * c] for k in kv_chunks], dim=-1)
    allowed = part if part.dtype == torch.bool else ~torch.isneginf(part)
    return part.contiguous() if bool(allowed.any()) else SKIP


def _range(blocks: tuple[int, ...], count: int, length: int) -> slice:
    """The local positions of adjacent sub-blocks ``blocks`` of ``count`` in ``length``."""
    width = length // count
    assert list(blocks) == list(range(blocks[0], blocks[-1] + 1)), blocks
    return slice(blocks[0] * width, (blocks[-1] + 1) * width)


class _Ring:
    """One rank's view of the ring: its chunks and the chunks each ring step brings."""

    def __init__(self, rank: int, size: int, causal: bool, balanced: bool, mask) -> None:
        self.rank, self.size, self.causal, self.mask = rank, size, causal, mask
        self.balanced = balanced
        self.per_rank = 2 if balanced else 1
        self.chunks = size * self.per_rank
        self.q_chunks = rank_chunks(rank, size, balanced)

    def calls(self, source: int, length: int):
        """[(query positions, key positions, causal, mask part)] against rank ``source``'s K/V
        (positions: slices of the rank's ``length`` local ones)."""
        kv_chunks = rank_chunks(source, self.size, self.balanced)
        out = []
        for qs, bs, causal in _groups(self.q_chunks, kv_chunks, self.causal):
            part = block_mask(self.mask, tuple(self.q_chunks[a] for a in qs), tuple(kv_chunks[b] for b in bs),
                              self.chunks)
            if not isinstance(part, str):
                out.append((_range(qs, self.per_rank, length), _range(bs, self.per_rank, length), causal, part))
        return out


def _empty_state(q):
    """(O, lse) before any block: 0 and -inf (a merge with it returns the block's own)."""
    return (torch.zeros(q.shape, dtype=torch.float32, device=q.device),
            torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device))


def _forward_step(state, q, kv, ring: _Ring, source: int, scale, group: int = 1):
    """The running (O, lse) of this rank's queries, merged with rank ``source``'s K/V (their
    kv heads under ``group`` > 1)."""
    k, v = (_repeat(t, group) for t in kv.chunk(2, dim=0))
    out, lse = state
    for rows, cols, causal, part in ring.calls(source, q.shape[2]):
        block = block_attention(q[:, :, rows], k[:, :, cols], v[:, :, cols], causal, scale, part)
        out[:, :, rows], lse[:, :, rows] = merge(out[:, :, rows], lse[:, :, rows], *block)
    return out, lse


def _backward_step(dq, dkv, dout, q, kv, out, lse, ring: _Ring, source: int, scale, group: int = 1):
    """dQ and the travelling (dK, dV) accumulator (of the kv heads under ``group`` > 1), added
    in place."""
    k, v = (_repeat(t, group) for t in kv.chunk(2, dim=0))
    b = k.shape[0]
    for rows, cols, causal, part in ring.calls(source, q.shape[2]):
        bq, bk, bv = block_attention_backward(dout[:, :, rows], q[:, :, rows], k[:, :, cols], v[:, :, cols],
                                              out[:, :, rows], lse[:, :, rows], causal, scale, part)
        dq[:, :, rows] += bq.float()
        dkv[:b, :, cols] += _group_sum(bk.float(), group)
        dkv[b:, :, cols] += _group_sum(bv.float(), group)
    return dq, dkv


def _check(q, k, v, group: int = 1) -> None:
    if q.shape != k.shape or k.shape != v.shape:
        raise ValueError(f"ring attention needs q, k, v of one shape [b, h, s, d] (repeat grouped "
                         f"K/V heads first); got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if group < 1 or q.shape[1] % group:
        raise ValueError(f"ring attention: kv_group {group} does not divide the {q.shape[1]} heads")


def _heads(t: torch.Tensor, group: int) -> torch.Tensor:
    """The kv heads of an expanded K or V: the first copy of each group."""
    return t if group == 1 else t[:, ::group]


def _repeat(t: torch.Tensor, group: int) -> torch.Tensor:
    """The expansion, as the model made it: each kv head ``group`` times, adjacent."""
    return t if group == 1 else t.repeat_interleave(group, dim=1)


def _group_sum(grad: torch.Tensor, group: int) -> torch.Tensor:
    """A gradient of the expanded heads summed over each group's copies."""
    return grad if group == 1 else grad.unflatten(1, (-1, group)).sum(2)


def _spread(grad: torch.Tensor, group: int) -> torch.Tensor:
    """A gradient of the expanded tensor whose group sums are ``grad``: each sum on the group's
    first copy, zeros on the others."""
    if group == 1:
        return grad
    out = grad.new_zeros((grad.shape[0], grad.shape[1] * group, *grad.shape[2:]))
    out[:, ::group] = grad
    return out


class _RingLink:
    """Sends to the next rank of the ring and receives from the previous one, asynchronously."""

    def __init__(self, group, rank: int, size: int) -> None:
        self.group, self.next, self.prev = group, (rank + 1) % size, (rank - 1) % size

    def start(self, tensor: torch.Tensor, tag: int = 0) -> tuple[torch.Tensor, Callable[[], None]]:
        """Start passing ``tensor`` on; (the buffer the previous rank's tensor arrives in, wait).
        ``tag`` tells apart two transfers in flight at once (K/V and their gradients)."""
        buf = torch.empty_like(tensor)
        ops = [dist.P2POp(dist.isend, tensor.contiguous(), group=self.group, tag=tag, group_peer=self.next),
               dist.P2POp(dist.irecv, buf, group=self.group, tag=tag, group_peer=self.prev)]
        works = dist.batch_isend_irecv(ops)

        def wait() -> None:
            t0 = time.perf_counter()
            for w in works:
                w.wait()
            if _WAITS is not None:
                _WAITS.append(time.perf_counter() - t0)

        return buf, wait


def ring_attention_forward(q, k, v, causal: bool, scale: float | None, group, rank: int,
                           size: int, mask: torch.Tensor | None = None,
                           balanced: bool = False, kv_group: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's (O, lse) of attention over the sequence split over the ``size`` ranks of
    ``group`` (chunks as `rank_chunks` deals them); ``mask``: the whole [.., S, S] mask;
    ``kv_group``: K and V repeat each kv head that many times (their kv heads travel)."""
    _check(q, k, v, kv_group)
    link = _RingLink(group, rank, size)
    ring = _Ring(rank, size, causal, balanced, mask)
    kv = torch.cat([_heads(k, kv_group), _heads(v, kv_group)])
    out, lse = _empty_state(q)
    for t in range(size):
        wait = None
        if t < size - 1:  # the next block travels while this one is attended
            incoming, wait = link.start(kv)
        out, lse = _forward_step((out, lse), q, kv, ring, (rank - t) % size, scale, kv_group)
        if wait is not None:
            wait()
            kv = incoming
    return out.to(q.dtype), lse


def ring_attention_backward(dout, q, k, v, out, lse, causal: bool, scale: float | None, group,
                            rank: int, size: int, mask: torch.Tensor | None = None,
                            balanced: bool = False,
                            kv_group: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This rank's (dQ, dK, dV); ``out`` and ``lse`` are the merged forward's (dK, dV of the
    expanded K and V under ``kv_group`` > 1: `_spread`)."""
    _check(q, k, v, kv_group)
    link = _RingLink(group, rank, size)
    ring = _Ring(rank, size, causal, balanced, mask)
    kv = torch.cat([_heads(k, kv_group), _heads(v, kv_group)])
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dkv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)
    for t in range(size):
        wait = None
        if t < size - 1:
            incoming, wait = link.start(kv)
        dq, dkv = _backward_step(dq, dkv, dout, q, kv, out, lse, ring, (rank - t) % size, scale, kv_group)
        # the accumulator follows its block: after the last step it reaches the block's owner
        dkv, wait_grad = link.start(dkv, tag=1)
        wait_grad()
        if wait is not None:
            wait()
            kv = incoming
    dk, dv = (_spread(g, kv_group) for g in dkv.chunk(2, dim=0))
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def simulate_ring_forward(qs, ks, vs, causal: bool, scale: float | None = None, mask=None,
                          balanced: bool = False, kv_group: int = 1):
    """`ring_attention_forward` of every rank, run in one process in lock step (the ring's
    transfers are list rotations): [(O_r, lse_r)] for the blocks ``qs[r], ks[r], vs[r]``."""
    n = len(qs)
    rings = [_Ring(r, n, causal, balanced, mask) for r in range(n)]
    kvs = [torch.cat([_heads(k, kv_group), _heads(v, kv_group)]) for k, v in zip(ks, vs)]
    states = [_empty_state(q) for q in qs]
    for t in range(n):
        states = [_forward_step(states[r], qs[r], kvs[r], rings[r], (r - t) % n, scale, kv_group)
                  for r in range(n)]
        kvs = [kvs[(r - 1) % n] for r in range(n)]
    return [(o.to(q.dtype), lse) for (o, lse), q in zip(states, qs)]


def simulate_ring_backward(douts, qs, ks, vs, outs, lses, causal: bool, scale: float | None = None,
                           mask=None, balanced: bool = False, kv_group: int = 1):
    """`ring_attention_backward` of every rank in one process: [(dQ_r, dK_r, dV_r)]."""
    n = len(qs)
    rings = [_Ring(r, n, causal, balanced, mask) for r in range(n)]
    kvs = [torch.cat([_heads(k, kv_group), _heads(v, kv_group)]) for k, v in zip(ks, vs)]
    dqs = [torch.zeros(q.shape, device=q.device) for q in qs]
    dkvs = [torch.zeros(kv.shape, device=kv.device) for kv in kvs]
    for t in range(n):
        for r in range(n):
            dqs[r], dkvs[r] = _backward_step(dqs[r], dkvs[r], douts[r], qs[r], kvs[r], outs[r], lses[r],
                                             rings[r], (r - t) % n, scale, kv_group)
        kvs = [kvs[(r - 1) % n] for r in range(n)]
        dkvs = [dkvs[(r - 1) % n] for r in range(n)]
    return [(dq.to(q.dtype), *(_spread(g, kv_group).to(q.dtype) for g in dkv.chunk(2, dim=0)))
            for dq, dkv, q in zip(dqs, dkvs, qs)]


# --- the ops the context-parallel pass puts in a rank's graph --------------------------------

def _group(name: str):
    from torch.distributed.distributed_c10d import _resolve_process_group
    return _resolve_process_group(name)


@torch.library.custom_op("autopar::ring_attention", mutates_args=())
def ring_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool, scale: float | None,
                      group_name: str, rank: int, size: int,
                      mask: torch.Tensor | None = None, balanced: bool = False,
                      kv_group: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """`ring_attention_forward` over the process group named ``group_name``."""
    out, lse = ring_attention_forward(q, k, v, is_causal, scale, _group(group_name), rank, size, mask, balanced,
                                      kv_group)
    return out.contiguous(), lse.contiguous()


@ring_attention_op.register_fake
def _(q, k, v, is_causal, scale, group_name, rank, size, mask=None, balanced=False, kv_group=1):
    # contiguous, as the real op returns (empty_like would copy q's strides)
    return q.new_empty(q.shape), q.new_empty(q.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("autopar::ring_attention_backward", mutates_args=())
def ring_attention_backward_op(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               out: torch.Tensor, lse: torch.Tensor, is_causal: bool, scale: float | None,
                               group_name: str, rank: int, size: int,
                               mask: torch.Tensor | None = None, balanced: bool = False,
                               kv_group: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`ring_attention_backward` over the process group named ``group_name``."""
    dq, dk, dv = ring_attention_backward(dout, q, k, v, out, lse, is_causal, scale, _group(group_name),
                                         rank, size, mask, balanced, kv_group)
    return dq.contiguous(), dk.clone(), dv.clone()  # dk, dv: views of one buffer


@ring_attention_backward_op.register_fake
def _(dout, q, k, v, out, lse, is_causal, scale, group_name, rank, size, mask=None, balanced=False, kv_group=1):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)
