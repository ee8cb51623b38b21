"""ModelConfig(head_dim=...): attention wider or narrower than hidden / heads (Qwen3, GPT-OSS)."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

import autopar
from autopar import models


def _cfg(family: str, head_dim: int | None = 16, **changes):
    return dataclasses.replace(models.config(f"tiny-{family}"), name=f"hd-{family}",
                               head_dim=head_dim, **changes)


def test_default_is_hidden_over_heads_and_follows_replace():
    cfg = models.config("llama3-8b")
    assert cfg.head_dim == 128 and cfg.attn_dim == cfg.hidden
    wider = dataclasses.replace(models.config("tiny-llama"), hidden=256)
    assert wider.head_dim == 256 // 8  # derived again, not carried from hidden 64
    given = _cfg("llama")
    assert given.head_dim == 16 and given.attn_dim == 128 != given.hidden
    assert dataclasses.replace(given, hidden=128).head_dim == 16  # a given width stays
    assert given != models.config("tiny-llama")
    for bad in (0, -8, 2.5, True):
        with pytest.raises(ValueError, match="head_dim"):
            _cfg("llama", head_dim=bad)
    with pytest.raises(ValueError, match="even head_dim"):
        _cfg("llama", head_dim=7)
    # without head_dim the heads must still divide hidden
    with pytest.raises(ValueError, match="give head_dim"):
        dataclasses.replace(models.config("tiny-llama"), n_heads=6, n_kv_heads=6)
    # with it they need not: 6 heads of 16 on a hidden of 64
    assert _cfg("llama", n_heads=6, n_kv_heads=3).attn_dim == 96


@pytest.mark.parametrize("family", ["llama", "gpt2", "mixtral"])
def test_parameters_and_flops_follow_the_projections(family):
    cfg, base = _cfg(family), models.config(f"tiny-{family}")
    model, ref = models.build(cfg), models.build(base)
    h, d, heads, kv = cfg.hidden, cfg.head_dim, cfg.n_heads, cfg.n_kv_heads
    attn = model.layers[0].attn
    if family == "gpt2":
        assert attn.qkv.weight.shape == (3 * heads * d, h)
        per_block = h * 3 * heads * d + 3 * heads * d + heads * d * h  # weights and qkv bias
        per_block_ref = 3 * h * h + 3 * h + h * h
    else:
        assert attn.q_proj.weight.shape == (heads * d, h)
        assert attn.k_proj.weight.shape == (kv * d, h) and attn.o_proj.weight.shape == (h, heads * d)
        per_block = h * d * (2 * heads + 2 * kv)
        per_block_ref = h * (h // heads) * (2 * heads + 2 * kv)
    count = sum(p.numel() for p in model.parameters())
    count_ref = sum(p.numel() for p in ref.parameters())
    assert count - count_ref == cfg.n_layers * (per_block - per_block_ref)

    batch, seq = 2, 32
    tokens = models.example_inputs(cfg, batch=batch, seq=seq)[0]
    flops = {}
    for name, m in (("new", model), ("ref", ref)):
        # the math kernel: CPU's fused attention kernel is not counted by FlopCounterMode
        with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
            m(tokens)
        flops[name] = counter.get_total_flops()
    # 2 FLOPs per multiply-add on every token; the score and value matmuls 2*2*s^2*heads*d
    qkvo = (2 * heads + 2 * kv) if family != "gpt2" else 4 * heads
    def attn_flops(dh):
        return cfg.n_layers * batch * (2 * seq * h * dh * qkvo + 4 * seq * seq * heads * dh)
    assert flops["new"] - flops["ref"] == attn_flops(d) - attn_flops(h // heads)

    loss = model(tokens, tokens)
    loss.backward()  # it trains: every weight gets a gradient
    assert torch.isfinite(loss) and all(p.grad is not None for p in model.parameters())


def test_zoo_model_with_head_dim_captures_and_plans():
    cfg = _cfg("llama", n_layers=2)
    model = models.build(cfg, device="meta")
    inputs = models.example_inputs(cfg, batch=8, seq=64, device="meta")
    cluster = autopar.Cluster("h100", nodes=1, gpus_per_node=4)
    layout = autopar.Layout(dp=2, tp=2, sp=True, microbatch=2, grad_accum=2)
    plan = autopar.plan(model, inputs, cluster=cluster, layout=layout)
    assert plan.predicted.fits and plan.predicted.step_time_s > 0
    assert plan.placements["layers.0.attn.o_proj.weight"]["tp"] == "Shard(1)"
    ref = autopar.plan(models.build(models.config("tiny-llama"), device="meta"),
                       models.example_inputs("tiny-llama", batch=8, seq=64, device="meta"),
                       cluster=cluster, layout=layout)
    # twice the attention width: more parameter memory than the default head_dim's
    assert plan.predicted.memory_per_device_bytes > ref.predicted.memory_per_device_bytes
    chosen = autopar.plan(model, inputs, cluster=cluster)
    assert chosen.predicted.fits


class _WideHeads(nn.Module):
    """A plain-PyTorch attention block whose 4 heads of 32 are twice as wide as hidden 64."""

    def __init__(self, hidden=64, heads=4, head_dim=32, vocab=96):
        super().__init__()
        self.heads, self.d = heads, head_dim
        self.embed = nn.Embedding(vocab, hidden)
        self.qkv = nn.Linear(hidden, 3 * heads * head_dim, bias=False)
        self.out = nn.Linear(heads * head_dim, hidden, bias=False)
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, self.d).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.head(x + self.out(y.transpose(1, 2).reshape(b, s, -1)))


def test_own_model_with_wide_heads_plans():
    net = _WideHeads()
    tokens = torch.randint(0, 96, (8, 32))
    def loss_fn(logits, labels):
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())
    plan = autopar.plan(net, (tokens, tokens), cluster=autopar.Cluster("h100", nodes=1,
                                                                          gpus_per_node=2),
                        loss_fn=loss_fn)
    assert plan.predicted.fits and plan.layout.world_size == 2
