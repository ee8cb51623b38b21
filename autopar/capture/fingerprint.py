"""What identifies a captured step: the keys of the capture caches, and a plan's model.

A captured graph bakes in everything the forward read besides the parameter and buffer values:
module attributes (``self.scale = 100``, a config), train/eval mode (dropout, BatchNorm), dtypes,
plain tensor attributes (lifted as constants), the loss function and the input shapes. A cache
keyed on less returns a wrong graph silently, so `step_key` hashes all of it; what it cannot read
(an arbitrary object attribute) it keys by identity, which only costs a re-capture.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

_SKIP = {"_parameters", "_buffers", "_modules", "_non_persistent_buffers_set", "training",
         # recurrent modules' views of their own parameters (keyed above): a capture leaves
         # its traced stand-ins there, which cannot be read outside the trace
         "_flat_weights", "_flat_weight_refs"}
_MAX_HASHED_NUMEL = 1 << 20  # hash a tensor attribute's values up to this size, else its identity


def model_fingerprint(model: nn.Module) -> str:
    """A short hash of parameter names and shapes: which model a plan was made for."""
    text = ";".join(f"{n}:{tuple(p.shape)}" for n, p in model.named_parameters())
    return hashlib.sha1(text.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class StepKey:
    """A cache key: the hash, and the objects hashed by identity (kept alive with the entry, so
    that their ids cannot be reused by other objects while the entry exists)."""

    digest: str
    pinned: tuple = field(default=(), compare=False, hash=False, repr=False)


class StepCache:
    """A small process-wide cache of captured steps, keyed by `step_key` (oldest evicted)."""

    def __init__(self, size: int = 4) -> None:
        self.size = size
        self._entries: dict[str, tuple[StepKey, object]] = {}

    def get(self, key: StepKey, make: Callable[[], object]) -> object:
        """The entry for ``key``, made by ``make()`` on a miss."""
        if key.digest not in self._entries:
            value = make()
            if len(self._entries) >= self.size:
                self._entries.pop(next(iter(self._entries)))
            self._entries[key.digest] = (key, value)
        return self._entries[key.digest][1]

    def clear(self) -> None:
        """Forget every entry."""
        self._entries.clear()


def step_key(model: nn.Module, inputs: Sequence[torch.Tensor], loss_fn: Callable | None,
             *extra: object) -> StepKey:
    """A key for everything that changes the captured graph of ``model`` on ``inputs``."""
    h = _Hasher()
    for name, sub in model.named_modules(remove_duplicate=False):
        h.update(f"|{name}:{type(sub).__module__}.{type(sub).__qualname__}:{sub.training}".encode())
        for attr, value in sorted(vars(sub).items()):
            if attr not in _SKIP and not attr.startswith("_forward") and not attr.startswith("_backward"):
                h.update(f";{attr}=".encode())
                _feed(h, value)
        for kind, tensors in (("p", sub._parameters), ("b", sub._buffers)):
            for tname, t in tensors.items():
                if t is not None:
                    h.update(f";{kind}:{tname}:{tuple(t.shape)}:{t.dtype}:{t.requires_grad}".encode())
    # which parameters are one tensor (tied embeddings): the graph reads a tied weight once
    first: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if first.setdefault(id(p), name) != name:
            h.update(f"|tied:{name}={first[id(p)]}".encode())
    for x in inputs:
        h.update(f"|in:{tuple(x.shape)}:{x.dtype}".encode())
    h.update(f"|loss:{_identity(loss_fn, h)}".encode())
    for e in extra:
        h.update(f"|{e!r}".encode())
    return StepKey(h.hexdigest(), tuple(h.pinned))


class _Hasher:
    def __init__(self) -> None:
        self._sha = hashlib.sha1()
        self.pinned: list = []

    def update(self, data: bytes) -> None:
        self._sha.update(data)

    def hexdigest(self) -> str:
        return self._sha.hexdigest()


def _feed(h, value, depth: int = 0) -> None:
    """Feed a stable description of an attribute's value to the hash."""
    if depth > 4:
        h.update(f"<deep {_identity(value, h)}>".encode())
    elif value is None or isinstance(value, (bool, int, float, complex, str, bytes, torch.dtype,
                                             torch.device, enum.Enum)):
        h.update(repr(value).encode())
    elif isinstance(value, (list, tuple, set, frozenset)):
        items = sorted(value, key=repr) if isinstance(value, (set, frozenset)) else value
        h.update(f"{type(value).__name__}[".encode())
        for v in items:
            _feed(h, v, depth + 1)
            h.update(b",")
        h.update(b"]")
    elif isinstance(value, dict):
        h.update(b"{")
        for k in sorted(value, key=repr):
            h.update(repr(k).encode() + b":")
            _feed(h, value[k], depth + 1)
        h.update(b"}")
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        h.update(type(value).__qualname__.encode())
        _feed(h, {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}, depth + 1)
    elif isinstance(value, torch.Tensor):
        h.update(f"tensor{tuple(value.shape)}{value.dtype}".encode())
        # a tensor subclass (a trace's FakeTensor or FunctionalTensor) has no readable values
        plain = type(value) in (torch.Tensor, nn.Parameter, nn.Buffer) and not isinstance(value, FakeTensor)
        real = plain and value.device.type != "meta"
        if real and value.numel() <= _MAX_HASHED_NUMEL:
            h.update(value.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()
                     if value.numel() else b"")
        else:
            h.update(_identity(value, h).encode())
    else:
        h.update(_identity(value, h).encode())


def _identity(value: object, h: _Hasher) -> str:
    if value is not None:
        h.pinned.append(value)
    return f"{type(value).__qualname__}@{id(value):x}"
