"""TP's sequence parallelism inside context parallelism: the SP split is of the CP rank's sequence.

With cp x tp+SP the sequence is split twice, cp outer and tp inner (Megatron's order): CP rank c
of n holds its load-balanced chunks c and 2n-1-c of the 2n (`passes.cp_balance`), L = S / n
positions, and SP splits those L positions over the t TP ranks in t contiguous blocks of L / t:

    rank (c, j) holds  block j of [chunk c | chunk 2n-1-c]           (SP region)
    SP all-gather over tp    ->  [chunk c | chunk 2n-1-c]              (the ring's local sequence)
    SP reduce-scatter        ->  block j of the TP ranks' sum of it

so the all-gather before attention and the column-parallel matmuls rebuilds the rank's
*cp-local* sequence, in the order ring attention expects (contiguous: c's block alike). On a
2-D (cp, tp) mesh this is the sequence dim sharded on both axes, cp first ((Shard(s), Shard(s))
read left to right); the passes run one axis at a time, TP first, so the tp split is already in
the graph when the CP pass runs, as DTensor's functional collectives trace it:

    reduce-scatter onto the sequence   split(x, S/t, s) -> cat(dim 0) -> reduce_scatter -> wait
    all-gather of the sequence         all_gather -> wait -> split(b, 0) -> cat(dim s)

Read globally over cp, the split and the cat would mix the ranks' positions (DTensor gathers
the sequence over cp to run them: correct, not parallel, and the tp blocks would be of the
global sequence, not of the rank's). The CP pass instead runs both on the rank's local
sequence (`sp_split`, `sp_cat`): a local split into t blocks and a local concatenation of the
t gathered blocks, no communication over cp. The values in between (norms, residual adds) are
the rank's SP blocks: placed ``Shard(s)`` on the cp mesh, a placement whose global view is not
in position order, so `SequenceRegion` follows them and refuses what would read that view: an
op over them that DTensor gathers over cp, or one that meets a whole value along the sequence
(a position embedding added inside the SP region). Sums over their positions (a norm weight's
gradient) leave as partial sums over cp, exact in any order.
"""

from __future__ import annotations

import operator

import torch
from torch import fx
from torch._prims_common import make_contiguous_strides_for
from torch.distributed.tensor import DTensor, Shard
from torch.fx import traceback as fx_traceback

aten = torch.ops.aten
_C10D = torch.ops._c10d_functional

__all__ = ["SequenceRegion", "SequenceParallelError", "is_sp_cat", "is_sp_split", "sp_cat", "sp_split"]


class SequenceParallelError(ValueError):
    """An op inside TP's sequence-parallel region that cannot run on the CP rank's SP block."""


def _dim(node: fx.Node, index: int, default: int = 0) -> int:
    value = node.args[index] if len(node.args) > index else node.kwargs.get("dim", default)
    return int(value)


def _getitems(node: fx.Node) -> list[fx.Node] | None:
    users = list(node.users)
    return users if users and all(u.target is operator.getitem for u in users) else None


def is_sp_split(node: fx.Node) -> bool:
    """``node`` is the split of TP's reduce-scatter onto the sequence: split(x, S/t, s) whose
    pieces are concatenated on dim 0 and reduce-scattered over tp."""
    if node.target is not aten.split.Tensor:
        return False
    items = _getitems(node)
    cats = {u for g in items or () for u in g.users}
    if not items or len(cats) != 1:
        return False
    (cat,) = cats
    return cat.target is aten.cat.default and _dim(cat, 1) == 0 \
        and any(u.target is _C10D.reduce_scatter_tensor.default for u in cat.users)


