"""A loss autopar cannot split is refused naming the user's source line of the op.

The everyday capture records no stack traces; the refusal traces the step again with them
(`autopar.capture.joint.capture_with_sources`) and names the innermost user frame, here a
helper function the forward calls, with torch's and autopar's frames left out.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from autopar.capture.joint import capture, capture_with_sources
from autopar.execution.parallelize import LossReductionError, _loss_reduction, _signature
from cost import Layout


def squared_loss(z, y):
    return F.cross_entropy(z, y) ** 2  # not linear in the batch


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.head = nn.Embedding(16, 8), nn.Linear(8, 16)

    def forward(self, ids, labels):
        return squared_loss(self.head(self.emb(ids)).flatten(0, 1), labels.flatten())


def _batch():
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 16, (4, 5), generator=g), torch.randint(0, 16, (4, 5), generator=g)


def test_sources_name_the_user_lines_only():
    graph = capture_with_sources(Model(), _batch())
    pow_node = next(n for n in graph.gm.graph.nodes if n.target is torch.ops.aten.pow.Tensor_Scalar)
    trace = pow_node.meta["stack_trace"]
    assert "in squared_loss" in trace and "in forward" in trace, trace
    assert "site-packages/torch" not in trace and "autopar/capture" not in trace, trace


def test_refusal_names_the_source_line():
    model, batch = Model(), _batch()
    graph = capture(model, batch)
    signature = _signature(graph.gm, [(i.kind, i.name) for i in graph.inputs],
                           {o.name: o.index for o in graph.outputs if o.kind == "grad"},
                           next(o.index for o in graph.outputs if o.kind == "loss"), {})
    with pytest.raises(LossReductionError) as info:
        _loss_reduction(graph.gm, signature, Layout(dp=1, grad_accum=2), "exact",
                        lambda: capture_with_sources(model, batch).gm)
    text = str(info.value)
    assert "test_loss_source_line.py" in text and "in squared_loss" in text, text
    assert "** 2" in text and 'loss_reduction="mean_per_rank"' in text, text
