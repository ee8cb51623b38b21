"""autopar: automatic parallelisation of PyTorch training steps.

Capture a single-device model's training step as a graph, predict and choose how to spread it
over a cluster, and run it on torch.distributed.
"""

import importlib

from autopar.errors import AutoparError, CaptureError, InputError
from cost import Cluster, Layout, LayoutError

__version__ = "0.1.0"

# The rest loads on first use (PEP 562): `import torch` alone takes about 3 s on a small box,
# and the CLI answers a bad argument before it needs any of it.
_LAZY = {
    "models": ("autopar.models", None),
    "TrainingGraph": ("autopar.capture.joint", "TrainingGraph"),
    "ParallelModule": ("autopar.execution.module", "ParallelModule"),
    "parallelize": ("autopar.execution.parallelize", "parallelize"),
    "Plan": ("autopar.planning.plan", "Plan"),
    "plan": ("autopar.planning.planner", "plan"),
}


importlib.import_module("autopar.capture")  # the (empty) package, bound first: see capture below


def capture(*args, **kwargs):
    """`autopar.capture.joint.capture`: the model's training step as one joint aten graph.

    Defined here, after the (empty) `autopar.capture` package is imported, so that the name
    is this function and not the package once anything imports `autopar.capture.joint`.
    """
    from autopar.capture.joint import capture as run

    return run(*args, **kwargs)


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'autopar' has no attribute {name!r}")
    module, attribute = _LAZY[name]
    value = importlib.import_module(module)
    value = value if attribute is None else getattr(value, attribute)
    globals()[name] = value  # once: later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


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
