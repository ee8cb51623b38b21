"""Capture: buffers the forward updates in place come out as "buffer" outputs, and
`TrainingGraph.run` writes them back as an eager training step does.

The joint export functionalises in-place updates (BatchNorm's running statistics, a step
counter): the new values are extra graph outputs. Dropping them leaves ``running_mean`` at 0
after training, a silent wrong result.
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from autopar import CaptureError, capture, models


class _BatchNormNet(nn.Module):
    """Linear -> BatchNorm1d -> ReLU -> Linear, with a step counter buffer (``count``)."""

    def __init__(self, count: bool = True) -> None:
        super().__init__()
        self.count = count
        self.inp = nn.Linear(6, 8)
        self.bn = nn.BatchNorm1d(8)
        self.out = nn.Linear(8, 3)
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.count:
            self.steps += 1
        return self.out(F.relu(self.bn(self.inp(x))))


class _ConvBatchNormNet(nn.Module):
    """Conv2d -> BatchNorm2d -> mean-pool -> Linear, with a float counter."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4, momentum=0.3)
        self.head = nn.Linear(4, 3)
        self.register_buffer("seen", torch.zeros(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.add_(x.shape[0])
        return self.head(F.relu(self.bn(self.conv(x))).mean(dim=(2, 3)))


def _batch(kind: str, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(8, 6, generator=g) * 2 + 1 if kind == "1d" else torch.randn(8, 2, 5, 5, generator=g) + 0.5
    return x, torch.randint(0, 3, (8,), generator=g)


def _model(kind: str, count: bool = True) -> nn.Module:
    torch.manual_seed(0)
    return _BatchNormNet(count) if kind == "1d" else _ConvBatchNormNet()


@pytest.mark.parametrize("kind, via_export", [("1d", False), ("2d", False), ("1d", True)])
def test_run_updates_buffers_like_eager_training(kind, via_export):
    model = _model(kind)
    x, y = _batch(kind)
    graph = capture(model, (x, y), loss_fn=F.cross_entropy, via_export=via_export)
    buffer_outputs = {o.name for o in graph.outputs if o.kind == "buffer"}
    expected = {"bn.running_mean", "bn.running_var", "bn.num_batches_tracked",
                "steps" if kind == "1d" else "seen"}
    assert buffer_outputs == expected

    eager = copy.deepcopy(model)
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    params = dict(model.named_parameters())
    for step in range(2):  # twice: the second step reads the first one's statistics
        bx, by = _batch(kind, seed=step)
        loss, grads = graph.run(params, bx, by, buffers=buffers)
        eager.zero_grad()
        ref = F.cross_entropy(eager(bx), by)
        ref.backward()
        torch.testing.assert_close(loss, ref.detach(), rtol=1e-5, atol=1e-6)
        for name, p in eager.named_parameters():
            torch.testing.assert_close(grads[name], p.grad, rtol=1e-5, atol=1e-6)
        for name, b in eager.named_buffers():
            torch.testing.assert_close(buffers[name], b, rtol=1e-5, atol=1e-6)
    assert not torch.equal(buffers["bn.running_mean"], torch.zeros_like(buffers["bn.running_mean"]))
    # capture itself leaves the user's module alone
    for name, b in model.named_buffers():
        assert torch.equal(b, _model(kind).get_buffer(name))


def test_eval_mode_mutates_nothing():
    model = _model("1d", count=False).eval()  # a counter would count in eval mode too
    x, y = _batch("1d")
    graph = capture(model, (x, y), loss_fn=F.cross_entropy)
    assert not [o for o in graph.outputs if o.kind == "buffer"]
    assert {o.kind for o in graph.outputs} == {"loss", "grad"}
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    before = {n: b.clone() for n, b in buffers.items()}
    loss, _ = graph.run(dict(model.named_parameters()), x, y, buffers=buffers)
    torch.testing.assert_close(loss, F.cross_entropy(model(x), y).detach(), rtol=1e-5, atol=1e-6)
    for name, b in buffers.items():
        assert torch.equal(b, before[name])


def test_tied_buffer_is_updated_under_its_canonical_name():
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 1)
            self.register_buffer("total", torch.zeros(4))
            self.register_buffer("alias", self.total)  # one tensor, two names

        def forward(self, x, y):
            self.alias.add_(x.mean(0))
            return F.mse_loss(self.lin(x + self.total), y)

    model = Tied()
    x, y = torch.randn(5, 4), torch.randn(5, 1)
    graph = capture(model, (x, y))
    [out] = [o for o in graph.outputs if o.kind == "buffer"]
    assert out.name == "total" and graph.aliases == {"alias": "total"}
    buffers = {"total": torch.zeros(4)}
    graph.run(dict(model.named_parameters()), x, y, buffers=buffers)
    torch.testing.assert_close(buffers["total"], x.mean(0), rtol=1e-5, atol=1e-7)


def test_parameter_mutated_in_forward_is_a_capture_error():
    class Decay(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 1)

        def forward(self, x, y):
            with torch.no_grad():
                self.lin.weight.mul_(0.99)
            return F.mse_loss(self.lin(x), y)

    with pytest.raises(CaptureError, match=r"(?s)parameter 'lin.weight' in place.*register_buffer"):
        capture(Decay(), (torch.randn(5, 4), torch.randn(5, 1)))


def test_input_mutated_in_forward_is_a_capture_error():
    class Scale(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 1)

        def forward(self, x):
            x.mul_(2)
            return self.lin(x)

    with pytest.raises(CaptureError, match=r"(?s)input 0 .*in place.*clone"):
        capture(Scale(), (torch.randn(5, 4), torch.randn(5, 1)), loss_fn=F.mse_loss)


def test_buffer_updated_with_a_differentiable_value_is_a_capture_error():
    class Ema(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.register_buffer("ema", torch.zeros(4))

        def forward(self, x):
            h = self.lin(x)
            self.ema.copy_(h.mean(0))  # not detached: the buffer joins the autograd graph
            return h

    with pytest.raises(CaptureError, match=r"(?s)buffer 'ema' .*detach"):
        capture(Ema(), (torch.randn(5, 4), torch.randn(5, 4)), loss_fn=F.mse_loss)


@pytest.mark.parametrize("name", ["tiny-gpt2", "tiny-llama", "tiny-mixtral"])
def test_zoo_models_have_no_buffer_outputs(name):
    graph = capture(models.build(name, device="meta"),
                    models.example_inputs(name, batch=2, seq=16, device="meta"))
    assert {o.kind for o in graph.outputs} == {"loss", "grad"}
    assert len(graph.outputs) == len(graph.param_names) + 1
