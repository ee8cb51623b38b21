"""Candidate placements of a graph node on one mesh axis, from DTensor's own rules.

One adapter over PyTorch's registry of single-mesh-dimension sharding strategies
(``op_single_dim_strategy_funcs``, about a thousand aten ops): for a node it returns the
strategies DTensor knows, each a list of placements (output first, then the tensor inputs), with
``Shard(d)``, ``Replicate()`` and ``Partial()`` as in DTensor. Where DTensor's registry has
nothing our graphs need (views and reshapes, CPU flash attention, the loss, routing ops), a
short own rule says which inputs may stay sharded. An op that neither knows is replicated, and
`warn_unknown` says so once per op, naming it.
"""

from __future__ import annotations

import logging
import operator

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import TensorMeta

log = logging.getLogger("autopar.strategies.dtensor")
aten = torch.ops.aten

# Own rules: ops that carry a sharding through unchanged on some dimension (heads, batch,
# features) although DTensor's single-dimension registry does not list them.
_CARRY_SHARDING = {
    operator.getitem,
    aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.transpose.int,
    aten.t.default, aten.permute.default, aten.expand.default, aten.unsqueeze.default,
    aten.squeeze.dim, aten.slice.Tensor, aten.select.int, aten.alias.default, aten.detach.default,
    aten.clone.default, aten._to_copy.default, aten.split.Tensor, aten.unbind.int, aten.cat.default,
    aten.stack.default,
    aten._log_softmax.default, aten._log_softmax_backward_data.default,
    aten._softmax.default, aten._softmax_backward_data.default,
    aten.nll_loss_forward.default, aten.nll_loss_backward.default,
    aten.cumsum.default, aten.index_add.default, aten.index_select.default,
    aten.embedding_dense_backward.default, aten.mean.dim, aten.sum.dim_IntList,
    aten.select_backward.default, aten.slice_backward.default, aten.scatter.src,
    aten.scatter_add.default, aten.gather.default, aten.index_put.default,
}
# Ops that read their tensor input only for its dtype and device: a fresh replicated output.
FACTORY_LIKE = {
    aten.new_zeros.default, aten.new_ones.default, aten.new_empty.default, aten.new_full.default,
    aten.zeros_like.default, aten.ones_like.default, aten.empty_like.default, aten.full_like.default,
}
for _name in ("_scaled_dot_product_flash_attention_for_cpu",
              "_scaled_dot_product_flash_attention_for_cpu_backward",
              "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward",
              "_scaled_dot_product_efficient_attention",
              "_scaled_dot_product_efficient_attention_backward"):
    if hasattr(aten, _name):
        _CARRY_SHARDING.add(getattr(aten, _name).default)

_warned: set[str] = set()


def _meta(value) -> object:
    if isinstance(value, torch.Tensor):
        return TensorMeta(value.shape, value.stride(), value.dtype)
    if isinstance(value, (list, tuple)):
        return type(value)(_meta(v) for v in value)
    return value


def dtensor_strategies(node: torch.fx.Node) -> list[list] | None:
    """DTensor's single-dimension strategies for ``node`` (None if it has none)."""
    registry = DTensor._op_dispatcher.sharding_propagator.op_single_dim_strategy_funcs
    info = registry.get(node.target)
    if info is None:
        return None
    args = torch.fx.node.map_arg(node.args, lambda n: n.meta.get("val"))
    kwargs = torch.fx.node.map_arg(node.kwargs, lambda n: n.meta.get("val"))
    try:
        return info.func(node.target, tuple(_meta(a) for a in args), {k: _meta(v) for k, v in kwargs.items()})
    except Exception:  # a rule that cannot read these arguments: treat the op as unknown
        return None


def admits_sharding(node: torch.fx.Node) -> bool | None:
    """Whether some strategy keeps an input of ``node`` sharded (a Shard or partial input).

    True/False from DTensor's registry or an own rule; None for an op neither knows.
    """
    if node.target in _CARRY_SHARDING:
        return True
    strategies = dtensor_strategies(node)
    if strategies is None:
        return None
    return any(
        any(type(p).__name__ != "Replicate" for p in row[1:]) for row in strategies
    )


def warn_unknown(node: torch.fx.Node) -> None:
    """Log, once per op, that an op without any sharding strategy is replicated."""
    name = str(node.target)
    if name not in _warned:
        _warned.add(name)
        log.warning("autopar: no sharding strategy for %s (node %s): its inputs are gathered and "
                    "it runs replicated", name, node.name)
