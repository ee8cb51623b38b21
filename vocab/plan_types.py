"""The plan as plain data: every decision the solver takes, in the form the passes read.

The solver (autopar/search) writes a `PlanDecisions`; `autopar.Plan` holds it and round-trips it
through JSON; each pass takes its own part as one typed argument (`DataParallelPlan`,
`TensorParallelPlan`) and the runtime reads the rest (micro-batches, stages, and the pipeline
split's per-stage graphs, `PipelineGraphs`, which the split pass makes and the runtime runs).
This module imports nothing but the standard library and `vocab.layout` (torch.fx only for type
hints), so passes/ and runtime/ depend on the plan's data, never on the solver or the front that
produced it.

Placements use DTensor's vocabulary, per mesh axis, as the runtime really lays the parameter
out: ZeRO's row shards included (``Shard(0)`` on "dp"; when TP shards dim 0 too, the rows of the
TP shard, DTensor's ``_StridedShard(0, sf=tp)``), and a fused projection split per part
(``_StridedShard(0, sf=3)`` for GPT-2's q/k/v in one weight).
"""

from __future__ import annotations

import functools
import re
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from vocab.choices import RecomputeChoice
from vocab.layout import Layout

if TYPE_CHECKING:
    from torch.fx import GraphModule

REPLICATE, SHARD, STRIDED = "replicate", "shard", "strided"
LOSS = "<loss>"  # what the loss's accumulator input of a graph accumulates
MESH_ORDER = ("dp", "pp", "cp", "tp")  # outermost first; TP innermost (playbook rank order)


@dataclass(frozen=True)
class AxisPlacement:
    """How a tensor is laid out over one mesh axis: replicated, or split along ``dim``.

    split_factor > 1 (kind "strided"): the tensor is first cut into ``split_factor`` equal
    parts along ``dim`` and each part is split over the axis (rank i holds slice i of every
    part), as DTensor's ``_StridedShard``.
    """

    kind: str = REPLICATE
    dim: int | None = None
    split_factor: int = 1

    def __post_init__(self) -> None:
        if self.kind not in (REPLICATE, SHARD, STRIDED):
            raise ValueError(f"AxisPlacement.kind={self.kind!r}: replicate, shard or strided")
        if (self.kind == REPLICATE) != (self.dim is None):
            raise ValueError("AxisPlacement: a shard needs a dim, a replica none")
        if (self.kind == STRIDED) != (self.split_factor > 1):
            raise ValueError("AxisPlacement: strided placements have split_factor > 1")

    @classmethod
    def replicate(cls) -> AxisPlacement:
        return cls()

    @classmethod
    def shard(cls, dim: int, split_factor: int = 1) -> AxisPlacement:
        return cls(STRIDED if split_factor > 1 else SHARD, dim, split_factor)

    @property
    def is_shard(self) -> bool:
        return self.kind != REPLICATE

    def __str__(self) -> str:
        if self.kind == REPLICATE:
            return "Replicate()"
        if self.kind == SHARD:
            return f"Shard({self.dim})"
        return f"_StridedShard({self.dim}, sf={self.split_factor})"

    @classmethod
    def parse(cls, text: str) -> AxisPlacement:
        """Inverse of `str` (the JSON spelling)."""
        text = text.strip()
        if text in ("Replicate()", "Replicate"):
            return cls.replicate()
        if text.startswith("Shard(") and text.endswith(")"):
            return cls.shard(int(text[len("Shard("):-1]))
        if text.startswith("_StridedShard(") and text.endswith(")"):
            dim, sf = text[len("_StridedShard("):-1].split(",")
            return cls.shard(int(dim), int(sf.split("=")[-1]))
        raise ValueError(f"placement {text!r}: expected Shard(d), _StridedShard(d, sf=k) or Replicate()")


@dataclass(frozen=True)
class ParamPlan:
    """One parameter's decisions: its placement on every mesh axis, and why."""

    shape: tuple[int, ...]
    placements: dict[str, AxisPlacement]  # mesh axis -> placement, as it runs
    tp_role: str = "replicated"  # col | row | vocab | replicated (tp_recipe's roles)
    zero_sharded: bool = False  # ZeRO keeps 1/dp of its rows on each data-parallel rank
    fused_parts: int = 1  # a fused projection (q, k, v in one weight) split per part over TP


@dataclass(frozen=True)
class Fallback:
    """An op that runs replicated because it cannot run on shards, and why."""

    op: str
    reason: str