def is_sp_cat(node: fx.Node) -> bool:
    """``node`` is the concatenation of TP's all-gather of the sequence: the t blocks the
    all-gather stacked on dim 0, put side by side on the sequence dim s."""
    if node.target is not aten.cat.default or not node.args[0] or _dim(node, 1) == 0:
        return False
    parts = node.args[0]
    if not all(isinstance(p, fx.Node) and p.target is operator.getitem for p in parts):
        return False
    splits = {p.args[0] for p in parts}
    if len(splits) != 1:
        return False
    (split,) = splits
    if split.target is not aten.split.Tensor or _dim(split, 2) != 0:
        return False
    wait = split.args[0]
    return wait.target is _C10D.wait_tensor.default \
        and wait.args[0].target is _C10D.all_gather_into_tensor.default


def _seq_shard(x, dim: int) -> bool:
    return isinstance(x, DTensor) and len(x.placements) == 1 and type(x.placements[0]) is Shard \
        and x.placements[0].dim == dim % x.ndim


def sp_split(node: fx.Node, x, cp: int) -> tuple[DTensor, ...] | None:
    """The reduce-scatter's split on the rank's local sequence: ``x`` (Shard(s) over cp, the
    rank's L positions) in t blocks of L / t, each placed Shard(s) with the global block's
    shape. None where ``x`` is not split over cp on s (DTensor's rule applies)."""
    size, dim = node.args[1], _dim(node, 2)
    if not _seq_shard(x, dim) or not isinstance(size, int):
        return None
    dim %= x.ndim
    parts = x.shape[dim] // size
    local = x.to_local()
    if x.shape[dim] % size or local.shape[dim] % parts:
        raise SequenceParallelError(
            f"cp={cp}: the CP rank's {local.shape[dim]} positions do not split into the {parts} TP "
            f"ranks' sequence-parallel blocks ({node}); use a sequence length that is a multiple of "
            f"{2 * cp * parts}, or sp=False")
    shape = list(x.shape)
    shape[dim] = size
    return tuple(DTensor.from_local(p, x.device_mesh, [Shard(dim)], run_check=False, shape=torch.Size(shape),
                                    stride=make_contiguous_strides_for(shape)) for p in local.split(local.shape[dim] // parts, dim))


def sp_cat(node: fx.Node, parts) -> DTensor | None:
    """The all-gather's concatenation on the rank's local sequence: the t TP ranks' blocks of
    it side by side, the CP rank's L positions in order (Shard(s) over cp, the whole sequence's
    chunks c and 2n-1-c). None where the parts are not split over cp on s."""
    dim = _dim(node, 1)
    if not parts or not all(_seq_shard(p, dim) for p in parts):
        return None
    dim %= parts[0].ndim
    local = torch.cat([p.to_local() for p in parts], dim)
    shape = list(node.meta["val"].shape)
    return DTensor.from_local(local, parts[0].device_mesh, [Shard(dim)], run_check=False,
                              shape=torch.Size(shape), stride=make_contiguous_strides_for(shape))


def _why(reason: str):
    """Tag the nodes traced inside with the decision behind them (as the TP pass does)."""
    return fx_traceback.annotate({"autopar": reason})


class SequenceRegion:
    """The values holding the CP rank's SP blocks, from `sp_split` to `sp_cat`, and the check
    that no op reads their global view (see the module's docstring)."""

    def __init__(self, cp: int) -> None:
        self.cp = cp
        self.nodes: set[fx.Node] = set()

    def enter(self, node: fx.Node) -> None:
        self.nodes.add(node)

    def inside(self, node: fx.Node) -> bool:
        return any(a in self.nodes for a in node.all_input_nodes)

    def rank_inputs(self, node: fx.Node, env, data: set[str], where: str) -> dict:
        """Before ``node`` runs on SP blocks: the values the TP pass sliced into its TP rank's
        block of the global sequence (split(x, S/t, s)[j]: the token ids Megatron-SP's embedding
        backward reads, a position embedding added in the SP region) as block j of the CP rank's
        sequence instead, returned by node (a local slice of x whole, or of x's own positions
        where x is split over cp already; no communication). Any other value of the data would
        meet the blocks by its global positions, not the rank's: refused."""
        if not any(a in self.nodes and _split_value(env.get(a)) for a in node.all_input_nodes):
            return {}
        out = {}
        for arg in node.all_input_nodes:
            value = env.get(arg)
            if arg in self.nodes or not isinstance(value, DTensor) or value.numel() <= 1:
                continue
            piece = _data_piece(arg)
            if piece is None and arg.name not in data:
                continue  # a weight, or a value of the rank's own positions
            if piece is None:
                raise SequenceParallelError(
                    f"cp={self.cp}: {node.target} ({node}) {where} combines a value of the data ({arg}) "
                    "with TP's sequence-parallel blocks of the CP rank's sequence, whose positions are "
                    "the rank's, not the global ones; use sp=False with cp, or compute position-"
                    "dependent values outside the sequence-parallel region")
            source, dim, size, index = piece
            whole = env[source]
            if list(whole.placements) == [Shard(dim)]:  # already the rank's positions
                local = whole.to_local()
            elif whole.placements[0].is_replicate():
                with _why(f"CP: this rank's tokens of {source}, TP's block {index} of them (a local slice)"):
                    local = whole.redistribute(whole.device_mesh, [Shard(dim)]).to_local()
            else:
                raise SequenceParallelError(
                    f"cp={self.cp}: {node.target} ({node}) {where} reads TP's sequence block of {source}, "
                    f"which is placed {whole.placements[0]} over cp (neither whole nor split on its "
                    "sequence); use sp=False with cp")
            parts = whole.shape[dim] // size
            if local.shape[dim] % parts:
                raise SequenceParallelError(
                    f"cp={self.cp}: the CP rank's {local.shape[dim]} positions of {source} do not split "
                    f"into {parts} TP blocks; use a sequence length that is a multiple of "
                    f"{2 * self.cp * parts}, or sp=False")
            block = local.split(local.shape[dim] // parts, dim)[index]
            shape = list(value.shape)
            out[arg] = DTensor.from_local(block, whole.device_mesh, [Shard(dim)], run_check=False,
                                          shape=torch.Size(shape), stride=make_contiguous_strides_for(shape))
        return out

    def check_output(self, node: fx.Node, out, where: str) -> None:
        """After ``node`` ran on SP blocks: its result is a block again (kept in the region), a
        partial sum over cp (a sum over positions: leaves the region), or anything else, which
        DTensor could only compute by gathering the blocks over cp: refused."""
        values = out if isinstance(out, (tuple, list)) else (out,)
        tensors = [v for v in values if isinstance(v, DTensor)]
        if any(_split_value(v) for v in tensors):
            self.nodes.add(node)
            return
        if all(v.placements[0].is_partial() or v.numel() <= 1 for v in tensors):
            return
        raise SequenceParallelError(
            f"cp={self.cp}: {node.target} ({node}) {where} mixes the positions of TP's sequence-parallel "
            "blocks of the CP rank's sequence (it would gather them over cp); use sp=False with cp")


_SAME_VALUE = {aten.clone.default, aten.alias.default, aten.detach.default}


def _data_piece(arg: fx.Node) -> tuple[fx.Node, int, int, int] | None:
    """``arg`` as (source, dim, block size, block index) where it is (a copy of) the TP pass's
    slice of a whole value into its TP rank's block: split(source, size, dim)[index]."""
    while arg.target in _SAME_VALUE:
        arg = arg.args[0]
    if arg.target is not operator.getitem or not isinstance(arg.args[0], fx.Node):
        return None
    split = arg.args[0]
    if split.target is not aten.split.Tensor or not isinstance(split.args[1], int):
        return None
    return split.args[0], _dim(split, 2), split.args[1], int(arg.args[1])


def _split_value(x) -> bool:
    return isinstance(x, DTensor) and len(x.placements) == 1 and not x.placements[0].is_replicate() \
        and not x.placements[0].is_partial()
