"""Analysis: FLOPs, saved activations and repeated blocks of captured graphs."""

import dataclasses

import pytest
import torch

from autopar import capture, models
from autopar.analysis.graph import analyze


def _analyze(cfg, batch=2, seq=32, dtype=torch.float32):
    model = models.build(cfg, device="meta", dtype=dtype)
    graph = capture(model, models.example_inputs(cfg, batch=batch, seq=seq, device="meta"))
    return graph, analyze(graph)


@pytest.mark.parametrize("name", ["tiny-gpt2", "tiny-llama", "tiny-mixtral"])
def test_repeated_blocks_are_found_once_per_layer(name):
    cfg = dataclasses.replace(models.config(name), n_layers=5)
    _, a = _analyze(cfg)
    assert a.blocks.prefix == "layers"
    assert a.blocks.count == 5
    assert a.blocks.identical and a.blocks.classes == [[0, 1, 2, 3, 4]]


def test_flops_per_token_match_six_n_plus_attention():
    # a llama shaped so that matmuls dominate: 6·N' + 12·L·h·s within 2 %
    cfg = dataclasses.replace(models.config("tiny-llama"), hidden=256, ffn=512, n_layers=3, vocab=512)
    seq, batch = 64, 2
    graph, a = _analyze(cfg, batch=batch, seq=seq)
    n_prime = graph.num_params - cfg.vocab * cfg.hidden  # the input embedding does no matmul
    formula = 6 * n_prime + 12 * cfg.n_layers * cfg.hidden * seq
    measured = (a.forward_flops + a.backward_flops) / (batch * seq)
    assert measured == pytest.approx(formula, rel=0.02)
    # backward does twice the forward's matmul work
    assert a.backward_flops == pytest.approx(2 * a.forward_flops, rel=0.02)


def test_causal_attention_runs_half_its_counted_flops():
    """The count keeps the playbook's non-causal convention (MFU); the executed FLOPs the step is
    priced on are half for causal flash attention, forward and backward."""
    _, a = _analyze(models.config("tiny-llama"))
    attention = [n for n in a.nodes.values() if "flash_attention" in n.target]
    assert len(attention) == 2 * models.config("tiny-llama").n_layers  # forward + backward
    for n in attention:
        assert n.flops > 0 and n.causal_share == 0.5 and n.executed_flops == 0.5 * n.flops
    assert all(n.causal_share == 1.0 for n in a.nodes.values() if n.is_matmul)


def test_moe_flops_scale_with_top_k_not_experts():
    base = models.config("tiny-mixtral")
    _, a2 = _analyze(dataclasses.replace(base, top_k=2))
    _, a1 = _analyze(dataclasses.replace(base, top_k=1))
    _, a1_more = _analyze(dataclasses.replace(base, top_k=1, n_experts=8))
    assert a2.forward_flops > a1.forward_flops
    # doubling the experts at fixed top_k leaves expert compute (nearly) unchanged
    assert a1_more.forward_flops == pytest.approx(a1.forward_flops, rel=0.1)


def test_saved_activations_scale_with_batch_and_dtype():
    _, a1 = _analyze("tiny-llama", batch=1)
    _, a2 = _analyze("tiny-llama", batch=2)
    _, half = _analyze("tiny-llama", batch=2, dtype=torch.bfloat16)
    assert a2.saved_bytes == pytest.approx(2 * a1.saved_bytes, rel=0.05)
    assert half.saved_bytes < a2.saved_bytes
    per_layer = a2.saved_bytes_by_layer()
    assert per_layer[0] == per_layer[1] > 0


def test_node_facts_are_attributed_to_modules_and_phases():
    _, a = _analyze("tiny-llama")
    mms = [n for n in a.nodes.values() if n.is_matmul and n.phase == "forward"]
    assert any(n.module == "layers.0.attn.q_proj" for n in mms)
    assert any(n.module == "lm_head" for n in mms)
    back = [n for n in a.nodes.values() if n.phase == "backward" and n.layer == 1]
    assert back, "backward nodes inherit the layer of their forward node"
    assert all(n.bytes_read == 0 for n in a.nodes.values() if n.is_view)
