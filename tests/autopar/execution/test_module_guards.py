"""ParallelModule's guards, without processes: an optimizer over the original model's parameters,
the verdict on the ranks' gathered batch digests, and the eval-mode forward capture."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from autopar.capture.forward import capture_forward
from autopar.errors import InputError
from autopar.execution.module import _judge, guard_original


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Dropout(0.5), nn.Linear(8, 1))


def test_optimizer_over_the_original_model_is_refused():
    model = _net()
    guard_original(model)
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(InputError, match=r"opt = torch.optim.AdamW\(pm.parameters\(\)"):
        opt.step()
    # training the original on one device (it has gradients) is left alone
    model(torch.randn(4, 4)).sum().backward()
    opt.step()
    # optimizers over other parameters are never touched
    other = _net()
    torch.optim.SGD(other.parameters(), lr=0.1).step()


def _row(dp: int, ok: bool, *inputs: tuple[int, int, float]) -> list[float]:
    return [float(dp), float(ok)] + [float(v) for item in inputs for v in item]


def test_judge_names_the_rank_and_the_fix():
    same = [_row(r, True, (8, 64, 1.5), (8, 8, 2.0)) for r in range(2)]
    _judge(same, local_batch=False, planned=[(8, 8), (8,)])
    with pytest.raises(InputError, match="(?s)ranks 0 and 1 passed different data.*local_batch=True"):
        _judge([same[0], _row(1, True, (8, 64, 1.5), (8, 8, 3.0))], False, [(8, 8), (8,)])
    with pytest.raises(InputError, match="(?s)different sizes.*same size"):
        _judge([_row(0, True, (4, 32, 1.0)), _row(1, True, (3, 24, 1.0))], True, [(4, 8)])
    with pytest.raises(InputError, match="rank 1 passed a batch whose shapes differ"):
        _judge([_row(0, True, (4, 32, 1.0)), _row(1, False, (3, 24, 1.0))], True, [(4, 8)])
    # local_batch: DP ranks hold their own slices (other digests), one TP group the same
    slices = [_row(0, True, (4, 32, 1.0)), _row(0, True, (4, 32, 1.0)),
              _row(1, True, (4, 32, 7.0)), _row(1, True, (4, 32, 7.0))]
    _judge(slices, local_batch=True, planned=[(4, 8)])
    slices[3] = _row(1, True, (4, 32, 8.0))
    with pytest.raises(InputError, match="(?s)ranks 2 and 3 .*tensor-parallel group"):
        _judge(slices, local_batch=True, planned=[(4, 8)])


class _TwoOutputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = _net()

    def forward(self, x, y):
        pred = self.net(x)
        return {"loss": F.mse_loss(pred, y), "pred": pred}


def test_forward_capture_is_the_eval_mode_model():
    model = _TwoOutputs()
    with torch.no_grad():
        model.net[1].running_mean.uniform_(-1, 1)
    model.eval()
    x, y = torch.randn(6, 4), torch.randn(6, 1)
    params, buffers = dict(model.named_parameters()), dict(model.named_buffers())
    graph = capture_forward(model, params, buffers, (x, y))
    ops = {str(n.target) for n in graph.gm.graph.nodes if n.op == "call_function"}
    assert not any("dropout" in op or "bernoulli" in op for op in ops), ops
    flat = graph.gm(*params.values(), *buffers.values(), x, y)
    got = torch.utils._pytree.tree_unflatten(flat, graph.out_spec)
    want = model(x, y)
    assert set(got) == {"loss", "pred"}
    torch.testing.assert_close(got["loss"], want["loss"])
    torch.testing.assert_close(got["pred"], want["pred"])
    # "all dimensions" spelled out for DTensor (an empty dim list reads as none to it)
    for node in graph.gm.graph.nodes:
        if node.target is torch.ops.aten.mean.dim:
            assert list(node.args[1]) == list(range(node.args[0].meta["val"].dim()))


def test_forward_capture_applies_the_loss_fn_to_the_last_input():
    model = _net().eval()
    x, y = torch.randn(5, 4), torch.randn(5, 1)
    params, buffers = dict(model.named_parameters()), dict(model.named_buffers())
    graph = capture_forward(model, params, buffers, (x, y), loss_fn=F.l1_loss)
    (loss,) = graph.gm(*params.values(), *buffers.values(), x, y)
    torch.testing.assert_close(loss, F.l1_loss(model(x), y))


def test_evaluation_under_a_pipeline_names_the_fix():
    from autopar.execution.evaluation import refuse_pipeline

    refuse_pipeline(1)
    with pytest.raises(InputError, match=r"(?s)pp=2.*pm.full_state_dict\(\).*without pp"):
        refuse_pipeline(2)
