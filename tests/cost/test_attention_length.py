"""Attention is priced at the keys each attention node attends over, read off its own key
tensor: the tokens of a language model, the patches of an image model (whose first input's
dim 1 is its channels, not a sequence)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autopar
from autopar import models
from autopar.search.step import captured_step
from cost.cluster import Cluster
from cost.terms.compute import attention_efficiency, node_times


class PatchAttention(nn.Module):
    """A ViT-like classifier: 4x4 patches of a 3-channel image, one attention block, mean pool;
    trained with a label-smoothed cross-entropy or a squared error on one-hot targets."""

    def __init__(self, dim: int = 64, heads: int = 4, classes: int = 10, smooth: bool = True):
        super().__init__()
        self.patch = nn.Conv2d(3, dim, kernel_size=4, stride=4)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, classes)
        self.heads, self.smooth = heads, smooth

    def forward(self, image: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
        x = self.patch(image).flatten(2).transpose(1, 2)  # [batch, patches, dim]
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        x = x + self.out(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, d))
        logits = self.head(x.mean(1))
        if self.smooth:
            return F.cross_entropy(logits, label, label_smoothing=0.1)
        return F.mse_loss(logits, F.one_hot(label, logits.shape[-1]).to(logits.dtype))


def _facts(model, inputs):
    cluster = Cluster("h100", nodes=1, gpus_per_node=8)
    step = captured_step(model, inputs, None, torch.bfloat16)
    return step.facts_for(cluster, autopar.Layout(dp=8, microbatch=1, grad_accum=1)), cluster


@pytest.mark.parametrize("smooth", [True, False])
def test_an_image_model_attends_over_its_patches(smooth):
    model = PatchAttention(smooth=smooth).to(device="meta", dtype=torch.bfloat16)
    inputs = (torch.empty(8, 3, 64, 64, device="meta", dtype=torch.bfloat16),
              torch.zeros(8, dtype=torch.long, device="meta"))
    facts, cluster = _facts(model, inputs)
    att = facts.nodes.is_attention & (facts.nodes.flops > 0)
    assert att.sum() == 1 and facts.seq == 3  # dim 1 of the image: its channels
    assert facts.nodes.attention_seq[att].tolist() == [256]  # (64 / 4) ** 2 patches
    # its backward attends over the same keys (and runs at the attention's rate); no other node
    backward = (facts.nodes.attention_seq > 0) & ~facts.nodes.is_attention
    assert backward.sum() == 1 and not facts.nodes.forward[backward].any()
    assert facts.nodes.attention_seq[backward].tolist() == [256]
    assert "attention" in facts.nodes.name[backward][0] and "backward" in facts.nodes.name[backward][0]
    # each attention's floor is its FLOPs at the rate of 256 keys, not of 3
    big = facts.rebatch(1 << 16)
    times = node_times(big, cluster, autopar.Layout(dp=8, microbatch=8192, grad_accum=1))
    gpu, scale = cluster.gpu, cluster.params.attention_efficiency
    for node in (att, backward):
        kernel = dict(native=big.native_attention, head_dim=big.nodes.attention_head_dim[node][0])
        at_patches = big.nodes.flops[node] / (gpu.peak("bf16") * attention_efficiency(gpu, 256, scale, **kernel)) / 8
        assert times[node][0] >= at_patches[0] * (1 - 1e-9)
        at_channels = big.nodes.flops[node] / (gpu.peak("bf16") * attention_efficiency(gpu, 3, scale, **kernel)) / 8
        assert times[node][0] < at_channels[0] / 10


def test_a_language_model_attends_over_its_tokens():
    model = models.build("tiny-llama", device="meta", dtype=torch.bfloat16)
    facts, _ = _facts(model, models.example_inputs("tiny-llama", batch=8, seq=48, device="meta"))
    att = facts.nodes.is_attention
    assert att.any() and set(facts.nodes.attention_seq[att].tolist()) == {48}
