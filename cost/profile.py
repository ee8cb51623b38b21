"""Fitted cost profiles: the file `autopar calibrate --runs` writes and `Cluster.from_profile`
reads.

Format (JSON, version 1)::

    {"version": 1, "kind": "autopar-cost-profile",
     "base": "h100-efa",                      # the named profile the links come from
     "params": {"framework_efficiency": 0.8, ...},   # cost.params.CostParams, all of them
     "fit": {...}}                            # how they were fitted: data, residuals, bounds

``fit`` is a report for people (which runs, how many, the residuals, in-sample or not); nothing
reads it back but `describe_fit`.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from .params import CostParams

# 2: `CostParams.attention_efficiency` is a share of the GPU's FlashAttention-2 rate, no longer
# of its GEMM rate: a version-1 value would price attention about 2x slower; 3: a share of the
# rate measured on an H200 against length and head dim (`cost.hardware`), no longer of the
# FlashAttention-3 paper's figure: a version-2 value would price it about 1.3x slower
PROFILE_VERSION = 3
PROFILE_KIND = "autopar-cost-profile"


@dataclass
class CostProfile:
    """A fitted profile: the base cluster profile, the fitted parameters, the fit's report."""

    base: str
    params: CostParams
    fit: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        """JSON-safe dict in the file format."""
        return {"version": PROFILE_VERSION, "kind": PROFILE_KIND, "base": self.base,
                "params": self.params.to_dict(), "fit": self.fit}

    @classmethod
    def from_dict(cls, data: dict, where: str = "profile") -> CostProfile:
        """Validate and build; ValueError naming the problem and the fix."""
        fix = "write it with `autopar calibrate --runs RUNS.csv --cluster NAME -o FILE`"
        if not isinstance(data, dict) or data.get("kind") != PROFILE_KIND:
            raise ValueError(f"{where} is not an autopar cost profile (no \"kind\": "
                             f"\"{PROFILE_KIND}\"); {fix}")
        if data.get("version") != PROFILE_VERSION:
            raise ValueError(f"{where}: profile version {data.get('version')!r} is not supported "
                             f"(expected {PROFILE_VERSION}); {fix}")
        for key in ("base", "params"):
            if key not in data:
                raise ValueError(f"{where} lacks {key!r}; {fix}")
        return cls(base=str(data["base"]), params=CostParams.from_dict(data["params"]),
                   fit=dict(data.get("fit") or {}))


def load_profile(path: str | os.PathLike) -> CostProfile:
    """Read a profile file; FileNotFoundError naming the path, ValueError if malformed."""
    source = Path(path)
    if not source.exists():
        raise FileNotFoundError(f"no cost profile at {source}; write one with `autopar calibrate "
                                "--runs RUNS.csv --cluster NAME -o FILE`")
    try:
        data = json.loads(source.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{source} is not valid JSON ({exc})") from exc
    return CostProfile.from_dict(data, where=str(source))


def save_profile(profile: CostProfile, path: str | os.PathLike) -> Path:
    """Write ``profile`` atomically (a reader never sees half a file)."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".profile.", dir=target.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(profile.to_dict(), f, indent=1)
            f.write("\n")
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target


# the layout fields whose values a fit can only judge where its runs had them
COVERAGE_FIELDS = ("zero", "recompute", "cp", "ep", "precision", "fp8", "schedule")


def coverage_notes(layout, coverage: dict | None, source: str = "the fitted profile",
                   nodes: int | None = None) -> list[str]:
    """Where ``layout`` (on ``nodes`` nodes, when given) leaves what the fit's runs covered
    (``coverage``: field -> values seen), one sentence each: the prediction there extrapolates
    the fit."""
    if not coverage:
        return []
    notes = []
    seen_nodes = coverage.get("nodes")
    if nodes is not None and seen_nodes and not min(seen_nodes) <= nodes <= max(seen_nodes):
        notes.append(f"{source} was fitted on runs of {min(seen_nodes)}-{max(seen_nodes)} nodes, "
                     f"none on {nodes}: this prediction extrapolates the fit")
    for name in COVERAGE_FIELDS:
        seen = coverage.get(name)
        value = getattr(layout, name, None)
        if name == "schedule" and layout.pp == 1:
            continue
        if seen is not None and value not in seen:
            notes.append(f"{source} was fitted on runs with {name} in {sorted(seen, key=str)}, "
                         f"none with {name}={value!r}: this part of the prediction extrapolates "
                         "the fit (the data cannot judge it)")
    return notes


def coverage_within(layout, coverage: dict | None, source: str = "the fitted profile",
                    nodes: int | None = None, model: str | None = None) -> str | None:
    """A sentence saying that ``layout`` (on ``nodes`` nodes) lies inside what the fit's runs
    covered, and whether ``model`` was among their models; None where the layout leaves them
    (`coverage_notes` says where), where the coverage does not record every field (a profile
    fitted before a field was recorded cannot say), or without a fit."""
    if not coverage or coverage_notes(layout, coverage, source, nodes) \
            or any(n not in coverage for n in COVERAGE_FIELDS):
        return None
    values = ", ".join(f"{n}={getattr(layout, n)!r}" for n in COVERAGE_FIELDS
                       if not (n == "schedule" and layout.pp == 1))
    seen_nodes, models = coverage.get("nodes"), coverage.get("models") or []
    span = f" on {min(seen_nodes)}-{max(seen_nodes)} nodes" if seen_nodes else ""
    of = f" of {', '.join(models)}" if models else ""
    known = model is None or model in models
    return (f"{source} was fitted on measured runs{of} with {values}{span}: this layout lies "
            "inside them" + ("" if known else f"; {model} was not among their models"))
