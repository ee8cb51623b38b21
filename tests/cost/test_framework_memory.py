"""Memory as the frameworks of measured runs hold it (`StepFacts.framework_memory`) and flash
attention's efficiency against sequence length (`cost.terms.compute.attention_efficiency`).

On a zoo model (tiny-llama) and a plain-PyTorch language model with two losses, captured on
the meta device as `autopar.calibrate.runs.RunPricer` captures a measured run:
- full recompute as a framework's block checkpoint keeps exactly one block input per block
  beside what lies outside the blocks (autopar's own pass keeps more: the attention outputs);
- a fused loss counts its fp32 log-probabilities once: the backward's transient is half that
  buffer (the logits' bf16 gradient), not twice it; autopar's own plans are unchanged;
- gradients accumulate straight into the fp32 buffer: 2 bytes per parameter fewer;
- attention's rate rises with the sequence as FlashAttention-2's measurements do.
"""

import dataclasses
import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autopar
from autopar import models
from autopar.search.step import captured_step
from cost.cluster import PROFILE_DIR, Cluster
from cost.params import CostParams
from cost.precision import fused_accum, recipe
from cost.step import predict_memory
from cost.terms.compute import attention_efficiency, node_times
from cost.terms.recompute import (
    FUSED_LOSS_TRANSIENT,
    columns,
    local_block_input_bytes,
    local_saved_bytes,
    loss_rows,
)
from vocab.plan_types import RecomputeChoice


class TinyLM(nn.Module):
    """A causal language model in plain PyTorch: pre-norm blocks, SDPA attention, a GELU MLP,
    cross-entropy plus a z-loss on the logits (two losses)."""

    def __init__(self, vocab=512, hidden=128, heads=4, layers=3):
        super().__init__()
        self.heads = heads
        self.emb = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(nn.ModuleDict({
            "ln1": nn.LayerNorm(hidden), "qkv": nn.Linear(hidden, 3 * hidden),
            "out": nn.Linear(hidden, hidden), "ln2": nn.LayerNorm(hidden),
            "up": nn.Linear(hidden, 4 * hidden), "down": nn.Linear(4 * hidden, hidden)})
            for _ in range(layers))
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, ids, labels):
        x = self.emb(ids)
        b, s, h = x.shape
        for blk in self.blocks:
            q, k, v = blk["qkv"](blk["ln1"](x)).view(b, s, 3, self.heads, h // self.heads).unbind(2)
            a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                               is_causal=True)
            x = x + blk["out"](a.transpose(1, 2).reshape(b, s, h))
            x = x + blk["down"](F.gelu(blk["up"](blk["ln2"](x))))
        logits = self.head(self.norm(x)).float()
        ce = F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1))
        return ce + 1e-4 * torch.logsumexp(logits, -1).pow(2).mean()


def _zoo():
    cfg = dataclasses.replace(models.config("tiny-llama"), name="tiny-llama-fw", max_seq=256)
    return (models.build(cfg, device="meta"),
            models.example_inputs(cfg, batch=8, seq=256, device="meta"))


def _own():
    with torch.device("meta"):
        model = TinyLM()
    ids = torch.zeros(8, 256, dtype=torch.long, device="meta")
    return model, (ids, ids.clone())


@pytest.fixture(scope="module", params=["zoo", "own"])
def facts(request):
    model, inputs = (_zoo if request.param == "zoo" else _own)()
    cluster = Cluster("h100", nodes=1, gpus_per_node=8)
    step = captured_step(model, inputs, None, torch.bfloat16)
    base = step.facts_for(cluster, autopar.Layout(dp=8, microbatch=1, grad_accum=1))
    return base, dataclasses.replace(base, framework_memory=True), cluster