@dataclass(frozen=True)
class CommPlan:
    """Bucketing and prefetching of the data-parallel collectives."""

    bucket_bytes: int = 25 * 2**20  # DDP's default bucket_cap_mb
    first_bucket_bytes: int = 2**20  # DDP's first bucket: the first reduction starts early
    prefetch_blocks: int = 1  # ZeRO gathers the next block's weights while one computes
    reduce_scatter: bool = True  # ZeRO reduces by reduce-scatter (False: all-reduce, gloo)
    # the forward's SP all-gathers cut into this many sequence chunks, each chunk's matmuls
    # running while the next is gathered (`passes.async_tp`); 1: one gather, waited whole
    sp_gather_chunks: int = 1
    # ZeRO-3 gathers the weights again for the backward (False: the forward's gathered weights
    # are kept to the backward, Layout.reshard)
    reshard_after_forward: bool = True


@dataclass
class PlanDecisions:
    """Every decision of a plan, as plain data (see the module docstring)."""

    layout: Layout
    params: dict[str, ParamPlan]
    stages: list[tuple[int, int]] = field(default_factory=list)  # (first, last block) per stage
    recompute: list[str] = field(default_factory=list)  # forward values recomputed in backward
    # what the recompute pass runs ("auto" resolved): the decision parallelize executes
    recompute_choice: RecomputeChoice = field(default_factory=RecomputeChoice)
    # under a pipeline whose stages choose apart ("auto"), stage s runs recompute_per_stage[s];
    # empty when every stage runs recompute_choice
    recompute_per_stage: tuple[RecomputeChoice, ...] = ()
    fp8: list[str] = field(default_factory=list)  # weights whose matmuls run in FP8
    # FP8 candidates the plan keeps in high precision ("auto": FP8 would not pay at their shape)
    fp8_high: list[str] = field(default_factory=list)
    # fused projections (one weight split per part under TP: GPT-2's qkv, Phi-3's gate|up) the
    # layout asks FP8 of but runs in high precision: no FP8 matmul rule for such a split
    fp8_fused_high: list[str] = field(default_factory=list)
    # expert weights the layout asks FP8 of but runs in high precision: experts stacked in one
    # parameter (grouped matmuls) and, under ep, lists of experts (one grouped computation)
    fp8_expert_high: list[str] = field(default_factory=list)
    comm: CommPlan = field(default_factory=CommPlan)
    fallbacks: list[Fallback] = field(default_factory=list)

    def stage_recompute(self, stage: int) -> RecomputeChoice:
        """What pipeline stage ``stage`` recomputes."""
        return self.recompute_per_stage[stage] if self.recompute_per_stage else self.recompute_choice

    @property
    def mesh(self) -> dict[str, int]:
        """Mesh axes and sizes, outermost first (axes of size > 1, and dp always)."""
        sizes = {"dp": self.layout.dp, "pp": self.layout.pp, "cp": self.layout.cp, "tp": self.layout.tp}
        return {k: sizes[k] for k in MESH_ORDER if sizes[k] > 1 or k == "dp"}

    def placement_strings(self) -> dict[str, dict[str, str]]:
        """parameter -> mesh axis -> DTensor spelling (``plan.placements``)."""
        return {name: {axis: str(p) for axis, p in pp.placements.items()} for name, pp in self.params.items()}

    def data_parallel(self) -> DataParallelPlan:
        """The data-parallel pass's part."""
        return DataParallelPlan(zero=self.layout.zero,
                                sharded=frozenset(n for n, p in self.params.items() if p.zero_sharded),
                                comm=self.comm)

    def stage_choices(self) -> tuple[RecomputeChoice, ...]:
        """What each pipeline rank recomputes (one choice without a pipeline)."""
        return tuple(self.stage_recompute(r) for r in range(self.layout.pp))

    def fp8_part(self) -> Fp8Part:
        """The FP8 passes' part."""
        return Fp8Part(tuple(self.fp8), self.layout.fp8_recipe)

    def recompute_part(self) -> RecomputePart:
        """The recompute pass's part (each block's rank: chunk c of ``stages`` runs on rank
        c mod pp)."""
        pp = self.layout.pp
        block_rank = {b: c % pp for c, (first, last) in enumerate(self.stages) for b in range(first, last + 1)}
        return RecomputePart(self.stage_choices(), block_rank, self.layout.regather)

    def pipeline_part(self) -> PipelinePart:
        """The pipeline split's part."""
        return PipelinePart(self.layout, tuple(self.stages),
                            tuple(p for p, d in self.params.items() if d.placements["dp"].is_shard),
                            self.comm.reduce_scatter)

    def tensor_parallel(self) -> TensorParallelPlan:
        """The tensor-parallel pass's part."""
        return TensorParallelPlan(
            placements={n: p.placements.get("tp", AxisPlacement()) for n, p in self.params.items()},
            sequence_parallel=self.layout.sp,
            replicated_ops=frozenset(f.op for f in self.fallbacks),
        )

    def to_dict(self) -> dict:
        """JSON-ready dict (inverse: `from_dict`)."""
        return {
            "layout": self.layout.to_dict(),
            "params": {n: {"shape": list(p.shape), "placements": {a: str(x) for a, x in p.placements.items()},
                           "tp_role": p.tp_role, "zero_sharded": p.zero_sharded, "fused_parts": p.fused_parts}
                       for n, p in self.params.items()},
            "stages": [list(s) for s in self.stages],
            "recompute": list(self.recompute),
            "recompute_choice": {"mode": self.recompute_choice.mode,
                                 "outputs": list(self.recompute_choice.outputs)},
            "recompute_per_stage": [{"mode": c.mode, "outputs": list(c.outputs)}
                                    for c in self.recompute_per_stage],
            "fp8": list(self.fp8),
            "fp8_high": list(self.fp8_high),
            "fp8_fused_high": list(self.fp8_fused_high),
            "fp8_expert_high": list(self.fp8_expert_high),
            "comm": asdict(self.comm),
            "fallbacks": [asdict(f) for f in self.fallbacks],
        }

    @classmethod
    def from_dict(cls, data: dict) -> PlanDecisions:
        """Inverse of `to_dict`."""
        return cls(
            layout=Layout.from_dict(data["layout"]),
            params={n: ParamPlan(shape=tuple(p["shape"]),
                                 placements={a: AxisPlacement.parse(x) for a, x in p["placements"].items()},
                                 tp_role=p["tp_role"], zero_sharded=p["zero_sharded"],
                                 fused_parts=p.get("fused_parts", 1))
                    for n, p in data["params"].items()},
            stages=[tuple(s) for s in data["stages"]],
            recompute=list(data["recompute"]),
            recompute_choice=_recompute_choice(data),
            recompute_per_stage=tuple(RecomputeChoice(c["mode"], tuple(c["outputs"]))
                                      for c in data.get("recompute_per_stage", [])),
            fp8=list(data["fp8"]),
            fp8_high=list(data.get("fp8_high", [])),
            fp8_fused_high=list(data.get("fp8_fused_high", [])),
            fp8_expert_high=list(data.get("fp8_expert_high", [])),
            comm=CommPlan(**data["comm"]),
            fallbacks=[Fallback(**f) for f in data["fallbacks"]],
        )


