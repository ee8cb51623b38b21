"""The textbook step model: the baseline `bench playbook` measures autopar's cost model against.

What a person with the Ultra-Scale Playbook and a spreadsheet would write (written for this
bench, ~40 lines of arithmetic; shared/reference/playbook-facts.md for every formula):

- compute: 6N + 12·L·h·s FLOPs per token at a fixed 55 % of the dense bf16 peak;
- DP: the gradients (bf16) all-reduced once per step at the playbook's measured all-reduce bus
  bandwidth for the cluster's node count, a flat 30 % of it exposed;
- TP (+SP): 8·s·b·h bf16 bytes per block per micro-batch through all-gathers and
  reduce-scatters at NVLink's measured bus bandwidth inside a node, EFA's across nodes;
- PP: a bubble of (p-1)/m of the compute;
- memory: 20 bytes per parameter (2 weights, 2 gradients, 4 fp32 accumulation, 12 fp32 master
  and Adam: the playbook's k) with ZeRO-1 sharding the 12 over dp; activations 34·s·b·h per
  block / t with SP, for min(m, p) micro-batches of L/p blocks on the first stage; the fp32
  logits 4·s·b·v / t; a 1.5 GB reserve; 80 GB per GPU.
"""

from __future__ import annotations

import json
import math

from autopar import models
from cost.cluster import PROFILE_DIR
from vocab.layout import Layout

PEAK_BF16 = 989.5e12  # H100 SXM dense bf16 (datasheet; the playbook's MFU peak)
MFU = 0.55
DP_EXPOSED = 0.30
NVLINK_BUSBW = 250e9  # the playbook's 1-node all-gather / reduce-scatter busbw
CAPACITY = 80e9
RESERVE = 1.5e9
_BUSBW = json.loads((PROFILE_DIR / "h100_efa_busbw.json").read_text())


def _busbw(kind: str, nodes: int) -> float:
    """The playbook's measured busbw (B/s) at the nearest measured node count."""
    pts = dict(zip(_BUSBW["nodes"], _BUSBW["busbw"][kind]))
    near = min(pts, key=lambda n: abs(math.log2(n) - math.log2(max(nodes, 1))))
    return pts[near] * 1e9


def textbook(model: str, nodes: int, lay: Layout, seq: int = 4096, gpus_per_node: int = 8
             ) -> tuple[float, float]:
    """(tok/s/GPU, memory bytes of the fullest GPU) of ``lay`` by the textbook formulas."""
    c = models.config(model)
    L, h, v, t, p, m, b = c.n_layers, c.hidden, c.vocab, lay.tp, lay.pp, lay.grad_accum, lay.microbatch
    kv = h * c.n_kv_heads // c.n_heads
    n_params = L * (2 * h * h + 2 * h * kv + 3 * h * c.ffn) + v * h * (1 if c.tied else 2)
    tokens = lay.global_batch * seq
    world = nodes * gpus_per_node
    compute = tokens * (6 * n_params + 12 * L * h * seq) / (world * PEAK_BF16 * MFU)
    local = n_params / (t * p)
    dp_s = 0.0 if lay.dp == 1 else 2 * (lay.dp - 1) / lay.dp * 2 * local / _busbw("all_reduce", nodes)
    tp_bw = NVLINK_BUSBW if t <= gpus_per_node else _busbw("all_gather", max(1, t // gpus_per_node))
    tp_s = 0.0 if t == 1 else m * (L / p) * 8 * seq * b * h * 2 * (t - 1) / t / tp_bw
    bubble = (p - 1) / m * (compute + tp_s)
    step = compute + tp_s + bubble + DP_EXPOSED * dp_s
    states = local * (8 + (12 / lay.dp if lay.zero >= 1 else 12))
    act = min(m, p) * (L / p) * 34 * seq * b * h / t + 4 * seq * b * v / t
    return tokens / step / world, states + act + RESERVE
