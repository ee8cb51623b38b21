"""Time of one kernel on one device: a roofline with a per-op floor.

``time = max(floor, flops / (peak * efficiency), bytes / (memory_bw * memory_efficiency))``

Matmuls run on the tensor cores at the dtype's peak; everything else runs on the vector units
at the plain fp32 rate (pointwise ops are memory-bound on every GPU here, so their arithmetic
term rarely matters). The floor is the cost of launching and dispatching any op at all.
"""

from __future__ import annotations

from .hardware import DTYPES, GPUSpec

# Bytes per element of each compute dtype; fp8 matmuls write bf16 (torch._scaled_mm out_dtype).
DTYPE_BYTES = {"fp32": 4, "tf32": 4, "bf16": 2, "fp16": 2, "fp8": 1}
MATMUL_OUT_BYTES = {"fp32": 4, "tf32": 4, "bf16": 2, "fp16": 2, "fp8": 2}

def _check_dtype(dtype: str, gpu: GPUSpec) -> None:
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {DTYPES}")
    gpu.peak(dtype)  # raises with a clear message when the chip lacks the dtype (fp8 on A100)


def op_time(
    flops: float,
    nbytes: float,
    dtype: str,
    gpu: GPUSpec,
    is_matmul: bool,
    efficiency: float | None = None,
) -> float:
    """Seconds for one op of ``flops`` arithmetic touching ``nbytes`` of memory.

    dtype: compute dtype key of `GPUSpec.peak_flops` (fp8 on a GPU without it: ValueError).
    is_matmul: tensor-core op at ``gpu.efficiency(dtype)`` of the dtype's peak, unless
        ``efficiency`` overrides it (see `matmul_efficiency`); otherwise the fp32 vector peak.
    An op with neither flops nor bytes (a view) launches no kernel and costs 0.
    """
    if flops < 0 or nbytes < 0:
        raise ValueError(f"op_time: flops={flops} and nbytes={nbytes} must be >= 0")
    _check_dtype(dtype, gpu)
    if flops == 0 and nbytes == 0:
        return 0.0
    if is_matmul:
        eff = gpu.efficiency(dtype) if efficiency is None else efficiency
        rate = gpu.peak(dtype) * eff
    else:
        rate = gpu.peak("fp32")  # vector units; no derating, these ops are memory-bound
    compute = flops / rate
    memory = nbytes / (gpu.memory_bw * gpu.memory_efficiency)
    return max(gpu.kernel_floor_s, compute, memory)


# GEMM efficiency grows with the work per kernel: eff(F) = eff_max * F / (F + F_half), F = 2mnk.
# F_half fitted to 12 bf16 and fp8 GEMMs of transformer shapes (4096-16384 tokens, 2048-28672
# features) measured on an H200 (cost/profiles/h200_block_check.json):
# mean error 5.0 % (bf16), 3.4 % (fp8); eff_max is GPUSpec.efficiency(dtype).
GEMM_HALF_EFFICIENCY_FLOPS = {"bf16": 1.78e10, "fp16": 1.78e10, "fp8": 4.47e10}


def gemm_efficiency(flops, gpu: GPUSpec, dtype: str = "bf16", half_scale: float = 1.0):
    """Fraction of peak a GEMM of ``flops`` (a number or a numpy array) reaches on ``gpu``.

    half_scale: F_half relative to the H200 fit (`cost.params.CostParams.gemm_half_scale`)."""
    if gpu.is_cpu:
        # CPU rates come from `autopar calibrate`: achieved rates, no GPU launch-latency curve
        return flops * 0 + gpu.efficiency(dtype)  # same shape as flops (number or array)
    half = half_scale * GEMM_HALF_EFFICIENCY_FLOPS.get(dtype, GEMM_HALF_EFFICIENCY_FLOPS["bf16"])
    return gpu.efficiency(dtype) * flops / (flops + half)


def matmul_efficiency(m: int, n: int, k: int, gpu: GPUSpec, dtype: str = "bf16") -> float:
    """Fraction of peak an (m x k) @ (k x n) GEMM reaches: `gemm_efficiency` of its 2mnk FLOPs."""
    if min(m, n, k) < 1:
        raise ValueError(f"matmul_efficiency: dims ({m}, {n}, {k}) must be >= 1")
    return float(gemm_efficiency(2.0 * m * n * k, gpu, dtype))


def matmul_time(m: int, n: int, k: int, dtype: str, gpu: GPUSpec, batch: int = 1) -> float:
    """Seconds for ``batch`` GEMMs (m x k) @ (k x n): 2*m*n*k flops each, inputs read once in
    ``dtype`` and the output written once (bf16 for fp8)."""
    _check_dtype(dtype, gpu)
    flops = 2.0 * batch * m * n * k
    nbytes = batch * ((m * k + k * n) * DTYPE_BYTES[dtype] + m * n * MATMUL_OUT_BYTES[dtype])
    eff = matmul_efficiency(m, n, k, gpu, dtype)
    return op_time(flops, nbytes, dtype, gpu, is_matmul=True, efficiency=eff)
