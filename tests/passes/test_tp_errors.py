"""An op that fails on its inputs' TP placements is a `TensorParallelError` naming the op, the
module and source line that run it, the placements, DTensor's own first line and the fix,
instead of DTensor's bare assertion or shape error."""

import torch
from torch import fx

from passes.tensor_parallel import TensorParallelError, _failure

aten = torch.ops.aten


def _node() -> fx.Node:
    graph = fx.Graph()
    x, y = graph.placeholder("x"), graph.placeholder("y")
    node = graph.call_function(aten.add.Tensor, (x, y))
    graph.output(node)
    node.meta.update(module="layers.0.mixer", partitioner_tag="is_backward",
                     stack_trace='File "model.py", line 12, in forward\n    x = x + self.conv(x)\n')
    return node


def test_failure_names_the_op_the_module_and_the_fix():
    text = _failure(_node(), {}, RuntimeError("Attempting to broadcast a dimension\nsecond line"), sp=True)
    assert text.startswith("TP: add.Tensor (add_tensor) in the backward, in the forward of layers.0.mixer")
    assert "x = x + self.conv(x)" in text and "second line" not in text
    assert "['local', 'local']" in text and "RuntimeError: Attempting to broadcast a dimension" in text
    assert text.endswith("fix: use sp=0, or tp=1 for this model, or keep the weights that feed this op "
                         "replicated")
    assert issubclass(TensorParallelError, ValueError)  # as the pass's other refusals


def test_failure_without_a_source_line_names_the_module():
    node = _node()
    node.meta.pop("stack_trace")
    node.meta.pop("partitioner_tag")
    text = _failure(node, {}, AssertionError(), sp=False)
    assert "in the forward of layers.0.mixer cannot run" in text
    assert "(AssertionError: AssertionError)" in text and "fix: use tp=1 for this model" in text
