"""autopar: automatic parallelisation of PyTorch training steps.

Capture a single-device model's training step as a graph, predict and choose how to spread it
over a cluster, and run it on torch.distributed.
"""

from autopar import models
from autopar.capture.joint import TrainingGraph, capture
from autopar.errors import AutoparError, CaptureError, InputError
from autopar.execution.parallelize import ParallelModule, parallelize
from autopar.planning.plan import Plan
from autopar.planning.planner import plan
from cost import Cluster, Layout, LayoutError

__version__ = "0.1.0"

__all__ = [
    "AutoparError",
    "CaptureError",
    "Cluster",
    "InputError",
    "Layout",
    "LayoutError",
    "ParallelModule",
    "Plan",
    "TrainingGraph",
    "capture",
    "models",
    "parallelize",
    "plan",
]
