"""Errors a user can act on: each names the problem, where it is, and the fix."""

from __future__ import annotations

import functools
import linecache
import os
from dataclasses import dataclass


@functools.cache
def _torch_dir() -> str:
    """torch's own source directory (imported here, not at module import: the CLI's argument
    checks must not wait for torch)."""
    import torch

    return os.path.dirname(torch.__file__)


# Words in tracing errors that mean "this depends on tensor values".
_DATA_DEPENDENT = (
    "data-dependent",
    "data dependent",
    "guardondatadependent",
    "datadependentoutput",
    "_local_scalar_dense",
    "dynamicoutputshape",
)


class AutoparError(Exception):
    """Base class of autopar's user-facing errors."""


class InputError(AutoparError, ValueError):
    """Example inputs, a model name, a mesh or a cluster that do not fit: fix the argument."""


class CaptureError(AutoparError, RuntimeError):
    """The model's training step could not be captured as a graph."""

    @classmethod
    def from_exception(
        cls,
        exc: BaseException,
        module_names: dict[int, str],
        frame: UserFrame | None = None,
        preflight: bool = False,
    ) -> CaptureError:
        """Translate a tracing failure into a message with module, source line and fix."""
        frame = frame or locate_user_frame(exc, module_names)
        text = f"{type(exc).__name__}: {exc}".strip()
        first = text.splitlines()[0][:300] if text else type(exc).__name__
        lowered = text.lower()
        if any(k in lowered for k in _DATA_DEPENDENT):
            problem = "data-dependent control flow or shapes (a Python branch, .item() or a shape "
            problem += "that depends on tensor values)"
            fix = (
                "make the computation independent of tensor values: use torch.where or "
                "torch.cond for branches, fixed-size masks instead of nonzero()/boolean indexing, "
                "and keep .item()/.tolist() out of forward"
            )
        elif "numpy" in lowered or "data pointer" in lowered or "data_ptr" in lowered:
            problem = "an operation that needs real tensor data (numpy(), data_ptr, a C extension)"
            fix = "replace it with torch operations so the step can be traced on fake tensors"
        elif preflight:
            problem = "the example inputs do not fit the model"
            fix = "check the shapes and dtypes of example_inputs against what the module expects"
        elif "not implemented" in lowered or "no fake" in lowered or "meta" in lowered:
            problem = "an operator that cannot be traced (no fake/meta implementation)"
            fix = "replace the operator with a traceable torch op, or register a fake kernel for it"
        else:
            problem = "the step could not be traced"
            fix = "make forward traceable by torch.export (no data-dependent Python, no side effects)"
        where = frame.describe() if frame else "an unknown place (no frame of the model was found)"
        return cls(f"{problem} in {where}.\n  error: {first}\n  fix: {fix}")


@dataclass(frozen=True)
class UserFrame:
    """The innermost frame of the user's model code in a traceback."""

    module: str  # qualified name of the nn.Module whose code ran ("" = the root)
    module_type: str
    filename: str
    lineno: int

    def describe(self) -> str:
        """``module `layers.0.mlp` (MoE), file.py:42: <the line>``."""
        line = linecache.getline(self.filename, self.lineno).strip()
        name = self.module or "<root>"
        return f"module `{name}` ({self.module_type}), {self.filename}:{self.lineno}: {line}"


def locate_user_frame(exc: BaseException, module_names: dict[int, str]) -> UserFrame | None:
    """Find the innermost traceback frame that runs a method of one of the user's modules.

    Frames inside torch itself are skipped, so a failure deep in a kernel is blamed on the line
    of model code that called it. Chained exceptions are searched too.
    """
    best = None
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        tb = exc.__traceback__
        while tb is not None:
            frame = tb.tb_frame
            self_obj = frame.f_locals.get("self")
            if (
                self_obj is not None
                and id(self_obj) in module_names
                and not frame.f_code.co_filename.startswith(_torch_dir())
            ):
                best = UserFrame(
                    module=module_names[id(self_obj)],
                    module_type=type(self_obj).__name__,
                    filename=frame.f_code.co_filename,
                    lineno=tb.tb_lineno,
                )
            tb = tb.tb_next
        if best is not None:
            return best
        exc = exc.__cause__ or exc.__context__
    return best
