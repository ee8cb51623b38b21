"""Hugging Face transformers models capture as their eager step computes it.

transformers' mask code takes its tracing path under capture (`torch.compiler.is_compiling()`),
so no data-dependent branch stops the trace; the captured graph run on real tensors gives eager
PyTorch's loss and every gradient (fp32, rtol 1e-5), for each decoder family.
"""

import pytest
import torch
from hf_tiny import FAMILIES, batch, build

import autopar
from autopar.capture.joint import capture
from autopar.errors import CaptureError


def _run_captured(wrapper, inputs):
    graph = capture(wrapper, inputs)
    params = {k: v.detach() for k, v in wrapper.named_parameters()}
    buffers = {k: v.clone() for k, v in wrapper.named_buffers()}  # rotary inv_freq: non-persistent
    return graph, *graph.run(params, *inputs, buffers=buffers)


@pytest.mark.parametrize("family", FAMILIES)
def test_captured_step_equals_eager(family):
    wrapper = build(family)
    inputs = batch()
    graph, loss, grads = _run_captured(wrapper, inputs)
    ref = wrapper(*inputs)
    ref.backward()
    assert torch.allclose(loss, ref.detach(), rtol=1e-5, atol=1e-6)
    named = dict(wrapper.named_parameters())
    assert set(grads) == set(named)
    bad = [n for n, g in grads.items() if not torch.allclose(g, named[n].grad, rtol=1e-5, atol=1e-6)]
    assert bad == []


def test_model_output_trains_on_its_loss():
    wrapper = build("llama", output=True)  # forward returns the CausalLMOutputWithPast
    inputs = batch()
    _, loss, _ = _run_captured(wrapper, inputs)
    assert torch.allclose(loss, wrapper(*inputs).loss.detach(), rtol=1e-5)


def test_loss_fn_on_logits():
    model = build("qwen2").model
    ids, labels = batch()

    def loss_fn(out, y):  # next-token loss from the ModelOutput's logits
        return torch.nn.functional.cross_entropy(out.logits[:, :-1].flatten(0, 1), y[:, 1:].flatten())

    graph = capture(model, (ids, labels), loss_fn=loss_fn)
    loss, _ = graph.run({k: v.detach() for k, v in model.named_parameters()}, ids, labels,
                        buffers=dict(model.named_buffers()))
    assert torch.allclose(loss, model(input_ids=ids, labels=labels).loss.detach(), rtol=1e-5)


def test_output_without_loss_names_the_fix():
    model = build("llama").model
    with pytest.raises(CaptureError, match="(?s)without a loss.*fix: call the model with its labels"):
        capture(model, batch()[:1])


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_tp_plan_shards_the_projections(family):
    """TP finds column / row roles in transformers' layers; GPT-2's Conv1D weights are stored
    [in, out], so its column-parallel c_attn / c_fc shard dim 1 and its row-parallel dim 0."""
    wrapper = build(family)
    plan = autopar.plan(wrapper, batch(), cluster=autopar.Cluster("h100", nodes=1, gpus_per_node=2),
                        layout=autopar.Layout(tp=2))
    place = {n: p["tp"] for n, p in plan.placements.items()}
    if family == "gpt2":
        assert place["model.transformer.h.0.mlp.c_fc.weight"] == "Shard(1)"
        assert place["model.transformer.h.0.mlp.c_proj.weight"] == "Shard(0)"
        assert place["model.transformer.h.0.attn.c_attn.weight"] == "_StridedShard(1, sf=3)"  # q, k, v parts
    else:
        assert place["model.model.layers.0.mlp.up_proj.weight"] == "Shard(0)"
        assert place["model.model.layers.0.mlp.down_proj.weight"] == "Shard(1)"
        assert place["model.model.layers.0.self_attn.q_proj.weight"] == "Shard(0)"
