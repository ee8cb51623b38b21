"""The optimizer step: AdamW over the parameters a device updates, memory-bound."""

from __future__ import annotations

from cost.cluster import Cluster
from vocab.layout import Layout

# Optimizer step: reads fp32 master, m, v, the gradient; writes master, m, v and the bf16 weight
# (AdamW, memory-bound: 4+4+4+4 read + 4+4+4+2 write = 30 bytes per parameter).
ADAM_BYTES_PER_PARAM = 30.0
# CPU ranks run torch.optim.AdamW(foreach=True): about ten elementwise passes, not one fused
# kernel. Measured by a calibration on a 2-core host: 4.2 M fp32 parameters stepped in 21.3 ms on
# one thread, where `Cluster.local` gives a rank of 2 13.5 GB/s: 68 bytes per parameter.
CPU_ADAM_BYTES_PER_PARAM = 68.0


def optimizer_time(cluster: Cluster, lay: Layout, stage_params: float, expert_params: float = 0.0) -> float:
    """Seconds of one AdamW step on the fullest stage's ``stage_params`` (TP/EP-local)
    parameters, sharded over the dp*cp ranks by ZeRO >= 1; the experts' part of them
    (``expert_params``, E/ep on a rank) over their dp*cp/ep owners."""
    gpu = cluster.gpu
    dense = stage_params - expert_params
    opt_params = dense / (lay.dp * lay.cp) + expert_params * lay.ep / (lay.dp * lay.cp) \
        if lay.zero >= 1 else stage_params
    adam_bytes = CPU_ADAM_BYTES_PER_PARAM if gpu.is_cpu else ADAM_BYTES_PER_PARAM
    return opt_params * adam_bytes / (gpu.memory_bw * gpu.memory_efficiency)
