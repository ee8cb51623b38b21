"""Tests of the model zoo: shapes and parameter counts, training step, MoE dispatch, export."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.flop_counter import FlopCounterMode

from autopar import models
from autopar.models.moe import MoE, expert_capacity

TINY = ["tiny-gpt2", "tiny-llama", "tiny-mixtral"]
PUBLISHED = [n for n in models.names() if models.config(n).published_params is not None]


def n_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def test_registry_lists_published_and_tiny_configs() -> None:
    expected = {"gpt2", "gpt2-xl", "llama3-1b", "llama3-8b", "llama3-70b", "llama3-405b",
                "mixtral-8x7b", "playbook-1b", "playbook-3b", "playbook-8b", "playbook-80b",
                *TINY}
    assert set(models.names()) == expected
    assert set(PUBLISHED) == expected - set(TINY)
    cfg = models.config("llama3-8b")
    assert cfg.head_dim == 128 and cfg.n_kv_heads == 8 and cfg.rope_theta == 500000.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.hidden = 1  # type: ignore[misc]


@pytest.mark.parametrize("name", PUBLISHED)
def test_meta_build_matches_published_params(name: str) -> None:
    cfg = models.config(name)
    model = models.build(name, device="meta")
    assert all(p.is_meta for p in model.parameters())  # nothing allocated
    count = n_params(model)
    assert abs(count / cfg.published_params - 1) < 0.005, (name, count)
    assert len(model.layers) == cfg.n_layers
    assert (model.lm_head.weight is model.embed.weight) == cfg.tied


@pytest.mark.parametrize("name", TINY)
def test_tiny_configs_are_shardable_by_4(name: str) -> None:
    cfg = models.config(name)
    for dim in (cfg.n_heads, cfg.n_kv_heads, cfg.ffn, cfg.vocab, cfg.hidden, cfg.n_experts):
        assert dim % 4 == 0


def test_build_is_deterministic_and_leaves_global_rng_alone() -> None:
    state = torch.get_rng_state()
    a = models.build("tiny-llama")
    b = models.build("tiny-llama", seed=0)
    c = models.build("tiny-llama", seed=1)
    assert torch.equal(state, torch.get_rng_state())
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    assert not torch.equal(a.embed.weight, c.embed.weight)
    assert torch.all(a.norm.weight == 1)
    assert abs(a.embed.weight.std().item() - 0.02) < 0.002
    gpt = models.build("tiny-gpt2", dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in gpt.parameters())
    assert torch.all(gpt.layers[0].attn.qkv.bias == 0)


def test_example_inputs() -> None:
    tokens, labels = models.example_inputs("tiny-llama", batch=3)
    assert tokens.shape == labels.shape == (3, 64) and tokens.dtype == torch.int64
    assert 0 <= int(tokens.min()) and int(tokens.max()) < 128
    again, _ = models.example_inputs("tiny-llama", batch=3)
    assert torch.equal(tokens, again)
    meta, _ = models.example_inputs("llama3-405b", batch=8, device="meta")
    assert meta.is_meta and meta.shape == (8, 4096)
    assert models.example_inputs("gpt2", device="meta")[0].shape == (2, 1024)
    with pytest.raises(ValueError):
        models.example_inputs("tiny-gpt2", seq=65)


@pytest.mark.parametrize("name", TINY)
def test_tiny_training_step(name: str) -> None:
    cfg = models.config(name)
    model = models.build(name)
    tokens, labels = models.example_inputs(name, batch=4)
    logits = model(tokens)
    assert logits.shape == (4, cfg.max_seq, cfg.vocab)
    loss = model(tokens, labels)
    assert loss.shape == () and torch.isfinite(loss)
    assert abs(loss.item() - math.log(cfg.vocab)) < 0.5  # small init: near-uniform predictions
    loss.backward()
    for pname, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, pname


def test_causality() -> None:
    for name in TINY:
        cfg = models.config(name)
        if cfg.n_experts:
            # Capacity drops let later tokens evict earlier ones; with room for every
            # token the MoE is per-token and the model is exactly causal.
            cfg = dataclasses.replace(cfg, capacity_factor=cfg.n_experts / cfg.top_k)
        model = models.build(cfg)
        tokens, _ = models.example_inputs(cfg, batch=1, seq=16)
        changed = tokens.clone()
        changed[0, 10:] = (changed[0, 10:] + 1) % cfg.vocab
        a, b = model(tokens), model(changed)
        torch.testing.assert_close(a[:, :10], b[:, :10])
        assert not torch.allclose(a[:, 10:], b[:, 10:])


def test_llama_gqa_and_tying() -> None:
    cfg = models.config("tiny-llama")
    assert cfg.n_kv_heads < cfg.n_heads
    untied = models.build(cfg)
    assert untied.layers[0].attn.k_proj.weight.shape == (cfg.n_kv_heads * cfg.head_dim, 64)
    assert untied.lm_head.weight is not untied.embed.weight
    tied = models.build(dataclasses.replace(cfg, name="tiny-llama-tied", tied=True))
    assert tied.lm_head.weight is tied.embed.weight
    assert n_params(untied) - n_params(tied) == cfg.vocab * cfg.hidden
    # Moving a meta model to a device (as fake-tensor tracing does) keeps the weight shared.
    gpt = models.build("tiny-gpt2", device="meta").to_empty(device="cpu")
    assert gpt.lm_head.weight is gpt.embed.weight
    # GQA equals plain multi-head attention with each kv head copied to its query group.
    tokens, labels = models.example_inputs(cfg, batch=2, seq=8)
    mha_cfg = dataclasses.replace(cfg, name="tiny-llama-mha", n_kv_heads=cfg.n_heads)
    mha = models.build(mha_cfg)
    mha.load_state_dict(_expand_kv(untied.state_dict(), cfg))
    torch.testing.assert_close(mha(tokens, labels), untied(tokens, labels))


def _expand_kv(state: dict[str, torch.Tensor], cfg: models.ModelConfig) -> dict:
    rep, d = cfg.n_heads // cfg.n_kv_heads, cfg.head_dim
    out = dict(state)
    for key, w in state.items():
        if key.endswith(("k_proj.weight", "v_proj.weight")):
            out[key] = w.view(cfg.n_kv_heads, 1, d, -1).expand(-1, rep, -1, -1).reshape(-1,
                                                                                        w.shape[1])
    return out


def _reference_moe(moe: MoE, x: torch.Tensor, capacity: int) -> torch.Tensor:
    """Slow per-token loop, one sequence (dispatch group) at a time, with the same priority
    rule: all first choices, then seconds..."""
    if x.dim() == 3:
        return torch.stack([_reference_moe(moe, seq, capacity) for seq in x])
    flat = x.reshape(-1, x.shape[-1])
    probs = torch.softmax(moe.router(flat).float(), dim=-1)
    weight, expert = torch.topk(probs, moe.top_k, dim=-1)
    weight = weight / weight.sum(-1, keepdim=True)
    out = torch.zeros_like(flat)
    used = [0] * moe.n_experts
    for j in range(moe.top_k):
        for t in range(flat.shape[0]):
            e = int(expert[t, j])
            if used[e] < capacity:
                used[e] += 1
                out[t] += weight[t, j] * moe.experts[e](flat[t:t + 1])[0]
    return out.view_as(x)


@pytest.mark.parametrize("capacity_factor", [4.0, 1.25, 0.5])
def test_moe_dispatch_matches_reference_loop(capacity_factor: float) -> None:
    cfg = dataclasses.replace(models.config("tiny-mixtral"), capacity_factor=capacity_factor)
    model = models.build(cfg, seed=3)
    moe = model.layers[0].mlp
    # Scale up the router so routing is far from uniform and some experts overflow.
    with torch.no_grad():
        moe.router.weight.mul_(50)
    x = torch.randn(2, 24, cfg.hidden, generator=torch.Generator().manual_seed(0))
    n_tok = x.shape[1]  # capacity is per sequence
    capacity = expert_capacity(n_tok, cfg.n_experts, cfg.top_k, capacity_factor)
    if capacity_factor >= cfg.n_experts / cfg.top_k:
        assert capacity == n_tok  # nothing can be dropped
    torch.testing.assert_close(moe(x), _reference_moe(moe, x, capacity))


def test_moe_grads_reach_router_and_all_experts() -> None:
    cfg = models.config("tiny-mixtral")
    model = models.build(cfg)
    tokens, labels = models.example_inputs(cfg, batch=4)
    model(tokens, labels).backward()
    for layer in model.layers:
        assert layer.mlp.router.weight.grad.abs().sum() > 0
        for expert in layer.mlp.experts:
            assert all(p.grad.abs().sum() > 0 for p in expert.parameters())


def test_moe_flops_scale_with_top_k_tokens() -> None:
    cfg = models.config("tiny-mixtral")
    moe = models.build(cfg).layers[0].mlp
    for n_tok in (64, 256):
        x = torch.randn(1, n_tok, cfg.hidden)
        with FlopCounterMode(display=False) as counter:
            moe(x)
        cap = expert_capacity(n_tok, cfg.n_experts, cfg.top_k, cfg.capacity_factor)
        assert cap == math.ceil(cfg.capacity_factor * cfg.top_k * n_tok / cfg.n_experts)
        router = 2 * n_tok * cfg.hidden * cfg.n_experts
        experts = 3 * 2 * cfg.n_experts * cap * cfg.hidden * cfg.ffn  # E*C rows, not E*T
        assert counter.get_total_flops() == router + experts


@pytest.mark.parametrize("name", TINY)
def test_export_real_and_fake(name: str) -> None:
    model = models.build(name)
    tokens, labels = models.example_inputs(name, batch=2, seq=32)
    ep = torch.export.export(model, (tokens, labels), strict=False)
    torch.testing.assert_close(ep.module()(tokens, labels), model(tokens, labels))

    # A meta-built model turned into fake tensors traces the same graph without memory.
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    meta_model = models.build(name, device="meta")
    with mode:
        meta_model.to_empty(device="cpu")
        fake_tokens = torch.empty(2, 32, dtype=torch.int64)
        fake_labels = torch.empty(2, 32, dtype=torch.int64)
        fake_ep = torch.export.export(meta_model, (fake_tokens, fake_labels), strict=False)
    assert len(fake_ep.graph.nodes) == len(ep.graph.nodes)
    # No data-dependent ops crept into the dispatch.
    targets = {str(n.target) for n in ep.graph.nodes}
    assert not any("nonzero" in t or "masked_select" in t for t in targets)


def test_unknown_name_error() -> None:
    with pytest.raises(models.UnknownModelError) as info:
        models.config("llama3-7b")
    assert isinstance(info.value, KeyError)
    message = str(info.value)
    assert "llama3-70b" in message and "tiny-mixtral" in message and "gpt2-xl" in message
    with pytest.raises(KeyError):
        models.build("nope")


def test_reference_loss_formula() -> None:
    model = models.build("tiny-gpt2")
    tokens, labels = models.example_inputs("tiny-gpt2", batch=2, seq=8)
    logits = model(tokens)
    expected = F.cross_entropy(logits.float().view(-1, 128), labels.view(-1))
    torch.testing.assert_close(model(tokens, labels), expected)
