"""The calibration file that `autopar calibrate` writes and `Cluster.local()` reads.

Format (JSON, version 1)::

    {"version": 1, "host": "...", "date": "...", "world_size": 4,
     "matmul_flops": {"fp32": 1.5e11, "bf16": 4e10}, "memory_bw": 1.0e10,
     "kernel_floor_s": 2e-5, "memory_bytes": 6.4e10,            # memory_bytes optional
     "collectives": {"all_reduce": {"latency_s": 1e-4, "busbw": 1e9}, "all_gather": {...},
                     "reduce_scatter": {...}, "all_to_all": {...}, "send_recv": {...}}}

``matmul_flops`` are achieved FLOP/s of a large matmul per dtype, ``memory_bw`` achieved copy
bandwidth (bytes read + written per second), ``kernel_floor_s`` the time of a tiny op. Each
collective is an alpha-beta fit at ``world_size`` ranks in nccl-tests conventions: ``latency_s``
the small-message time, ``busbw`` the large-message bus bandwidth (B/s). A subset of the
collectives may be present; the measuring side decides which it can run.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CALIBRATION_VERSION = 1
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")
ENV_VAR = "AUTOPAR_CALIBRATION"
_KNOWN_KEYS = {
    "version",
    "host",
    "date",
    "world_size",
    "matmul_flops",
    "memory_bw",
    "kernel_floor_s",
    "memory_bytes",
    "collectives",
}


@dataclass(frozen=True)
class CollectiveFit:
    """Alpha-beta fit of one collective: time(K) = latency_s + traffic(K) / busbw."""

    latency_s: float
    busbw: float


@dataclass
class Calibration:
    """Measurements of this machine, as written by `autopar calibrate` (see module docstring)."""

    world_size: int
    matmul_flops: dict[str, float]
    memory_bw: float
    kernel_floor_s: float
    collectives: dict[str, CollectiveFit] = field(default_factory=dict)
    host: str = ""
    date: str = ""
    memory_bytes: float | None = None
    version: int = CALIBRATION_VERSION
    # Other top-level keys the measuring side writes ("torch", "raw", ...), kept verbatim.
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def pipeline_overhead_s(self) -> float:
        """Host seconds of one stage-to-stage transfer beyond the raw send/recv (PyTorch's
        pipelining schedule and stage bookkeeping), measured on a loaded 1F1B pipeline of the
        calibration's ranks (``pipeline.overhead_s``; 0 in files written before it was
        measured)."""
        return float(self.extra.get("pipeline", {}).get("overhead_s", 0.0))

    @property
    def pipeline_wait_per_compute(self) -> float:
        """Seconds a hand-off between local ranks waits per second of the stages' compute
        between hand-offs (a peer descheduled while ranks share the cores), measured with two
        stage weights (``pipeline.wait_per_compute``; 0 in older files)."""
        return float(self.extra.get("pipeline", {}).get("wait_per_compute", 0.0))

    @property
    def overlap_slowdown(self) -> float | None:
        """Step seconds a collective issued beside compute adds per second it takes alone,
        measured on the calibration's loaded ranks (``overlap.slowdown``; None in files written
        before it was measured: the cost model's default then)."""
        value = self.extra.get("overlap", {}).get("slowdown")
        return None if value is None else float(value)

    def to_dict(self) -> dict:
        """JSON-safe dict in the file format."""
        out = {
            "version": self.version,
            "host": self.host,
            "date": self.date,
            "world_size": self.world_size,
            "matmul_flops": dict(self.matmul_flops),
            "memory_bw": self.memory_bw,
            "kernel_floor_s": self.kernel_floor_s,
            "collectives": {
                k: {"latency_s": f.latency_s, "busbw": f.busbw} for k, f in self.collectives.items()
            },
        }
        if self.memory_bytes is not None:
            out["memory_bytes"] = self.memory_bytes
        for key, value in self.extra.items():
            out.setdefault(key, value)
        return out

    @classmethod
    def from_dict(cls, data: dict) -> Calibration:
        """Validate and build; ValueError naming the bad field and the fix."""
        fix = "re-run `autopar calibrate` to write a fresh file"
        if not isinstance(data, dict):
            raise ValueError(f"calibration must be a JSON object, got {type(data).__name__}; {fix}")
        version = data.get("version")
        if version != CALIBRATION_VERSION:
            raise ValueError(
                f"calibration version {version!r} is not supported (expected "
                f"{CALIBRATION_VERSION}); {fix}"
            )
        for key in ("world_size", "matmul_flops", "memory_bw", "kernel_floor_s", "collectives"):
            if key not in data:
                raise ValueError(f"calibration lacks {key!r}; {fix}")
        world_size = data["world_size"]
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(
                f"calibration world_size={world_size!r} must be an integer >= 1; {fix}"
            )
        overlap = data.get("overlap")
        if overlap is not None:
            value = overlap.get("slowdown") if isinstance(overlap, dict) else None
            if not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
                raise ValueError(f"calibration overlap {overlap!r} must be "
                                 f"{{\"slowdown\": a number in [0, 1]}}; {fix}")
        flops = {str(k): float(v) for k, v in data["matmul_flops"].items()}
        if not flops or any(v <= 0 for v in flops.values()):
            raise ValueError(f"calibration matmul_flops {flops} must hold positive rates; {fix}")
        collectives = {}
        for kind, fit in data["collectives"].items():
            if kind not in COLLECTIVES:
                raise ValueError(
                    f"calibration has unknown collective {kind!r}; known: {COLLECTIVES}"
                )
            try:
                lat, bw = float(fit["latency_s"]), float(fit["busbw"])
            except (KeyError, TypeError) as exc:
                raise ValueError(
                    f"calibration collective {kind!r} needs latency_s and busbw; {fix}"
                ) from exc
            if lat < 0 or bw <= 0:
                raise ValueError(
                    f"calibration collective {kind!r}: latency_s >= 0 and busbw > 0; {fix}"
                )
            collectives[kind] = CollectiveFit(lat, bw)
        for key in ("memory_bw", "kernel_floor_s"):
            if float(data[key]) <= 0:
                raise ValueError(f"calibration {key}={data[key]!r} must be positive; {fix}")
        memory_bytes = data.get("memory_bytes")
        extra = {k: v for k, v in data.items() if k not in _KNOWN_KEYS}
        return cls(
            world_size=world_size,
            matmul_flops=flops,
            memory_bw=float(data["memory_bw"]),
            kernel_floor_s=float(data["kernel_floor_s"]),
            collectives=collectives,
            host=str(data.get("host", "")),
            date=str(data.get("date", "")),
            memory_bytes=None if memory_bytes is None else float(memory_bytes),
            version=version,
            extra=extra,
        )


def default_calibration_path() -> Path:
    """$AUTOPAR_CALIBRATION if set, else ``~/.cache/autopar/calibration.json``."""
    env = os.environ.get(ENV_VAR)
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "autopar" / "calibration.json"


def save_calibration(data: Calibration | dict, path: str | os.PathLike | None = None) -> Path:
    """Validate ``data`` and write it atomically (a reader never sees half a file)."""
    cal = data if isinstance(data, Calibration) else Calibration.from_dict(data)
    target = Path(path) if path is not None else default_calibration_path()
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".calibration.", dir=target.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(cal.to_dict(), f, indent=1, sort_keys=True)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target


def load_calibration(path: str | os.PathLike | None = None) -> Calibration:
    """Read a calibration file; FileNotFoundError if absent, ValueError if malformed."""
    source = Path(path) if path is not None else default_calibration_path()
    try:
        data = json.loads(source.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{source} is not valid JSON ({exc}); re-run `autopar calibrate`") from exc
    return Calibration.from_dict(data)
