"""Capture: the joint graph reproduces eager autograd, on fake tensors, with clear errors."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from autopar import CaptureError, InputError, capture, models


def _eager(model, inputs):
    model.zero_grad()
    loss = model(*inputs)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize(
    "name, via_export",
    [("tiny-gpt2", False), ("tiny-llama", False), ("tiny-mixtral", False), ("tiny-llama", True)],
)
def test_captured_step_matches_eager_autograd(name, via_export):
    model = models.build(name, seed=1)
    inputs = models.example_inputs(name, batch=2, seq=16)
    graph = capture(model, inputs, via_export=via_export)
    loss, grads = graph.run(dict(model.named_parameters()), *inputs)
    ref_loss, ref_grads = _eager(model, inputs)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=0)
    # every parameter (tied ones under their canonical name) has a gradient
    assert len(grads) == len(ref_grads)
    for pname, grad in grads.items():
        ref_name = pname if pname in ref_grads else next(
            a for a, c in graph.aliases.items() if c == pname and a in ref_grads
        )
        torch.testing.assert_close(grad, ref_grads[ref_name], rtol=1e-5, atol=1e-7)


def test_meta_model_captures_without_allocating_and_keeps_gradients():
    model = models.build("tiny-llama", device="meta")
    inputs = models.example_inputs("tiny-llama", batch=2, seq=16, device="meta")
    graph = capture(model, inputs)
    # the user's model is untouched: still meta
    assert all(p.device.type == "meta" for p in model.parameters())
    grads = [o.name for o in graph.outputs if o.kind == "grad"]
    assert sorted(grads) == sorted(n for n, _ in model.named_parameters())
    assert graph.num_params == sum(p.numel() for p in model.parameters())


def test_tied_weights_are_one_parameter_with_an_alias():
    model = models.build("tiny-gpt2", device="meta")
    graph = capture(model, models.example_inputs("tiny-gpt2", batch=1, seq=8, device="meta"))
    assert len(graph.aliases) == 1
    (alias, canonical), = graph.aliases.items()
    assert {alias, canonical} == {"lm_head.weight", "embed.weight"}
    assert canonical in graph.param_names and alias not in graph.param_names


def test_loss_fn_wraps_a_model_that_returns_logits():
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    x, y = torch.randn(5, 8), torch.randint(0, 4, (5,))
    graph = capture(model, (x, y), loss_fn=F.cross_entropy)
    loss, grads = graph.run(dict(model.named_parameters()), x, y)
    ref = F.cross_entropy(model(x), y)
    ref.backward()
    torch.testing.assert_close(loss, ref.detach())
    torch.testing.assert_close(grads["0.weight"], model[0].weight.grad)


class _Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x):
        h = self.proj(x)
        if h.sum() > 0:  # data-dependent: cannot be captured
            h = h * 2
        return h.sum()


class _Outer(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = _Branchy()

    def forward(self, x):
        return self.inner(x)


def test_data_dependent_control_flow_names_module_line_and_fix():
    with pytest.raises(CaptureError) as info:
        capture(_Outer(), (torch.randn(2, 4),))
    text = str(info.value)
    assert "data-dependent" in text
    assert "`inner`" in text and "_Branchy" in text
    assert "test_joint.py" in text and "if h.sum() > 0" in text
    assert "torch.where" in text


class _Numpy(nn.Module):
    def forward(self, x):
        return torch.from_numpy(x.numpy() * 2).sum()


def test_untraceable_op_names_the_module():
    with pytest.raises(CaptureError) as info:
        capture(_Numpy(), (torch.randn(2, 4),))
    assert "_Numpy" in str(info.value) and "fix:" in str(info.value)


def test_wrong_input_dtype_and_shape_fail_before_tracing():
    model = models.build("tiny-llama", device="meta")
    tokens, labels = models.example_inputs("tiny-llama", batch=2, seq=16, device="meta")
    with pytest.raises(InputError, match="integer token ids"):
        capture(model, (tokens.float(), labels))
    with pytest.raises(InputError, match=r"\[batch, seq\]"):
        capture(model, (tokens.view(-1), labels.view(-1)))
    with pytest.raises(InputError, match="max_seq"):
        long = torch.zeros(1, 10_000, dtype=torch.long, device="meta")
        capture(model, (long, long))
    with pytest.raises(InputError, match="cannot take 3"):
        capture(model, (tokens, labels, labels))
    with pytest.raises(InputError, match="outside"):
        capture(models.build("tiny-llama"), (torch.full((1, 4), 10_000), torch.zeros(1, 4, dtype=torch.long)))


def test_shape_mismatch_in_generic_model_names_the_module():
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 1))
    with pytest.raises(CaptureError, match="do not fit the model"):
        capture(model, (torch.randn(3, 5),))


def test_non_scalar_output_asks_for_a_loss():
    model = nn.Linear(4, 2)
    with pytest.raises(CaptureError, match="not a scalar loss"):
        capture(model, (torch.randn(3, 4),))