def _recompute_choice(data: dict) -> RecomputeChoice:
    """A plan's recompute choice; plans written before it existed name a mode in the layout."""
    if "recompute_choice" in data:
        return RecomputeChoice(data["recompute_choice"]["mode"], tuple(data["recompute_choice"]["outputs"]))
    mode = data["layout"].get("recompute", "none")
    return RecomputeChoice(mode if isinstance(mode, str) and mode != "auto" else "none")


@functools.lru_cache(maxsize=65536)  # called per node and per layout by the search
def block_pattern(name: str) -> str:
    """The name a decision about a weight or module is tied under, so that alike blocks decide
    alike: every block index replaced by ``*``. The plan's one naming rule for weight groups
    (`Layout.fp8`, `Layout.recompute`, the TP ILP's role groups), shared by the cost model,
    the strategies and the passes.

    A block index is a path component made only of digits that follows a named component: it
    indexes a ModuleList or Sequential held by a module (``layers.3.mlp.up.weight`` ->
    ``layers.*.mlp.up.weight``, ``h.11.attn.c_attn.weight`` -> ``h.*.attn.c_attn.weight``),
    at any depth (experts inside a block: ``layers.2.experts.3.w1`` -> ``layers.*.experts.*.w1``)
    and at the end of a module path (``layers.3`` -> ``layers.*``). A leading index is kept:
    it names a layer of a bare top-level ``nn.Sequential``, whose layers differ in kind
    (``0.weight`` of a Linear, ``2.weight`` of another shape) as often as they are alike, so
    tying them could force one role on unlike layers; a model that is a bare Sequential of
    alike blocks gets one decision per block instead (correct, only a larger problem). A name
    alone cannot tell alike layers from unlike ones: the indices of a Sequential inside a
    block (``mlp.0``, ``mlp.2``) fold too.
    """
    return re.sub(r"(?<=\.)\d+(?=\.|$)", "*", name) if name else ""