def test_full_recompute_keeps_block_inputs_only(facts):
    own, framework, cluster = facts
    lay = autopar.Layout(dp=8, microbatch=1, grad_accum=1, recompute="full")
    local = local_saved_bytes(framework, cluster, lay)
    kept = local * columns(framework, RecomputeChoice("full")).kept
    outside = (framework.saved.layer < 0) | (framework.saved.layer >= framework.n_layers)
    expect = kept[outside].sum() + framework.n_layers * local_block_input_bytes(framework, cluster, lay)
    fw = predict_memory(framework, cluster, lay)
    assert fw.activations == pytest.approx(expect, rel=1e-9)
    # autopar's own pass keeps more than the block inputs (its attention outputs)
    assert predict_memory(own, cluster, lay).activations > fw.activations


def test_a_frameworks_full_recompute_reruns_the_whole_block_forward(facts):
    """What a block checkpoint frees it rebuilds: every forward node of the blocks runs again,
    the attention included; autopar's own pass reruns fewer (it keeps the attention outputs)."""
    from cost.terms.compute import node_stages
    from cost.terms.recompute import staged_rerun

    own, framework, cluster = facts
    lay = autopar.Layout(dp=8, microbatch=1, grad_accum=1, recompute="full")
    choice = (RecomputeChoice("full"),)
    theirs = staged_rerun(framework, choice, node_stages(framework, cluster, lay))
    mine = staged_rerun(own, choice, node_stages(own, cluster, lay))
    n = framework.nodes
    inside = n.forward & (n.layer >= 0) & (n.layer < framework.n_layers)
    assert np.array_equal(theirs, inside)
    assert (theirs & n.is_attention).any() and not (mine & own.nodes.is_attention).any()
    assert mine.sum() < theirs.sum()


def test_fused_loss_holds_the_logits_once(facts):
    own, framework, cluster = facts
    lay = autopar.Layout(dp=8, microbatch=1, grad_accum=1)
    loss = loss_rows(framework)
    assert loss.any() and not loss_rows(own).any()
    local = local_saved_bytes(framework, cluster, lay)
    logp = float((local * framework.saved.kept_none * loss).max())
    others = float((local * framework.saved.kept_none * ~loss).max())
    assert logp > others  # the loss's fp32 buffer is the largest value of a language model
    mine, theirs = predict_memory(own, cluster, lay), predict_memory(framework, cluster, lay)
    # autopar's runtime: it and its gradient (2x); a fused loss: its bf16 gradient (0.5x)
    assert mine.buffers - theirs.buffers == pytest.approx(
        2 * logp - max(2 * others, FUSED_LOSS_TRANSIENT * logp), rel=1e-6)
    assert mine.activations == pytest.approx(theirs.activations)  # nothing else moves


def test_fp32_gradients_only(facts):
    own, framework, cluster = facts
    lay = autopar.Layout(dp=8, microbatch=1, grad_accum=1, fp32_grad_accum=True)
    rec = recipe("bf16", True)
    assert fused_accum(rec).state_bytes == rec.state_bytes - 2  # Megatron-LM's 18 bytes
    assert fused_accum(recipe("bf16", False)) == recipe("bf16", False)
    mine, theirs = predict_memory(own, cluster, lay), predict_memory(framework, cluster, lay)
    assert theirs.grads == pytest.approx(mine.grads * 4 / 6)


