"""Accelerator datasheets: peak rates, memory, and the fractions of peak that real kernels reach.

Every number names its source. Peaks are dense (no 2:4 sparsity) vendor datasheet figures; the
efficiencies are measurements on this workplace's H200 (see ``cost/profiles/h200_probe.json``
and ``h200_block_check.json``), assumed to carry over to the H100 and A100 where no
measurement of those exists.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field

DTYPES = ("fp32", "tf32", "bf16", "fp16", "fp8")

# Fused attention, causal, forward + backward, bf16, as fractions of the dense bf16 peak, its
# FLOPs counted as the cost model counts them (`autopar.analysis.graph`: forward 4*b*h*s*s*d,
# backward twice that, both halved by the causal mask). Measured on an H200 with PyTorch 2.11's
# SDPA backends, 512-64K tokens, head dims 64 and 128 (examples/gpu_attention_check.py,
# cost/profiles/h200_attention_check.json) and fitted with
#     eff(s, d) = e * s / (s + S_half) * d (128 + D_half) / (128 (d + D_half))
# FlashAttention-2 (PyTorch's flash backend): e 0.288, S_half 933, D_half 17.8, all 16 rows within
# 1.3 %; cuDNN's (Hopper's own fused attention, which Transformer Engine runs), S_half shared:
# e 0.486, D_half 43.1, within 6.3 % (its 512-token rows the worst).
HOPPER_FA2_EFFICIENCY = 0.288
HOPPER_NATIVE_ATTENTION_EFFICIENCY = 0.486
HOPPER_ATTENTION_HALF_SEQ = 933.0
FA2_HALF_HEAD_DIM = 17.8
NATIVE_HALF_HEAD_DIM = 43.1
# FlashAttention-2 on an A100: ~190 of 312 TFLOP/s at 16K tokens, head dim 128, causal, its
# backward counted as 2.5 forwards (Dao 2023, FlashAttention-2, fig. 4-6): 0.61 of the peak,
# 0.61 * 3 / 3.5 = 0.52 in the count above. Its rate against length, read off the same figure
# (~91 TFLOP/s at 512 tokens, ~158 at 2K, ~187 at 8K): S_half 512; the long-sequence rate is
# the 16K one over 16K / (16K + 512): 0.54.
AMPERE_ATTENTION_HALF_SEQ = 512.0
AMPERE_FA2_EFFICIENCY = 0.61 * 3 / 3.5 * (16384 + AMPERE_ATTENTION_HALF_SEQ) / 16384


@dataclass(frozen=True)
class GPUSpec:
    """One accelerator as the cost model sees it.

    peak_flops: dense FLOP/s per dtype key ("fp32" is the non-tensor-core rate, used by plain
        fp32 matmuls with TF32 off, PyTorch's default, and by all pointwise arithmetic).
        A dtype the chip cannot run in hardware (fp8 before Hopper) is absent.
    memory_bytes: HBM capacity in bytes. memory_bw: HBM bandwidth in B/s.
    matmul_efficiency: fraction of the bf16/fp16 peak that large GEMMs reach.
    matmul_efficiency_by_dtype: the same fraction for other dtypes where it differs (optional).
    memory_efficiency: fraction of memory_bw that a large device copy reaches.
    kernel_floor_s: the least time any op takes, launch and dispatch overheads included.
    sm_count: streaming multiprocessors (informative; used by nothing that needs it exactly).
    attention_efficiency: fraction of the bf16 peak that FlashAttention-2's causal forward and
        backward reach at long sequences, head dim 128, run alone (a kernel benchmark; FLOPs
        counted as the cost model counts them; `cost.terms.compute.attention_efficiency` scales
        it by `CostParams.attention_efficiency`).
    native_attention_efficiency: the same for the architecture's own fused attention (cuDNN's
        on Hopper), which Transformer Engine runs (`StepFacts.native_attention`); 0 where there
        is none beyond FlashAttention-2's kernels (Ampere).
    attention_half_seq: the tokens at which those kernels reach half their long-sequence rate.
    source: where the numbers come from.
    """

    name: str
    peak_flops: dict[str, float]
    memory_bytes: float
    memory_bw: float
    matmul_efficiency: float
    memory_efficiency: float
    kernel_floor_s: float
    source: str
    matmul_efficiency_by_dtype: dict[str, float] = field(default_factory=dict)
    sm_count: int = 0
    attention_efficiency: float = HOPPER_FA2_EFFICIENCY
    native_attention_efficiency: float = 0.0
    attention_half_seq: float = HOPPER_ATTENTION_HALF_SEQ

    @property
    def is_cpu(self) -> bool:
        """CPU ranks (a "cpu..." spec): eager kernels, fp32, gloo sharing the compute cores."""
        return self.name.startswith("cpu")

    def peak(self, dtype: str) -> float:
        """Dense peak FLOP/s for ``dtype``; a clear error if the chip has no such rate."""
        if dtype not in DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}; use one of {DTYPES}")
        if dtype not in self.peak_flops:
            have = sorted(self.peak_flops)
            raise ValueError(
                f"{self.name} has no hardware {dtype} rate (it supports {have}); "
                f"choose another precision, e.g. precision='bf16'"
            )
        return self.peak_flops[dtype]

    def efficiency(self, dtype: str) -> float:
        """Fraction of ``peak(dtype)`` that a large GEMM reaches."""
        return self.matmul_efficiency_by_dtype.get(dtype, self.matmul_efficiency)

    def to_dict(self) -> dict:
        """Plain JSON-safe dict of every field."""
        return {
            "name": self.name,
            "peak_flops": dict(self.peak_flops),
            "memory_bytes": self.memory_bytes,
            "memory_bw": self.memory_bw,
            "matmul_efficiency": self.matmul_efficiency,
            "memory_efficiency": self.memory_efficiency,
            "kernel_floor_s": self.kernel_floor_s,
            "source": self.source,
            "matmul_efficiency_by_dtype": dict(self.matmul_efficiency_by_dtype),
            "sm_count": self.sm_count,
            "attention_efficiency": self.attention_efficiency,
            "native_attention_efficiency": self.native_attention_efficiency,
            "attention_half_seq": self.attention_half_seq,
        }

    @classmethod
    def from_dict(cls, data: dict) -> GPUSpec:
        """Inverse of `to_dict`."""
        return cls(**data)


# --- measured on this workplace's H200 --------------------------------------------------------
# GEMM efficiency, large-GEMM asymptote: bf16 0.725, fp8 0.665 of the dense peaks, fitted to
# 12 transformer-shaped GEMMs measured on an H200 with eff(F) = eff_max*F/(F+F_half)
# (cost/compute.py, cost/profiles/h200_block_check.json). The same run's 8192^3
# bf16 GEMM sustained 672 TFLOP/s (0.679), as did the earlier probe loop; the 788 TFLOP/s of
# an earlier probe was a burst of ten. fp32 (TF32 off) 51.0 and tf32 359 TFLOP/s: one sustained loop
# of 8192^3 matmuls on an H200 (cost/profiles/h200_probe.json).
H200_MEASURED_BF16_EFFICIENCY = 0.725
# Device-to-device copy: 4.3 TB/s counting bytes read and written, measured on an H200
# (an earlier device probe) -> 4.3 / 4.8 = 0.896.
H200_MEASURED_COPY_EFFICIENCY = 4.3e12 / 4.8e12
H200_DTYPE_EFFICIENCY = {
    "bf16": H200_MEASURED_BF16_EFFICIENCY,
    "fp16": H200_MEASURED_BF16_EFFICIENCY,
    "fp8": 0.665,
    "fp32": 51.0e12 / 67e12,
    "tf32": 359e12 / 494.7e12,
}
# Per-op floor: an eager x.add_(1) on one element costs 10.7 us per op (CPU dispatch + launch),
# 1.1 us under CUDA-graph replay; measured on an H200 (probe file above). The
# runtime executes per-rank graphs eagerly, so the eager figure is the floor.
H200_MEASURED_KERNEL_FLOOR_S = 1.07e-5


_HOPPER_PEAKS = {
    # NVIDIA H100 Tensor Core GPU datasheet (SXM5), dense figures (the sparse ones are 2x):
    # FP32 67 TFLOPS, TF32 494.7, BF16/FP16 989.5 (the playbook's MFU peak), FP8 1979.
    "fp32": 67e12,
    "tf32": 494.7e12,
    "bf16": 989.5e12,
    "fp16": 989.5e12,
    "fp8": 1979e12,
}

# NVIDIA A100 Tensor Core GPU datasheet (SXM4, 40GB and 80GB alike), dense: FP32 19.5 TFLOPS,
# TF32 156, BF16/FP16 312. No FP8 in hardware: the key is absent on purpose.
_AMPERE_PEAKS = {"fp32": 19.5e12, "tf32": 156e12, "bf16": 312e12, "fp16": 312e12}

GPUS: dict[str, GPUSpec] = {
    "h100": GPUSpec(
        name="H100 SXM 80GB 700 W",  # datasheet: SXM5 "Max TDP up to 700W"
        peak_flops=dict(_HOPPER_PEAKS),
        # Datasheet: "80 GB" HBM3, decimal gigabytes -> 80e9 bytes; 3.35 TB/s.
        memory_bytes=80e9,
        memory_bw=3.35e12,
        matmul_efficiency=H200_MEASURED_BF16_EFFICIENCY,
        matmul_efficiency_by_dtype=dict(H200_DTYPE_EFFICIENCY),
        memory_efficiency=H200_MEASURED_COPY_EFFICIENCY,
        kernel_floor_s=H200_MEASURED_KERNEL_FLOOR_S,
        sm_count=132,  # datasheet: 132 SMs on the SXM5 part
        attention_efficiency=HOPPER_FA2_EFFICIENCY,
        native_attention_efficiency=HOPPER_NATIVE_ATTENTION_EFFICIENCY,
        source=(
            "NVIDIA H100 Tensor Core GPU datasheet (SXM5, dense); efficiencies and kernel floor "
            "assumed equal to the H200 measurements on this workplace (same Hopper chip)"
        ),
    ),
    "h200": GPUSpec(
        name="H200 SXM 141GB",
        peak_flops=dict(_HOPPER_PEAKS),  # H200 datasheet: compute identical to H100 SXM
        # NVIDIA H200 Tensor Core GPU datasheet: 141 GB HBM3e, 4.8 TB/s.
        memory_bytes=141e9,
        memory_bw=4.8e12,
        matmul_efficiency=H200_MEASURED_BF16_EFFICIENCY,
        matmul_efficiency_by_dtype=dict(H200_DTYPE_EFFICIENCY),
        memory_efficiency=H200_MEASURED_COPY_EFFICIENCY,
        kernel_floor_s=H200_MEASURED_KERNEL_FLOOR_S,
        sm_count=132,  # measured: torch reports 132 multiprocessors
        attention_efficiency=HOPPER_FA2_EFFICIENCY,  # measured on this part
        native_attention_efficiency=HOPPER_NATIVE_ATTENTION_EFFICIENCY,
        source=(
            "NVIDIA H200 Tensor Core GPU datasheet (SXM); 788 TFLOP/s bf16 8192^3 matmul "
            "measured on an H200 (a burst of ten), 4.3 TB/s device copy; dtype ratios and kernel "
            "floor measured on an H200 (cost/profiles/h200_probe.json); fused attention rates "
            "measured on an H200 (cost/profiles/h200_attention_check.json)"
        ),
    ),
    "a100-80gb": GPUSpec(
        name="A100 SXM 80GB",
        # NVIDIA A100 Tensor Core GPU datasheet (SXM4 80GB), dense: FP32 19.5 TFLOPS,
        # TF32 156, BF16/FP16 312. No FP8 in hardware: the key is absent on purpose.
        peak_flops=dict(_AMPERE_PEAKS),
        memory_bytes=80e9,  # datasheet: 80 GB HBM2e (decimal)
        memory_bw=2.039e12,  # datasheet: 2,039 GB/s
        matmul_efficiency=H200_MEASURED_BF16_EFFICIENCY,
        memory_efficiency=H200_MEASURED_COPY_EFFICIENCY,
        kernel_floor_s=H200_MEASURED_KERNEL_FLOOR_S,
        sm_count=108,  # datasheet: 108 SMs
        attention_efficiency=AMPERE_FA2_EFFICIENCY,
        attention_half_seq=AMPERE_ATTENTION_HALF_SEQ,
        source=(
            "NVIDIA A100 Tensor Core GPU datasheet (SXM4 80GB, dense); efficiencies and kernel "
            "floor assumed equal to the H200 measurements on this workplace"
        ),
    ),
    "a100-40gb": GPUSpec(
        name="A100 SXM 40GB",
        peak_flops=dict(_AMPERE_PEAKS),  # datasheet: same compute as the 80GB part
        memory_bytes=40e9,  # datasheet: 40 GB HBM2 (decimal)
        memory_bw=1.555e12,  # datasheet: 1,555 GB/s
        matmul_efficiency=H200_MEASURED_BF16_EFFICIENCY,
        memory_efficiency=H200_MEASURED_COPY_EFFICIENCY,
        kernel_floor_s=H200_MEASURED_KERNEL_FLOOR_S,
        sm_count=108,  # datasheet: 108 SMs
        attention_efficiency=AMPERE_FA2_EFFICIENCY,
        attention_half_seq=AMPERE_ATTENTION_HALF_SEQ,
        source=(
            "NVIDIA A100 Tensor Core GPU datasheet (SXM4 40GB, dense); efficiencies and kernel "
            "floor assumed equal to the H200 measurements on this workplace"
        ),
    ),
    "b200": GPUSpec(
        name="B200 SXM 180GB",
        # NVIDIA HGX B200 datasheet (8 GPUs, sparse figures): FP8 72 PFLOPS, FP16/BF16 36,
        # TF32 18, FP32 0.6 (dense FP32). Per GPU and dense (sparse / 2): FP8 4.5, BF16 2.25,
        # TF32 1.125 PFLOPS, FP32 75 TFLOPS.
        peak_flops={"fp32": 75e12, "tf32": 1.125e15, "bf16": 2.25e15, "fp16": 2.25e15,
                    "fp8": 4.5e15},
        memory_bytes=180e9,  # DGX B200 datasheet: 1,440 GB HBM3e over 8 GPUs
        memory_bw=8e12,  # HGX B200 datasheet: 64 TB/s over 8 GPUs
        # no Blackwell measurement here: the H200's fractions of peak, an assumption
        matmul_efficiency=H200_MEASURED_BF16_EFFICIENCY,
        matmul_efficiency_by_dtype=dict(H200_DTYPE_EFFICIENCY),
        memory_efficiency=H200_MEASURED_COPY_EFFICIENCY,
        kernel_floor_s=H200_MEASURED_KERNEL_FLOOR_S,
        sm_count=148,  # NVIDIA Blackwell architecture technical brief: 2 dies, 148 SMs
        # no FlashAttention figure for Blackwell: Hopper's fractions, an assumption
        attention_efficiency=HOPPER_FA2_EFFICIENCY,
        native_attention_efficiency=HOPPER_NATIVE_ATTENTION_EFFICIENCY,
        source=(
            "NVIDIA HGX B200 / DGX B200 datasheets (per GPU, dense = sparse / 2); efficiencies "
            "and kernel floor assumed equal to the H200 measurements on this workplace"
        ),
    ),
    "cpu": GPUSpec(
        name="cpu",
        # Placeholders of the right order of magnitude for a few x86 cores running torch.matmul;
        # `autopar calibrate` measures the real values and `Cluster.local()` uses those.
        peak_flops={"fp32": 150e9, "bf16": 40e9, "fp16": 40e9},
        memory_bytes=16e9,  # placeholder; Cluster.local() reads the machine's RAM instead
        memory_bw=10e9,  # placeholder
        matmul_efficiency=1.0,  # placeholders above are achieved rates already
        memory_efficiency=1.0,
        kernel_floor_s=2e-5,  # placeholder: eager CPU op dispatch is tens of microseconds
        source="placeholder until `autopar calibrate` measures this machine",
    ),
}


# Names kept for the parts they meant before the profiles were split: "a100" was (and is) the
# SXM4 80GB part.
GPU_ALIASES = {"a100": "a100-80gb"}
GPUS["a100"] = GPUS[GPU_ALIASES["a100"]]


def get_gpu(name: str) -> GPUSpec:
    """The GPUSpec called ``name`` (case-insensitive; "a100" is "a100-80gb"); ValueError listing
    the known names."""
    key = GPU_ALIASES.get(name.lower(), name.lower())
    if key in GPUS:
        return GPUS[key]
    close = difflib.get_close_matches(key, list(GPUS), n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise ValueError(f"unknown GPU {name!r}; known: {sorted(GPUS)}{hint}")