fp8_group = block_pattern  # an FP8 decision is tied by weight name (passes/fp8.py)


@dataclass(frozen=True)
class DataParallelPlan:
    """What the data-parallel pass executes: the ZeRO stage, which weights it shards (dim 0
    over the dp axis), and the bucketing of its collectives."""

    zero: int
    sharded: frozenset[str]
    comm: CommPlan = field(default_factory=CommPlan)


@dataclass(frozen=True)
class TensorParallelPlan:
    """What the tensor-parallel pass executes: every weight's placement on the TP axis, whether
    activations outside the matmuls are sharded on the sequence (SP), and the ops the plan runs
    replicated (their inputs gathered first, whatever DTensor would do with them)."""

    placements: dict[str, AxisPlacement]
    sequence_parallel: bool = False
    replicated_ops: frozenset[str] = frozenset()  # ops the plan runs replicated (no strategy)


@dataclass(frozen=True)
class Fp8Part:
    """What the FP8 passes execute: the weights (names or `fp8_group` patterns) whose matmuls
    run in FP8, and the scaling recipe (`Layout.fp8_recipe`)."""

    weights: tuple[str, ...]
    recipe: str


@dataclass(frozen=True)
class RecomputePart:
    """What the recompute pass executes: what each pipeline rank recomputes (one entry without
    a pipeline), each block's pipeline rank, and `Layout.regather`."""

    choices: tuple[RecomputeChoice, ...]
    block_rank: dict[int, int]
    regather: bool = True


@dataclass(frozen=True)
class PipelinePart:
    """What the pipeline split executes: the layout (degrees, schedule), the stages' blocks
    (first, last; one entry per chunk under interleaved 1F1B), the parameters ZeRO-1 shards
    over "dp" (the runtime's optimizer-step rows) and whether their gradients are
    reduce-scattered (`CommPlan.reduce_scatter`) or all-reduced."""

    layout: Layout
    stages: tuple[tuple[int, int], ...]
    zero_sharded: tuple[str, ...]
    reduce_scatter: bool = False


@dataclass(frozen=True)
class ExecutionReport:
    """What the passes found as they ran a plan on one rank's graph, kept apart from the
    plan (the solver's `PlanDecisions` is never edited after it is written).

    ``recompute``: block -> the saved forward values the recompute pass rebuilds there, as it
    ran (a block belongs to one pipeline stage); None where no recompute was asked.
    ``fallbacks``: the ops that ran replicated, as the passes met them: the TP plan's
    replicated ops it executed, then the ops the TP pass found no sharding rule for, then the
    sequence gathers of the CP pass (empty without TP or CP).
    """

    recompute: dict[int, tuple[str, ...]] | None = None
    fallbacks: tuple[Fallback, ...] = ()

    def recompute_lines(self) -> list[str]:
        """One line per block: how many values it recomputes and their ops (node names less
        their numbering, so that alike blocks read alike)."""
        return [f"block {block}: {len(values)} values ("
                + ", ".join(sorted({re.sub(r"_\d+$", "", v) for v in values})) + ")"
                for block, values in sorted((self.recompute or {}).items())]

    def to_dict(self) -> dict:
        """JSON-ready dict (inverse: `from_dict`)."""
        return {"recompute": None if self.recompute is None
                else [[block, list(values)] for block, values in sorted(self.recompute.items())],
                "fallbacks": [asdict(f) for f in self.fallbacks]}

    @classmethod
    def from_dict(cls, data: dict) -> ExecutionReport:
        """Inverse of `to_dict`."""
        recompute = data.get("recompute")
        return cls(recompute=None if recompute is None else {b: tuple(v) for b, v in recompute},
                   fallbacks=tuple(Fallback(**f) for f in data.get("fallbacks", [])))


@dataclass(frozen=True)
class AxisGroup:
    """The process group of one mesh axis as a pass sees it: its name, size and this rank."""

    name: str
    size: int
    rank: int