def test_attention_rate_follows_the_measured_kernels():
    """The rate against length and head dim reproduces every causal row measured on an H200
    (cost/profiles/h200_attention_check.json): FlashAttention-2 at scale 1, cuDNN's as the
    native kernel."""
    gpu = Cluster("h200", nodes=1).gpu
    rows = json.loads((PROFILE_DIR / "h200_attention_check.json").read_text())["attention"]
    checked = 0
    for r in rows:
        if r["backend"] not in ("flash", "cudnn") or not r["causal"] or "fwd_bwd_s" not in r:
            continue
        if r["kv_heads"] != r["heads"]:  # grouped-query rows, not fitted: looser
            tol = 0.1
        else:
            tol = 0.07
        measured = 3 * r["fwd_flops"] / r["fwd_bwd_s"] / gpu.peak("bf16")
        predicted = attention_efficiency(gpu, r["seq"], 1.0, native=r["backend"] == "cudnn",
                                         head_dim=r["head_dim"])
        assert predicted == pytest.approx(measured, rel=tol), r
        checked += 1
    assert checked >= 36
    seqs = np.array([512, 2048, 8192, 16384, 65536])
    eff = np.array([attention_efficiency(gpu, s, 0.5) for s in seqs])
    assert np.all(np.diff(eff) > 0)
    assert attention_efficiency(gpu, 1 << 20, 1.0, head_dim=64) < attention_efficiency(gpu, 1 << 20, 1.0)
    # FlashAttention-2's A100 curve (Dao 2023, fig. 4): 512 -> 16K tokens runs ~91 -> ~193 TFLOP/s
    a100 = Cluster("a100-80gb", nodes=1).gpu
    assert attention_efficiency(a100, 512, 1.0) / attention_efficiency(a100, 16384, 1.0) == pytest.approx(
        91 / 193, rel=0.1)
    # the GPU's own benchmark rates: FlashAttention-2 on an A100 reaches more of its peak than
    # on an H100, Hopper's native attention (Transformer Engine's) more than FlashAttention-2
    a100 = Cluster("a100-80gb", nodes=1).gpu
    assert attention_efficiency(a100, 1 << 20, 1.0) > attention_efficiency(gpu, 1 << 20, 1.0)
    native = attention_efficiency(gpu, 1 << 20, 0.5, native=True)
    assert native == pytest.approx(gpu.native_attention_efficiency, rel=1e-3)  # not scaled
    assert native > attention_efficiency(gpu, 1 << 20, 1.0)
    # an A100 has no kernel beyond FlashAttention-2's: the native flag prices that, scaled
    assert attention_efficiency(a100, 1 << 20, 0.5, native=True) == attention_efficiency(a100, 1 << 20, 0.5)


def test_attention_efficiency_prices_attention(facts):
    _, framework, _ = facts
    big = framework.rebatch(8192)  # enough work per kernel to leave the launch floor
    lay = autopar.Layout(dp=8, microbatch=1024, grad_accum=1)
    att = (big.nodes.attention_seq > 0) & (big.nodes.flops > 0)  # forward and backward
    assert (att & big.nodes.forward).any() and (att & ~big.nodes.forward).any()
    times, native = [], []
    for eff in (1.0, 0.5, 0.25):
        c = Cluster("h100", nodes=1, gpus_per_node=8)
        c.params = CostParams(attention_efficiency=eff)
        times.append(node_times(dataclasses.replace(big, native_attention=False), c, lay))
        native.append(node_times(dataclasses.replace(big), c, lay))
    # FlashAttention-2's seconds scale with 1 / attention_efficiency once its FLOPs dominate;
    # every other node is priced as before
    assert times[2][att].sum() == pytest.approx(2 * times[1][att].sum(), rel=0.01)
    assert np.array_equal(times[0][~att], times[2][~att])
    # autopar's own runs (PyTorch's SDPA: cuDNN's kernel on Hopper) run at its rate, unscaled
    assert big.native_attention and np.array_equal(native[0], native[2])
    with pytest.raises(ValueError, match="attention_efficiency"):
        CostParams(attention_efficiency=0.05)


def test_measured_runs_are_priced_as_their_frameworks_hold_memory():
    from autopar.calibrate.runs import Run, RunPricer

    pricer = RunPricer("h100", gpus_per_node=2)
    lay = autopar.Layout(dp=2, microbatch=1, grad_accum=1, precision="bf16")
    measured = pricer.facts(Run(1, "tiny-llama", 1, lay, 64, 1.0, None))
    assert measured.framework_memory and not measured.native_attention  # FlashAttention-2
