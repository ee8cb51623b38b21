"""Grouped-query attention's K/V expansion, recognised in a captured graph.

With h query heads and h_kv < h key/value heads, a model repeats each K/V head g = h / h_kv
times before the attention (transformers' and the zoo's ``repeat_kv``):

    expanded[b, i, s, :] = kv[b, i // g, s, :]        i < h_kv * g

which aten records as ``unsqueeze(kv, 2) -> expand([b, h_kv, g, s, d]) -> clone ->
view / _unsafe_view([b, h_kv * g, s, d])`` (full-range slices from ``t[:, :, None]`` in
between). Knowing it, ring attention sends each block's h_kv heads, not its h, and repeats
them on arrival (`runtime.ring_attention`, ``kv_group``), as Transformer Engine's does; the
cost model prices the ring with the same bytes (`autopar.search.facts`). Any other chain (a
tiled ``repeat``, a gather) is not recognised: the ring then sends the expanded heads, which is
correct, only g times the bytes.
"""

from __future__ import annotations

import torch
from torch import fx

aten = torch.ops.aten

# ops that turn the expanded [b, h_kv, g, s, d] into [b, h_kv * g, s, d] without moving values
# between heads: a contiguous copy and a view merging dims 1 and 2
_FLATTEN = (aten.clone.default, aten.view.default, aten._unsafe_view.default, aten.reshape.default,
            aten.contiguous.default)
_FULL_END = 2**62  # `x[a:]` records end = sys.maxsize


def kv_expansion(node: fx.Node) -> tuple[fx.Node, int] | None:
    """(the K/V heads' tensor, the group g) when ``node`` repeats each head of it g > 1 times
    in adjacent heads (``expanded[:, i] = kv[:, i // g]``); None otherwise."""
    x = node
    while _is_call(x) and x.target in _FLATTEN:
        x = x.args[0]
    if not (_is_call(x) and x.target == aten.expand.default):
        return None
    sizes = list(x.args[1])
    inner = _skip_full_slices(x.args[0])
    if not (_is_call(inner) and inner.target == aten.unsqueeze.default and inner.args[1] in (2, -3)):
        return None
    source = _skip_full_slices(inner.args[0])
    src, out = _shape(source), _shape(node)
    if src is None or out is None or len(src) != 4 or len(out) != 4 or len(sizes) != 5:
        return None
    group = sizes[2]
    if not isinstance(group, int) or group <= 1:
        return None
    expected = [src[0], src[1], group, src[2], src[3]]
    if any(s not in (-1, e) for s, e in zip(sizes, expected)):
        return None
    if list(out) != [src[0], src[1] * group, src[2], src[3]]:
        return None
    return source, group


def kv_group(k: fx.Node, v: fx.Node) -> tuple[fx.Node, fx.Node, int] | None:
    """(K's kv heads, V's kv heads, g) when both are expansions of one group g (what ring
    attention sends as kv heads); None otherwise."""
    found = [kv_expansion(a) for a in (k, v)]
    if None in found or found[0][1] != found[1][1]:
        return None
    return found[0][0], found[1][0], found[0][1]


def _is_call(x) -> bool:
    return isinstance(x, fx.Node) and x.op == "call_function"


def _shape(x) -> tuple | None:
    val = x.meta.get("val") if isinstance(x, fx.Node) else None
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None


def _skip_full_slices(x):
    """The input of a chain of slices that keep every element (``t[:, :]``)."""
    while _is_call(x) and x.target == aten.slice.Tensor:
        args = list(x.args) + [0, None, None, 1][len(x.args) - 1:]
        _, dim, start, end, step = args[:5]
        shape = _shape(x.args[0])
        if shape is None or start not in (0, None) or step != 1 or (end is not None and end < shape[dim]
                                                                       and end < _FULL_END):
            return x
        x = x.args[0]
    return x
