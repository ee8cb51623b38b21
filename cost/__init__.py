"""Cost model: hardware and cluster profiles, compute, communication, memory and pipeline cost.

Every constant names its source next to it. This package imports nothing of autopar, passes or
runtime: the front hands it plain numbers.
"""

from cost.calibration import (
    COLLECTIVES,
    Calibration,
    CollectiveFit,
    default_calibration_path,
    load_calibration,
    save_calibration,
)
from cost.cluster import PROFILES, Cluster, Link
from cost.comm import DEFAULT_MESSAGE_BYTES, Group, axis_group, bus_bandwidth, collective_time
from cost.compute import DTYPE_BYTES, gemm_efficiency, matmul_efficiency, matmul_time, op_time
from cost.hardware import GPUS, GPUSpec, get_gpu
from cost.memory import (
    RESERVE_BYTES,
    MemoryBreakdown,
    activation_bytes_formula,
    buffer_bytes,
    model_state_bytes,
)
from cost.pipeline import bubble_fraction, in_flight_microbatches, pipeline_step_time
from cost.precision import PrecisionRecipe, recipe
from vocab.layout import Layout, LayoutError

__all__ = [
    "COLLECTIVES", "Calibration", "CollectiveFit", "default_calibration_path", "load_calibration",
    "save_calibration", "PROFILES", "Cluster", "Link", "DEFAULT_MESSAGE_BYTES", "Group",
    "axis_group", "bus_bandwidth", "collective_time", "DTYPE_BYTES", "matmul_efficiency",
    "matmul_time", "op_time", "gemm_efficiency", "GPUS", "GPUSpec", "get_gpu", "Layout", "LayoutError",
    "RESERVE_BYTES", "MemoryBreakdown", "activation_bytes_formula", "buffer_bytes",
    "model_state_bytes", "bubble_fraction", "in_flight_microbatches", "pipeline_step_time",
    "PrecisionRecipe", "recipe",
]
