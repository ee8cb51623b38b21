"""A measured step's Chrome trace (`ParallelModule.profile_step`, torch.profiler) read as tracks.

`label_trace` adds to torch.profiler's events the predicted timeline's track vocabulary
(`autopar.planning.timeline`): each event carries ``args["autopar_track"]``, "compute" or the
collective kind ("communication" for c10d / gloo / nccl collectives, "pipeline p2p" for sends
and receives), and `profile_step` wraps the step in "autopar forward" / "autopar backward" ranges.

The summary's split, on the profiling rank's CPU thread: communication_s is the length of the
union of the collective events' intervals (a collective inside another counts once),
compute_s = total_s - communication_s, total_s the step's wall time (forward + backward).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

_P2P = re.compile(r"send|recv|isend|irecv|batch_isend_irecv", re.I)
_COLLECTIVE = re.compile(r"c10d::|gloo:|nccl:|all_?reduce|all_?gather|reduce_?scatter|broadcast|"
                         r"all_to_all|alltoall|barrier|_?wait_tensor|" + _P2P.pattern, re.I)


def track_of(name: str) -> str:
    """The timeline track of a profiler event by its name: "pipeline p2p", "communication"
    or "compute"."""
    if not _COLLECTIVE.search(name):
        return "compute"
    return "pipeline p2p" if _P2P.search(name) else "communication"


def _union_s(intervals: list[tuple[float, float]]) -> float:
    """Total length of the union of [start, end) intervals (microseconds in, seconds out)."""
    total, cur_s, cur_e = 0.0, None, None
    for s, e in sorted(intervals):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total * 1e-6


def label_trace(trace: dict) -> dict[str, float]:
    """Tag the trace's complete events with their track; return the communication seconds."""
    comm = []
    for ev in trace.get("traceEvents", []):
        if ev.get("ph") != "X":
            continue
        track = track_of(str(ev.get("name", "")))
        ev.setdefault("args", {})["autopar_track"] = track
        if track != "compute":
            comm.append((float(ev["ts"]), float(ev["ts"]) + float(ev.get("dur", 0.0))))
    return {"communication_s": _union_s(comm)}


def read_measured(path: str | Path) -> dict[str, float]:
    """Seconds per track of a measured trace: {"compute", "communication", "pipeline p2p",
    "total"}, each the union of its events' intervals on the trace's busiest process."""
    trace = json.loads(Path(path).read_text())
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    if not events:
        raise ValueError(f"{path}: no complete (X) events: not a torch.profiler Chrome trace")
    by_track: dict[str, list[tuple[float, float]]] = {}
    for e in events:
        track = e.get("args", {}).get("autopar_track") or track_of(str(e.get("name", "")))
        by_track.setdefault(track, []).append((float(e["ts"]), float(e["ts"]) + float(e["dur"])))
    every = [iv for ivs in by_track.values() for iv in ivs]
    out = {t: _union_s(ivs) for t, ivs in by_track.items() if t != "compute"}
    total = (max(e for _, e in every) - min(s for s, _ in every)) * 1e-6
    out["total"] = total
    out["compute"] = max(total - sum(v for k, v in out.items() if k != "total"), 0.0)
    return out
