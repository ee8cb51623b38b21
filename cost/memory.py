"""Memory per device: model state under ZeRO, activations (reference formula), buffers, reserve.

Sources: the Ultra-Scale Playbook and Korthikanti et al. 2022, "Reducing Activation Recomputation
in Large Transformer Models" (as summarised in shared/reference/playbook-facts.md).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from .precision import PrecisionRecipe

# CUDA context, cuBLAS/NCCL workspaces and kernels: "1-2 GB per GPU" (playbook); the middle.
RESERVE_BYTES = 1.5e9
# torch DistributedDataParallel bucket_cap_mb=25 (MiB; the playbook, nanotron and picotron use
# 25 MB buckets too).
DDP_BUCKET_BYTES = 25 * 2**20
# Buckets in flight: one being reduced while the next fills (double buffering).
BUCKETS_IN_FLIGHT = 2
# ZeRO-3 holds the layer being computed plus the next one, prefetched (playbook: "the next
# layer's weights are prefetched").
ZERO3_GATHERED_LAYERS = 2

RECOMPUTE = ("none", "selective", "full")


def model_state_bytes(
    n_params_local: float, recipe: PrecisionRecipe, zero: int, dp: int,
    n_expert_local: float = 0.0, ep: int = 1,
) -> dict[str, float]:
    """Bytes of parameters, gradients and optimizer state on one device.

    n_params_local: parameters on this device after TP/PP/EP sharding (the caller's count).
    "grads" includes the fp32 accumulation buffer; "optimizer" the fp32 master weights and
    Adam's m and v. ZeRO-1 shards the optimizer over ``dp``, ZeRO-2 also the grads, ZeRO-3 also
    the parameters (playbook: 2Ψ+2Ψ+kΨ/N_d, 2Ψ+(2Ψ+kΨ)/N_d, (2Ψ+2Ψ+kΨ)/N_d with k = 12).
    n_expert_local: the part of n_params_local that is experts' (E/ep of them on a rank under
    expert parallelism): ZeRO shards those over their owners, the dp/ep ranks that store the
    same experts, so a ZeRO-sharded state counts Ψ_dense/N_d + Ψ_expert,local/(N_d/ep).
    """
    if zero not in (0, 1, 2, 3):
        raise ValueError(f"zero={zero!r}: ZeRO stage must be 0, 1, 2 or 3")
    if dp < 1 or n_params_local < 0:
        raise ValueError(f"dp={dp} must be >= 1 and n_params_local={n_params_local} >= 0")
    if not 0 <= n_expert_local <= n_params_local or ep < 1 or dp % ep:
        raise ValueError(f"n_expert_local={n_expert_local} must be within n_params_local="
                         f"{n_params_local}, and ep={ep} must divide dp={dp}")
    # parameters counted once per ZeRO shard: the dense ones over dp, the experts over dp/ep
    sharded = (n_params_local - n_expert_local) / dp + n_expert_local * ep / dp
    per_param = {"params": recipe.param_bytes, "grads": recipe.grad_bytes + recipe.grad_accum_bytes,
                 "optimizer": recipe.master_bytes + recipe.optimizer_bytes}
    stage = {"params": 3, "grads": 2, "optimizer": 1}  # the ZeRO stage that shards each
    return {k: (sharded if zero >= stage[k] else n_params_local) * b for k, b in per_param.items()}


def activation_bytes_formula(
    L: int,
    s: int,
    b: int,
    h: int,
    a: int,
    t: int = 1,
    sp: bool = False,
    recompute: str = "none",
    v: int | None = None,
    cp: int = 1,
) -> float:
    """Activation bytes of one micro-batch for the whole model, bf16 (Korthikanti et al. 2022).

    Per layer: s*b*h*(10 + 24/t + 5*a*s/(h*t)) with TP alone, s*b*h*(34/t + 5*a*s/(h*t)) with
    TP+SP; ``recompute="selective"`` drops the attention-score term 5*a*s/(h*t);
    ``recompute="full"`` keeps only each layer's input, 2*s*b*h (divided by t under SP, where the
    input is sequence-sharded). Context parallelism divides everything by ``cp``.
    With ``v`` (vocabulary) the fp32 logits of the loss, 4*s*b*v, are added (divided by t:
    vocab-parallel cross-entropy shards them, and by cp). The playbook's 8B figures (97.0 /
    17.0 / ~1.0 GiB) exclude the logits.
    A reference for the graph-based estimate: it counts GPT-style layers with dropout masks;
    pipeline parallelism is the caller's business (a stage holds L/p layers per micro-batch).
    """
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute={recompute!r}: choose one of {RECOMPUTE}")
    if min(L, s, b, h, a, t, cp) < 1:
        raise ValueError("activation_bytes_formula: L, s, b, h, a, t, cp must all be >= 1")
    sbh = s * b * h
    if recompute == "full":
        per_layer = 2 * sbh / (t if sp else 1)
    else:
        per_layer = sbh * (34 / t if sp else 10 + 24 / t)
        if recompute == "none":
            per_layer += sbh * 5 * a * s / (h * t)
    total = L * per_layer
    if v:
        total += 4 * s * b * v / t
    return total / cp


def buffer_bytes(
    dp: int,
    zero: int,
    largest_layer_params: float = 0.0,
    param_bytes: float = 2.0,
    bucket_bytes: float = DDP_BUCKET_BYTES,
    kept_weight_params: float | None = None,
) -> float:
    """Communication buffers: gradient buckets when dp > 1 (2 x 25 MiB), plus under ZeRO-3 the
    gathered weights of the current and the prefetched layer (2 x largest layer x param_bytes),
    or, when ZeRO-3 keeps the forward's gathered weights to the backward, all of them
    (``kept_weight_params``: the device's whole weights, in parameters).
    """
    if dp <= 1:
        return 0.0
    total = BUCKETS_IN_FLIGHT * bucket_bytes
    if zero >= 3:
        held = ZERO3_GATHERED_LAYERS * largest_layer_params
        total += max(held, kept_weight_params or 0.0) * param_bytes
    return float(total)


def headroom_bytes(cluster) -> float:
    """Bytes a plan leaves free on one device of ``cluster`` (a `cost.cluster.Cluster`):
    h * capacity with h = `CostParams.memory_headroom` on a GPU (its caching allocator slows
    near the limit), 0 on CPU ranks."""
    gpu = cluster.gpu
    return 0.0 if gpu.is_cpu else float(cluster.params.memory_headroom * gpu.memory_bytes)


@dataclass
class MemoryBreakdown:
    """Bytes on one device by category (the keys of ``plan.predicted["memory_breakdown"]``)."""

    params: float = 0.0
    grads: float = 0.0
    optimizer: float = 0.0
    activations: float = 0.0
    buffers: float = 0.0
    reserve: float = RESERVE_BYTES
    # the share of the device the planner leaves free (`cost.params.CostParams.memory_headroom`
    # times the capacity): counted so that every "does it fit" keeps it
    headroom: float = 0.0

    @property
    def total(self) -> float:
        """Sum of all categories."""
        return (
            self.params
            + self.grads
            + self.optimizer
            + self.activations
            + self.buffers
            + self.reserve
            + self.headroom
        )

    def as_dict(self) -> dict[str, float]:
        """Exactly params, grads, optimizer, activations, buffers, reserve, headroom -> bytes."""
        return {k: float(v) for k, v in asdict(self).items()}
