"""Capture a model's forward alone, in its current mode, as a flat aten graph (evaluation).

The training step is captured as a joint forward+backward graph (`autopar.capture.joint`);
evaluation needs only the forward, with the module in eval mode (dropout off, BatchNorm reading
its running statistics) and no gradient work. `make_fx` traces
``functional_call(module, params | buffers, inputs)`` under ``torch.no_grad()`` on fake tensors,
decomposed to core aten ops (BatchNorm's inference form becomes plain elementwise arithmetic,
which DTensor's sharding propagation covers). The graph's calling convention is flat:
``gm(*params, *buffers, *inputs) -> flat outputs``; ``out_spec`` rebuilds the module's own
output structure (a tensor, a tuple, a dict) from them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils import _pytree as pytree

from autopar.capture.joint import _tracing_flags
from autopar.errors import CaptureError


@dataclass(frozen=True)
class TensorSpec:
    """A tensor's shape, dtype and device, for tracing at a shape no tensor holds."""

    shape: torch.Size
    dtype: torch.dtype
    device: torch.device


@dataclass
class ForwardGraph:
    """A forward-only graph: ``gm(*params, *buffers, *inputs)`` returns the flat outputs.

    ``params`` / ``buffers``: the names the graph's leading inputs take, in order (each tensor
    once: a tied weight under its first name). ``out_spec``: the pytree of the module's output.
    """

    gm: torch.fx.GraphModule
    params: list[str]
    buffers: list[str]
    out_spec: pytree.TreeSpec


def capture_forward(module: nn.Module, params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor],
                    example_inputs: Sequence[torch.Tensor | TensorSpec],
                    loss_fn: Callable | None = None) -> ForwardGraph:
    """Trace ``module(*example_inputs)`` with the given parameters and buffers swapped in; with
    ``loss_fn``, ``loss_fn(module(*example_inputs[:-1]), example_inputs[-1])`` (as `capture`).

    Only the shapes and dtypes of ``params``, ``buffers`` and ``example_inputs`` are read (a
    DTensor gives its global shape): the trace runs on fake tensors, in the module's current
    training mode, without gradients, so in eval mode BatchNorm and its kind update no buffer.
    A forward that writes a buffer whatever its mode (a counter) keeps that in-place op in the
    graph, applied to the buffer when the graph runs, as eager PyTorch would.
    """
    from torch._decomp import core_aten_decompositions
    from torch.fx.experimental.proxy_tensor import make_fx

    names_p, names_b = list(params), list(buffers)
    n_p, n_b = len(names_p), len(names_b)

    def run(*flat):
        state = dict(zip(names_p, flat[:n_p])) | dict(zip(names_b, flat[n_p:n_p + n_b]))
        inputs = tuple(flat[n_p + n_b:])
        if loss_fn is None:
            out = torch.func.functional_call(module, state, inputs, tie_weights=True)
        else:
            out = loss_fn(torch.func.functional_call(module, state, inputs[:-1], tie_weights=True), inputs[-1])
        leaves, spec[0] = pytree.tree_flatten(out)
        return leaves

    spec: list = [None]
    fake_mode = FakeTensorMode(allow_non_fake_inputs=False)
    fakes = [_fake(x, fake_mode) for x in (*params.values(), *buffers.values(), *example_inputs)]
    try:
        with _tracing_flags(), torch.no_grad():
            gm = make_fx(run, decomposition_table=core_aten_decompositions(), tracing_mode="fake")(*fakes)
    except Exception as exc:
        raise CaptureError(
            f"the forward of {type(module).__name__} in eval mode could not be traced: {exc}\n  fix: "
            "make the forward traceable by torch.export (no data-dependent Python control flow)"
        ) from exc
    _explicit_reduction_dims(gm)
    return ForwardGraph(gm=gm, params=names_p, buffers=names_b, out_spec=spec[0])


def _fake(x, fake_mode: FakeTensorMode):
    """A fake tensor with x's shape, dtype and device (meta becomes CPU); other values as they are."""
    if not isinstance(x, (torch.Tensor, TensorSpec)):
        return x
    device = torch.device("cpu") if x.device.type == "meta" else x.device
    with fake_mode:
        return torch.empty(x.shape, dtype=x.dtype, device=device)


_ALL_DIMS_WHEN_EMPTY = ("sum.dim_IntList", "mean.dim", "amax.default", "amin.default", "var.correction",
                        "std.correction", "var_mean.correction")


def _explicit_reduction_dims(gm: torch.fx.GraphModule) -> None:
    """Spell out "every dimension" in reductions that write it as ``dim=[]`` or ``None``.

    Both mean a reduction over all dimensions, but DTensor's sharding propagation reads ``[]``
    as none: a sum over a batch-sharded tensor would come out sharded instead of partial (a
    0-dim value "sharded" on dim 0). The listed dimensions mean the same to eager PyTorch.
    """
    aten = torch.ops.aten
    ops = {getattr(getattr(aten, name.split(".")[0]), name.split(".")[1]) for name in _ALL_DIMS_WHEN_EMPTY}
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in ops:
            continue
        source = node.args[0].meta.get("val") if isinstance(node.args[0], torch.fx.Node) else None
        if source is None or source.dim() == 0:
            continue
        every = list(range(source.dim()))
        if len(node.args) > 1 and node.args[1] in ([], None):
            node.args = (node.args[0], every, *node.args[2:])
        elif len(node.args) == 1 and node.kwargs.get("dim", []) in ([], None):
            node.kwargs = {**node.kwargs, "dim": every}
    gm.recompile()
