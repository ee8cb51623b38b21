"""Plain-text tables and number formatting shared by every report autopar prints."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np


def fmt_bytes(n: float) -> str:
    """1536 -> '1.50 KiB' (binary units, as memory is reported by allocators)."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


def fmt_count(n: float) -> str:
    """8.03e9 -> '8.03 B' (parameters and other counts)."""
    n = float(n)
    for div, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(n) >= div:
            return f"{n / div:.2f} {unit}"
    return f"{n:.0f}"


def fmt_flops(n: float) -> str:
    """3.1e15 -> '3.10 PFLOP'."""
    n = float(n)
    for div, unit in ((1e18, "EFLOP"), (1e15, "PFLOP"), (1e12, "TFLOP"), (1e9, "GFLOP"), (1e6, "MFLOP")):
        if abs(n) >= div:
            return f"{n / div:.2f} {unit}"
    return f"{n:.0f} FLOP"


def fmt_time(s: float) -> str:
    """Seconds with a unit that keeps 3 significant digits."""
    if s >= 1:
        return f"{s:.3g} s"
    if s >= 1e-3:
        return f"{s * 1e3:.3g} ms"
    return f"{s * 1e6:.3g} us"


def table(headers: Sequence[str], rows: Sequence[Sequence[object]], align: str | None = None) -> str:
    """A fixed-width text table; ``align`` is one char per column, 'l' or 'r' (default l)."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    align = align or "l" * len(headers)

    def line(row):
        parts = [c.rjust(w) if a == "r" else c.ljust(w) for c, w, a in zip(row, widths, align)]
        return "  ".join(parts).rstrip()

    sep = "  ".join("-" * w for w in widths)
    return "\n".join([line(cells[0]), sep] + [line(r) for r in cells[1:]])


def json_ready(obj):
    """Recursively turn numpy scalars, tuples and non-finite floats into plain JSON values."""
    if isinstance(obj, dict):
        return {str(k): json_ready(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_ready(v) for v in obj]
    if isinstance(obj, np.bool_):
        return bool(obj)
    if isinstance(obj, np.integer):
        return int(obj)
    if isinstance(obj, (np.floating, float)):
        value = float(obj)
        return value if math.isfinite(value) else None
    return obj
