"""Measured training runs: read a runs file, check every row, and predict each run.

A runs file is a CSV with one row per run of one layout on one cluster, as the Ultra-Scale
Playbook publishes its benchmark grid (``shared/reference/playbook-runs-1b-8b.csv``):

    model,nodes,dp,tp,pp,zero,mbs,grad_acc,tok_s_gpu[,gbs_seqs,mfu_pct,tok_s,gpu_mem_gb,seq,cp]

``model``: a zoo name (``autopar.models.names()``) or one of the playbook's short names
(1B, 3B, 8B, 80B); ``tok_s_gpu`` empty or ``nan`` where the run did not finish (out of memory,
mostly). The global batch is what ran, dp * mbs * grad_acc sequences of ``seq`` tokens (4096
unless the file has a ``seq`` column). Runs are priced as the playbook ran them: bf16 with fp32
gradient accumulation, SP where tp > 1, 1F1B, no recomputation.
"""

from __future__ import annotations

import csv
import dataclasses
import functools
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from autopar import models
from autopar.search.choices import choose
from cost.cluster import Cluster
from cost.params import CostParams
from cost.step import predict, predict_memory
from cost.step_facts import StepFacts
from vocab.layout import Layout, LayoutError

REQUIRED = ("model", "nodes", "dp", "tp", "pp", "zero", "mbs", "grad_acc", "tok_s_gpu")
# the playbook's names for its model shapes (shared/reference/playbook-facts.md)
ALIASES = {"1b": "playbook-1b", "3b": "playbook-3b", "8b": "playbook-8b", "80b": "playbook-80b"}
DEFAULT_SEQ = 4096


class RunsError(ValueError):
    """A runs file that cannot be used: the message names the row, the problem and the fix."""


@dataclass(frozen=True)
class Run:
    """One measured run: where it ran, its layout, and what it measured.

    tok_s_gpu: measured tokens/s per GPU, None where the run failed. gpu_mem_gb: measured peak
    memory per GPU (GB), None where not measured. row: its line in the file (header = 1).
    """

    row: int
    model: str
    nodes: int
    layout: Layout
    seq: int
    tok_s_gpu: float | None
    gpu_mem_gb: float | None
    skip: str = ""  # why the run cannot be used (kept, reported, left out of fits and scores)

    @property
    def trained(self) -> bool:
        """Whether the run finished (has a throughput)."""
        return self.tok_s_gpu is not None

    @property
    def cell(self) -> tuple[str, int]:
        """(model, nodes): the group of runs that compete for one cluster."""
        return (self.model, self.nodes)

    @property
    def global_batch(self) -> int:
        """Sequences per step: dp * microbatch * grad_accum."""
        return self.layout.global_batch


def model_name(name: str) -> str:
    """The zoo name of a runs file's ``model`` (a zoo name or a playbook short name)."""
    key = name.strip().lower()
    key = ALIASES.get(key, key)
    if key not in models.names():
        raise KeyError(name)
    return key


def _number(text: str) -> float | None:
    text = (text or "").strip()
    if not text or text.lower() in ("nan", "none", "null", "-"):
        return None
    return float(text)


def read_runs(path: str | os.PathLike, gpus_per_node: int = 8) -> list[Run]:
    """Every row of a runs file as a `Run`; `RunsError` naming the first bad row and the fix.

    Checked: the required columns exist; integers are integers >= 1 (zero 0-3); the degrees
    multiply to nodes * ``gpus_per_node``; the model is known; a throughput is > 0 or absent.
    A row whose dp * mbs * grad_acc differs from its gbs_seqs is kept with a `Run.skip`
    reason (`usable` leaves it out): the file cannot say which batch ran.
    """
    source = Path(path)
    if not source.exists():
        raise RunsError(f"no runs file at {source}; pass a CSV with columns {', '.join(REQUIRED)}")
    with source.open(newline="") as f:
        reader = csv.DictReader(f)
        header = [h.strip() for h in (reader.fieldnames or [])]
        missing = [c for c in REQUIRED if c not in header]
        if missing:
            raise RunsError(f"{source}: the header lacks {', '.join(missing)}; a runs file needs "
                            f"the columns {', '.join(REQUIRED)} (see autopar/calibrate/runs.py)")
        runs = [_parse_row(source, i, {k.strip(): v for k, v in row.items() if k}, gpus_per_node)
                for i, row in enumerate(reader, start=2)]
    if not runs:
        raise RunsError(f"{source} holds no runs; add one row per measured layout")
    if not any(r.trained for r in runs):
        raise RunsError(f"{source}: no run has a throughput (tok_s_gpu); a fit needs runs that "
                        "trained")
    return runs