@dataclass(frozen=True)
class GraphSignature:
    """What feeds a joint graph's placeholders and reads its outputs.

    inputs: (kind, name) per placeholder, kind param | buffer | input | tangent | zero_tangent | accum;
    placeholders: the placeholder node names, in order; grad_index: parameter -> output index
    of its gradient; loss_index: output index of the loss; buffer_index: buffer -> output index
    of its new value, for buffers the forward updates (BatchNorm statistics).
    """

    inputs: list[tuple[str, str]]
    placeholders: list[str]
    grad_index: dict[str, int]
    loss_index: int
    buffer_index: dict[str, int] = field(default_factory=dict)

    def placeholder_of(self, kind: str) -> dict[str, str]:
        """name -> placeholder node name, for the inputs of one kind."""
        return {name: node for (k, name), node in zip(self.inputs, self.placeholders) if k == kind}


@dataclass(frozen=True)
class OutputJoin:
    """How one of the forward's other outputs joins over a step's micro-batches
    (`autopar.capture.outputs.output_joins` decides, `runtime.executor.join_micro_batches` runs):
    how "cat" (dim 0, the batch), "mean", "sum" or "ratio" (N / D of batch sums: the
    micro-batches' values weighted by their D_k / D); counter: for "ratio", the callable giving
    a micro-batch's D from its user inputs and buffers (`passes.loss_reduction.Counter`);
    step_wide: a "mean" over the loss's normalisers, which the runtime feeds step-wide, so that
    it is, like the loss, the step's value once averaged over the data-parallel ranks."""

    how: str
    counter: object = None
    step_wide: bool = False


# The pipeline split (passes/pipeline_split.py) as the runtime (runtime/pipeline.py) runs it.

@dataclass(frozen=True)
class StageInput:
    """What feeds one placeholder of a stage graph.

    kind: "recv" (value ``index`` of the channel from the previous stage), "saved" (forward
    output ``index`` of the same stage's saved values), "grad" (slot ``index`` of the gradient
    channel from the next stage), "stash" (output ``index`` of zero-bubble's input-gradient
    part, read by its weight-gradient part), or a leaf of the joint graph: "param", "buffer", "input",
    "tangent", "zero_tangent" (``name`` as in the joint graph's `GraphSignature`).
    """

    kind: str
    name: str = ""
    index: int = -1


@dataclass
class StageGraphs:
    """One stage's forward and backward graphs and what their inputs and outputs are."""

    stage: int
    forward: GraphModule
    forward_inputs: list[StageInput]
    # forward outputs, in order: the values sent on (n_sends), the saved values (n_saved),
    # the loss if ``has_loss``, then the new value of each buffer in ``buffers``
    n_sends: int
    n_saved: int
    has_loss: bool
    buffers: list[str]
    backward: GraphModule
    backward_inputs: list[StageInput]
    # backward outputs: one per slot of the previous channel (None where unused), then the
    # gradient (or this stage's part of it, for a shared parameter) of each of ``grads``
    n_grad_sends: int
    grads: list[str]
    params: list[str]  # the parameters this stage holds (reads)
    # zero-bubble's split of the backward (`passes.pipeline_split.split_backward`), or None
    weight_split: BackwardSplit | None = None


@dataclass
class BackwardSplit:
    """A stage's backward as zero-bubble runs it: the input-gradient part (what the previous
    stage waits for) now, the weight-gradient part later, in the pipeline's bubbles.

    ``input_grad`` returns the gradient slots sent back (as the whole backward does), then
    ``n_stash`` values its weight part reads; ``weight_grad`` returns the parameter gradients
    (the whole backward's ``grads``). Their inputs: as the backward's (`StageInput`), plus
    kind "stash" (the input part's extra output ``index``)."""

    input_grad: GraphModule
    input_grad_inputs: list[StageInput]
    n_stash: int
    weight_grad: GraphModule
    weight_grad_inputs: list[StageInput]


@dataclass
class PipelineGraphs:
    """The split: per stage its graphs; per cut the values crossing it."""

    stages: list[StageGraphs]
    channels: list[list[str]]  # C_s: the forward values sent from stage s to s+1
    grad_slots: list[dict[int, str]]  # per C_s: slot -> the backward value sent from s+1 to s
    shared: dict[str, list[int]] = field(default_factory=dict)  # parameter -> its stages (> 1)

    @property
    def pp(self) -> int:
        """Number of stages."""
        return len(self.stages)
