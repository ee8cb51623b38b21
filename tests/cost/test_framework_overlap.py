"""How Megatron-Core's performance recipes communicate, priced where autopar's runtime does
otherwise (`StepFacts.tp_overlap_all`, ``p2p_hidden``, ``param_gather_hidden``; False in
autopar's plans): each flag hides or shrinks only its own term. ``cp_kv_heads``: a ring of kv
heads, autopar's (`passes.kv_expansion`) and Transformer Engine's, against one of the expanded
K/V (other frameworks' measured runs)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from pricing import priced
from torch import nn

import autopar
from autopar.search.step import captured_step
from cost import Cluster, Layout

H100_8 = Cluster("h100", nodes=1, gpus_per_node=8)
H100_32 = Cluster("h100", nodes=4, gpus_per_node=8)


class RepeatGQA(nn.Module):
    """One grouped-query attention block (8 heads sharing 2 K/V heads through
    ``repeat_interleave``) and a head, trained with cross-entropy or a squared error."""

    def __init__(self, dim: int = 64, heads: int = 8, kv_heads: int = 2, vocab: int = 96,
                 loss: str = "ce"):
        super().__init__()
        self.heads, self.kv_heads, self.hd, self.loss = heads, kv_heads, dim // heads, loss
        self.emb = nn.Embedding(vocab, dim)
        self.q = nn.Linear(dim, dim)
        self.kv = nn.Linear(dim, 2 * kv_heads * self.hd)
        self.out = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)
        b, s, d = x.shape
        q = self.q(x).view(b, s, self.heads, self.hd).transpose(1, 2)
        k, v = self.kv(x).view(b, s, 2, self.kv_heads, self.hd).permute(2, 0, 3, 1, 4)
        rep = self.heads // self.kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        logits = self.head(x + self.out(y.transpose(1, 2).reshape(b, s, d)))
        if self.loss == "ce":
            return F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        return F.mse_loss(logits.softmax(-1), F.one_hot(targets, logits.shape[-1]).to(logits.dtype))


def _attention_bytes(facts):
    att = facts.nodes.is_attention & (facts.nodes.flops > 0)
    return facts.nodes.attention_kv_bytes[att], facts.nodes.attention_kv_heads_bytes[att]


@pytest.mark.parametrize("loss", ["ce", "mse"])
def test_kv_heads_bytes_are_read_before_the_grouped_query_expansion(loss):
    model = RepeatGQA(loss=loss).to(device="meta", dtype=torch.bfloat16)
    tokens = torch.zeros(4, 32, dtype=torch.long, device="meta")
    step = captured_step(model, (tokens, tokens), None, torch.bfloat16)
    facts = step.facts_for(H100_8, autopar.Layout(dp=8, microbatch=1, grad_accum=1))
    expanded, own = _attention_bytes(facts)
    assert expanded.size == 1
    assert own.tolist() == pytest.approx((expanded / 4).tolist())  # 8 heads over 2 kv heads


def test_zoo_kv_heads_bytes(llama_step, tiny_gpt2_facts):
    cfg, _, _, step = llama_step
    expanded, own = _attention_bytes(step.facts())
    assert own.tolist() == pytest.approx((expanded * cfg.n_kv_heads / cfg.n_heads).tolist())
    expanded, own = _attention_bytes(tiny_gpt2_facts)  # no expansion: the same bytes
    assert own.tolist() == pytest.approx(expanded.tolist())


@pytest.fixture(scope="module")
def tiny_gpt2_facts():
    from autopar import models

    model = models.build("tiny-gpt2", device="meta", dtype=torch.bfloat16)
    inputs = models.example_inputs("tiny-gpt2", batch=4, seq=32, device="meta")
    step = captured_step(model, inputs, None, torch.bfloat16)
    return step.facts_for(H100_8, autopar.Layout(dp=8, microbatch=1, grad_accum=1))


def _both(facts, cluster, layout, **flag):
    ours = priced(facts, cluster, layout).time_breakdown
    theirs = priced(dataclasses.replace(facts, **flag), cluster, layout).time_breakdown
    return ours, theirs


def test_pipelined_tp_hides_every_sp_collective_and_only_under_sp(llama_step):
    facts = llama_step[3].facts()
    sp = Layout(tp=8, sp=True, microbatch=1, grad_accum=16)
    ours, theirs = _both(facts, H100_8, sp, tp_overlap_all=True)
    assert theirs["tp_comm_s"] < 0.6 * ours["tp_comm_s"]
    assert theirs["compute_s"] == pytest.approx(ours["compute_s"])
    # they hide behind the linear layers' GEMMs only, not the attention kernels
    from cost.terms.tensor_parallel import _overlapped

    _, _, hide_fwd, hide_bwd = _overlapped(dataclasses.replace(facts, tp_overlap_all=True), sp)
    attention = facts.nodes.attention_seq > 0
    assert attention.any() and not (hide_fwd | hide_bwd)[attention].any()
    assert hide_fwd.any() and hide_bwd.any()
    # Transformer Engine's userbuffers need SP: all-reduces are priced as before
    no_sp = Layout(tp=8, sp=False, microbatch=1, grad_accum=16)
    ours, theirs = _both(facts, H100_8, no_sp, tp_overlap_all=True)
    assert theirs["tp_comm_s"] == pytest.approx(ours["tp_comm_s"])


@pytest.fixture(scope="module")
def deep_llama_facts():
    """llama3-8b widths, 4 blocks (two stages of two interleaved chunks), 64 x 1024 tokens."""
    from autopar import models

    cfg = dataclasses.replace(models.config("llama3-8b"), n_layers=4)
    model = models.build(cfg, device="meta", dtype=torch.bfloat16)
    inputs = models.example_inputs(cfg, batch=8, seq=1024, device="meta")
    return captured_step(model, inputs, None, torch.bfloat16).facts().rebatch(64)


def test_interleaved_transfers_hide_behind_compute_only_when_interleaved(deep_llama_facts):
    facts = deep_llama_facts
    inter = Layout(pp=2, dp=16, microbatch=1, grad_accum=4, schedule="interleaved-1f1b",
                   virtual_stages=2)
    ours, theirs = _both(facts, H100_32, inter, p2p_hidden=True)
    assert 0 < theirs["pp_p2p_s"] < 0.5 * ours["pp_p2p_s"]
    plain = Layout(pp=2, dp=16, microbatch=1, grad_accum=4)
    ours, theirs = _both(facts, H100_32, plain, p2p_hidden=True)
    assert theirs["pp_p2p_s"] == pytest.approx(ours["pp_p2p_s"]) and ours["pp_p2p_s"] > 0


def test_overlapped_weight_gather_leaves_the_total_and_shrinks_the_exposed(llama_step):
    facts = llama_step[3].facts().rebatch(64)
    zero1 = Layout(dp=32, zero=1, microbatch=1, grad_accum=2)
    ours, theirs = _both(facts, H100_32, zero1, param_gather_hidden=True)
    assert theirs["dp_comm_total_s"] == pytest.approx(ours["dp_comm_total_s"])
    assert theirs["dp_comm_exposed_s"] < ours["dp_comm_exposed_s"]
    # ZeRO-0 gathers no weights: nothing changes
    ours, theirs = _both(facts, H100_32, Layout(dp=32, microbatch=1, grad_accum=2),
                         param_gather_hidden=True)
    assert theirs["dp_comm_exposed_s"] == pytest.approx(ours["dp_comm_exposed_s"])


def test_a_ring_of_kv_heads_sends_a_group_share_of_the_bytes(llama_step):
    cfg, _, _, step = llama_step
    facts = step.facts()
    assert facts.cp_kv_heads  # autopar's ring: the expansion is recognised
    cp = Layout(dp=4, cp=8, microbatch=1, grad_accum=4)
    ours, expanding = _both(facts, H100_32, cp, cp_kv_heads=False)
    assert 0 < ours["cp_comm_exposed_s"] < expanding["cp_comm_exposed_s"]
    # a ring of the expanded K/V sends n_heads / n_kv_heads times the kv heads' bytes
    expanded, own = _attention_bytes(facts)
    assert np.all(expanded == own * cfg.n_heads // cfg.n_kv_heads)


def test_ring_blocks_and_replicated_kv_heads_are_priced_as_autopar_runs_them(llama_step):
    """Under cp > 1 autopar's ring runs its blocks as plain matmuls: attention is priced at
    FlashAttention-2's rate, not the native kernel's (Transformer Engine's ring:
    ``ring_native_attention``); TP beyond the kv heads replicates them and the ring sends the
    expanded K/V."""
    facts = llama_step[3].facts()
    assert facts.native_attention and not facts.ring_native_attention
    cp = Layout(dp=4, cp=8, microbatch=1, grad_accum=4)
    ours, native = _both(facts, H100_32, cp, ring_native_attention=True)
    assert native["compute_s"] < ours["compute_s"]
    fa2, _ = _both(dataclasses.replace(facts, native_attention=False), H100_32, cp)
    assert fa2["compute_s"] == pytest.approx(ours["compute_s"])
    # llama3-8b has 8 kv heads: at tp 8 the ring sends them; with 4, tp 8 replicates them
    tp8 = Layout(cp=4, tp=8, microbatch=1, grad_accum=16)
    heads, expanded = _both(facts, H100_32, tp8, cp_kv_heads=False)
    assert heads["cp_comm_exposed_s"] < expanded["cp_comm_exposed_s"]
    few = dataclasses.replace(facts, kv_heads=4)
    heads, expanded = _both(few, H100_32, tp8, cp_kv_heads=False)
    assert heads["cp_comm_exposed_s"] == pytest.approx(expanded["cp_comm_exposed_s"])