def _parse_row(source: Path, line: int, row: dict, gpus_per_node: int) -> Run:
    where = f"{source}, row {line}"
    try:
        model = model_name(row["model"])
    except KeyError:
        raise RunsError(f"{where}: unknown model {row['model']!r}; use a zoo name "
                        f"({', '.join(models.names())}) or a playbook name "
                        f"({', '.join(sorted(k.upper() for k in ALIASES))})") from None
    ints = {}
    for col in ("nodes", "dp", "tp", "pp", "zero", "mbs", "grad_acc", "seq", "cp"):
        text = (row.get(col) or "").strip()
        if col in ("seq", "cp") and not text:
            continue
        try:
            value = int(float(text))
            if value != float(text):
                raise ValueError
        except ValueError:
            raise RunsError(f"{where}: {col}={text!r} is not an integer; write a whole number"
                            ) from None
        low = 0 if col == "zero" else 1
        if value < low or (col == "zero" and value > 3):
            raise RunsError(f"{where}: {col}={value} is out of range; {col} must be "
                            + ("0, 1, 2 or 3" if col == "zero" else ">= 1"))
        ints[col] = value
    cp = ints.get("cp", 1)
    world = ints["nodes"] * gpus_per_node
    if ints["dp"] * ints["tp"] * ints["pp"] * cp != world:
        raise RunsError(f"{where}: dp*tp*pp*cp = {ints['dp']}*{ints['tp']}*{ints['pp']}*{cp} = "
                        f"{ints['dp'] * ints['tp'] * ints['pp'] * cp} but {ints['nodes']} nodes "
                        f"of {gpus_per_node} GPUs hold {world}; fix the degrees or the node "
                        "count (or pass --gpus-per-node)")
    try:
        tps = _number(row.get("tok_s_gpu", ""))
        mem = _number(row.get("gpu_mem_gb", ""))
    except ValueError:
        raise RunsError(f"{where}: tok_s_gpu={row.get('tok_s_gpu')!r} / gpu_mem_gb="
                        f"{row.get('gpu_mem_gb')!r} is not a number; write a number, or leave "
                        "it empty (or nan) for a run that did not finish") from None
    if tps is not None and (not math.isfinite(tps) or tps <= 0):
        raise RunsError(f"{where}: tok_s_gpu={tps:g} must be > 0; leave it empty (or nan) for a "
                        "run that did not finish")
    layout = Layout(dp=ints["dp"], tp=ints["tp"], pp=ints["pp"], cp=cp, zero=ints["zero"],
                    sp=ints["tp"] > 1, microbatch=ints["mbs"], grad_accum=ints["grad_acc"],
                    precision="bf16", fp32_grad_accum=True)
    skip = ""
    gbs = (row.get("gbs_seqs") or "").strip()
    if gbs and gbs.replace(".", "", 1).isdigit() and int(float(gbs)) != layout.global_batch:
        skip = (f"dp*mbs*grad_acc = {layout.global_batch} sequences but gbs_seqs = {gbs}: which "
                "batch ran is unknown")
    return Run(row=line, model=model, nodes=ints["nodes"], layout=layout,
               seq=ints.get("seq", DEFAULT_SEQ), tok_s_gpu=tps,
               gpu_mem_gb=mem if tps is not None else None, skip=skip)


def usable(runs: Sequence[Run]) -> tuple[list[Run], list[Run]]:
    """(runs to fit and score, runs left out with their `Run.skip` reason)."""
    return [r for r in runs if not r.skip], [r for r in runs if r.skip]


def skipped_note(skipped: Sequence[Run]) -> str:
    """One line naming the rows left out and why (empty when none)."""
    if not skipped:
        return ""
    rows = ", ".join(str(r.row) for r in skipped[:12]) + (" ..." if len(skipped) > 12 else "")
    return (f"left out {len(skipped)} rows whose degrees and gbs_seqs disagree on the global "
            f"batch (rows {rows}); fix the file to use them")


class RunPricer:
    """Predicts runs with `cost.step.predict`, as `autopar.plan(..., layout=...)` prices them.

    Each (model, seq) is captured once on fake tensors (seconds per model) and rebatched to
    each run's global batch; clusters are built once per node count from ``cluster`` (a
    profile name) and given the parameters to price with on every call.
    """

    def __init__(self, cluster: str = "h100-efa", gpus_per_node: int = 8,
                 progress: Callable[[str], None] | None = None):
        self.cluster_name = cluster
        self.gpus_per_node = gpus_per_node
        self.progress = progress
        self._captured: dict[tuple[str, int], object] = {}
        self._facts: dict[tuple, StepFacts] = {}  # (model, seq, global batch, tp, kind)
        self._clusters: dict[int, Cluster] = {}

    def cluster(self, nodes: int, params=None) -> Cluster:
        """The cluster of ``nodes`` nodes, pricing with ``params`` (its profile's if None)."""
        if nodes not in self._clusters:
            self._clusters[nodes] = Cluster(self.cluster_name, nodes=nodes,
                                            gpus_per_node=self.gpus_per_node)
            self._profile_params = self._clusters[nodes].params
        c = self._clusters[nodes]
        # every call says which parameters it prices with: never the last caller's
        c.params = params if params is not None else self._profile_params
        return c

    def run_cluster(self, run: Run, params=None) -> Cluster:
        """The cluster ``run`` ran on, pricing with ``params`` (a subclass prices runs of
        several GPU kinds; here every run is on ``cluster`` at its node count)."""
        return self.cluster(run.nodes, params)

    def facts(self, run: Run) -> StepFacts:
        """The step facts of ``run``'s model at its global batch, TP roles for its degree."""
        key = (run.model, run.seq, run.global_batch, run.layout.tp, self._kind(run))
        if key not in self._facts:
            step = self._step(run)
            base = step.facts_for(self.run_cluster(run), run.layout)
            # the runs' framework cut its pipelines by compute, not under each stage's memory:
            # priced so, a run that ran out of memory is not made to fit by a better cut; and it
            # does not all-reduce a token count every step (autopar's runtime does); its loss
            # is a fused or vocabulary-parallel cross-entropy, its full recompute checkpoints
            # whole blocks, its pipelines' gradient reduction overlaps the last backward, it
            # runs FlashAttention-2's kernels and a ring (if any) of expanded K/V heads
            # (Megatron-LM, nanotron, llm-foundry: `StepFacts`)
            self._facts[key] = self.framework_facts(run, dataclasses.replace(
                base.rebatch(run.global_batch), memory_cuts=False, counts_tokens=False,
                framework_memory=True, pipeline_reduce_hidden=True, native_attention=False,
                cp_kv_heads=False))
        return self._facts[key]

    def framework_facts(self, run: Run, facts: StepFacts) -> StepFacts:
        """``facts`` as ``run``'s framework communicates beyond the above (a subclass whose runs
        name their framework says; here: unchanged)."""
        return facts

    def _kind(self, run: Run) -> str:
        """What of the cluster the facts depend on besides the run (its GPU kind)."""
        return self.cluster_name

    def model_for(self, run: Run):
        """(model on the meta device, example inputs of 8 sequences) of ``run``'s model."""
        module = models.build(run.model, device="meta")
        return module, models.example_inputs(run.model, batch=8, seq=run.seq, device="meta")

    def _step(self, run: Run):
        import torch

        from autopar.search.step import captured_step

        key = (run.model, run.seq)
        if key not in self._captured:
            if self.progress:
                self.progress(f"capturing {run.model} (seq {run.seq}) on fake tensors ...")
            module, inputs = self.model_for(run)
            self._captured[key] = captured_step(module, inputs, None, torch.bfloat16)
        return self._captured[key]

    def clear(self) -> None:
        """Drop the predictions memoised under old parameters (the facts stay)."""
        for f in self._facts.values():
            f.clear_cache()

    def price(self, runs: Sequence[Run], params=None, memory_only: bool = False) -> Priced:
        """Predicted tok/s/GPU, fits and memory (bytes) of every run under ``params``.

        A layout the model rejects (e.g. more stages than blocks) is priced as not running:
        throughput 0, memory inf."""
        n = len(runs)
        tps, mem, cap = np.zeros(n), np.full(n, np.inf), np.zeros(n)
        valid = np.zeros(n, dtype=bool)
        for i, run in enumerate(runs):
            try:
                # first: building a run's facts sets the shared cluster to the profile's own
                # parameters, which the run must not be priced with
                facts = self.facts(run)
            except LayoutError:
                facts = None
            cluster = self.run_cluster(run, params)
            # the memory model itself: the planner's margin (`CostParams.memory_headroom`) is
            # not what a run holds; `bench.playbook` ranks with it
            cluster.params = _without_headroom(cluster.params)
            cap[i] = cluster.gpu.memory_bytes
            if facts is None:
                continue
            try:
                layout = choose(facts, cluster, run.layout)
                m = predict_memory(facts, cluster, layout)
                if not memory_only:
                    tps[i] = predict(facts, cluster, layout, memory=m).tokens_per_s_per_gpu
            except LayoutError:
                continue
            mem[i], valid[i] = m.total, True
        self.clear()
        return Priced(tps=tps, memory_bytes=mem, capacity_bytes=cap, valid=valid)


@functools.lru_cache(maxsize=64)
def _without_headroom(params: CostParams) -> CostParams:
    return params.replace(memory_headroom=0.0) if params.memory_headroom else params


@dataclass
class Priced:
    """Predictions for a list of runs, one entry per run."""

    tps: np.ndarray  # tok/s per GPU (0 where invalid or not priced)
    memory_bytes: np.ndarray  # fullest device (inf where invalid)
    capacity_bytes: np.ndarray
    valid: np.ndarray  # the model accepts the layout

    @property
    def fits(self) -> np.ndarray:
        """Predicted to fit in memory (and valid)."""
        return self.valid & (self.memory_bytes <= self.capacity_bytes)

    def select(self, mask) -> Priced:
        """The predictions of the runs where ``mask`` holds."""
        m = np.asarray(mask, dtype=bool)
        return Priced(self.tps[m], self.memory_bytes[m], self.capacity_bytes[m], self.valid[m])
