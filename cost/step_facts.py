"""The schema of a captured step's cost facts: what `cost.step.predict` prices.

`StepFacts` holds a few scalars and four tables, each a dataclass of same-length columns:

- `NodeTable`: one row per kernel-launching node of the joint graph (views excluded): its
  FLOPs, the bytes it touches (batch-dependent activations and the rest), its TP state, its
  phase, its block, what it overlaps;
- `SavedTable`: one row per forward value held for the backward: saved without recompute,
  kept from the forward or rebuilt in the backward under a recompute mode;
- `EventTable`: one row per TP collective the recipe implies (reduce or gather);
- `ParamTable`: one entry per parameter (dicts keyed by parameter name): size, dtype, TP role
  and sharded dim, expert or not, the blocks that read it.

`autopar.search.facts.build_step_facts` fills it from a captured graph; this module imports
nothing of autopar. Every batch-dependent quantity is linear in the batch, so `rebatch` gives
the step at another global batch without a new capture.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np

from cost.facts_cache import FactsCache
from vocab.layout import LayoutError


def _check_lengths(table: object) -> None:
    """Every column of a table has the same length (they are parallel arrays)."""
    lengths = {f.name: len(getattr(table, f.name)) for f in dataclasses.fields(table)}
    if len(set(lengths.values())) > 1:
        raise ValueError(f"{type(table).__name__}: columns of different lengths {lengths}")


def _scale_where(values: np.ndarray, mask: np.ndarray, r: float) -> np.ndarray:
    return np.where(mask, values * r, values)


@dataclass(frozen=True)
class NodeTable:
    """Per node of the captured step (call_function nodes that are not views), in graph order."""

    name: np.ndarray  # node name in the joint graph (str)
    flops: np.ndarray  # tensor-core FLOPs the kernels run for the whole captured batch (causal
    # attention: half the convention's; `StepFacts.total_flops` keeps the convention for MFU)
    vflops: np.ndarray  # vector (element-wise) FLOPs
    bytes_act: np.ndarray  # bytes of batch-dependent inputs/outputs (scale with the batch)
    bytes_const: np.ndarray  # bytes of the rest (weights, tables)
    batch_dep: np.ndarray  # the node's work scales with the batch
    tp_div: np.ndarray  # its work splits t ways under TP (S state, or a sharded matmul)
    sp_div: np.ndarray  # replicated activation work that SP splits over the sequence
    is_matmul: np.ndarray
    fp8_act_bytes: np.ndarray  # activation input bytes an fp8 weight matmul must cast
    fp8_const_bytes: np.ndarray  # weight bytes it must cast
    # the weight whose matmul this is ("" for any other node: an FP8 candidate or not), as
    # passes/fp8.py finds them; fp8_wgrad: it is that weight's gradient matmul
    fp8_weight: np.ndarray
    fp8_wgrad: np.ndarray
    forward: np.ndarray
    launch: np.ndarray  # the node starts a kernel (first node of its fusion group)
    hides_gather: np.ndarray  # column matmul: an SP all-gather of its input overlaps it
    hides_reduce: np.ndarray  # weight-gradient matmul: the input-gradient reduction overlaps it
    layer: np.ndarray  # block index, pre-block nodes -1 (stage 0); post-block nodes L
    is_attention: np.ndarray
    attention_kv_bytes: np.ndarray  # K and V bytes an attention node reads (CP exchanges them)
    # the same before a grouped-query expansion (the kv heads' own K and V; = attention_kv_bytes
    # without one): what a ring that expands after the exchange sends (`StepFacts.cp_kv_heads`)
    attention_kv_heads_bytes: np.ndarray
    # the keys an attention node attends over, forward or backward (0 for other nodes)
    attention_seq: np.ndarray
    attention_head_dim: np.ndarray  # the head dim of those nodes (0 for others)
    # the node is copied into the backward by the recompute pass under that mode (its time is
    # the recompute's price; `autopar.search.facts` reads it off the pass's own marking)
    rerun_selective: np.ndarray
    rerun_full: np.ndarray
    # experts stacked in one parameter (`passes.expert_parallel_stacked`): the node runs on the
    # ep group's gathered rows under ep (x ep), or is a grouped matmul on the rank's experts'
    # routed rows (``routed``: as many as the busiest rank's, `cost.routing.imbalance`)
    ep_rows: np.ndarray
    routed: np.ndarray
    # column g (shape nodes x groups): copied under "selective" + heavy group g
    # (`StepFacts.recompute_groups`)
    rerun_groups: np.ndarray

    def __post_init__(self) -> None:
        _check_lengths(self)

    def __len__(self) -> int:
        return len(self.flops)

    def rebatch(self, r: float) -> NodeTable:
        """The table at ``r`` times the batch."""
        return dataclasses.replace(
            self,
            flops=_scale_where(self.flops, self.batch_dep, r),
            vflops=_scale_where(self.vflops, self.batch_dep, r),
            bytes_act=self.bytes_act * r,
            fp8_act_bytes=self.fp8_act_bytes * r,
            attention_kv_bytes=self.attention_kv_bytes * r,
            attention_kv_heads_bytes=self.attention_kv_heads_bytes * r,
        )


@dataclass(frozen=True)
class SavedTable:
    """Per forward value (storage) the backward reads, under some recompute mode: what
    activation memory counts. ``kept_<mode>``: held from the forward to the backward under that
    mode ("none": autograd's saved values; "selective"/"full": what `passes.recompute` keeps,
    the roots of its recompute chains included); ``rebuilt_<mode>``: the (made, dead) span, in
    backward positions, of the copy that rebuilds it under that mode, (-1, -1) if none does
    (`cost.terms.recompute` sweeps the spans of each block for its working set)."""

    name: np.ndarray  # the storage's node in the joint graph (str)
    bytes: np.ndarray  # for the whole captured batch
    batch_dep: np.ndarray
    tp_div: np.ndarray  # sharded t ways under TP
    sp_div: np.ndarray  # replicated but sequence-sharded under SP
    ep_rows: np.ndarray  # holds the ep group's routed rows under ep (stacked experts): x ep
    layer: np.ndarray  # block index (-1 / L outside the blocks)
    heavy: np.ndarray  # produced by a matmul or attention
    kept_none: np.ndarray  # saved for the backward without recompute
    kept_selective: np.ndarray
    kept_full: np.ndarray
    rebuilt_selective: np.ndarray  # rows x 2 (made, dead)
    rebuilt_full: np.ndarray
    # column g: kept (rows x groups) / rebuilt (rows x groups x 2) under "selective" + heavy
    # group g (`StepFacts.recompute_groups`)
    kept_groups: np.ndarray
    rebuilt_groups: np.ndarray

    def __post_init__(self) -> None:
        _check_lengths(self)

    def __len__(self) -> int:
        return len(self.bytes)

    def rebatch(self, r: float) -> SavedTable:
        """The table at ``r`` times the batch."""
        return dataclasses.replace(self, bytes=_scale_where(self.bytes, self.batch_dep, r))


@dataclass(frozen=True)
class EventTable:
    """Per TP collective of the recipe (`autopar.strategies.tp_recipe.TPEvent`)."""

    node: np.ndarray  # the node whose value is reduced or gathered (str)
    bytes: np.ndarray  # the value's bytes for the whole captured batch (global shape)
    batch_dep: np.ndarray
    reduce: np.ndarray  # True: reduce (AR / RS), False: gather (AG under SP)
    layer: np.ndarray
    forward: np.ndarray
    always: np.ndarray  # a gather that is needed without SP too

    def __post_init__(self) -> None:
        _check_lengths(self)

    def __len__(self) -> int:
        return len(self.bytes)

    def rebatch(self, r: float) -> EventTable:
        """The table at ``r`` times the batch."""
        return dataclasses.replace(self, bytes=_scale_where(self.bytes, self.batch_dep, r))


@dataclass(frozen=True)
class ParamTable:
    """Per parameter (dicts keyed by the parameter's name)."""

    numel: dict[str, int] = field(default_factory=dict)
    tp_sharded: dict[str, bool] = field(default_factory=dict)
    expert: dict[str, bool] = field(default_factory=dict)
    stages_layer: dict[str, list[int]] = field(default_factory=dict)  # blocks reading it
    dtype_bytes: dict[str, int] = field(default_factory=dict)
    tp_role: dict[str, str] = field(default_factory=dict)  # col, row, vocab, replicated
    tp_dim: dict[str, int | None] = field(default_factory=dict)  # dim sharded over TP, or None
    shape: dict[str, tuple[int, ...]] = field(default_factory=dict)  # global shapes
    tp_parts: dict[str, int] = field(default_factory=dict)  # fused projections: parts (qkv: 3)

    def __post_init__(self) -> None:
        if set(self.tp_sharded) != set(self.numel) or set(self.expert) != set(self.numel):
            raise ValueError("ParamTable: numel, tp_sharded and expert must name the same parameters")


@dataclass
class StepFacts:
    """Layout-independent facts about one captured training step (see the module docstring)."""

    batch: int  # sequences in the captured (global) step
    seq: int
    n_layers: int
    heads: int | None
    kv_heads: int | None
    n_experts: int
    total_flops: float  # tensor-core FLOPs of forward + backward for the whole batch
    nodes: NodeTable
    saved: SavedTable
    events: EventTable
    params: ParamTable
    block_input_bytes: float  # one block's input activation for the whole batch
    # EP all-to-all: activation bytes entering + leaving the experts, per slot (-1 .. L)
    expert_io_bytes: np.ndarray
    # experts stacked in one parameter (transformers' MoE): bytes of the routed rows entering
    # and leaving them per slot, gathered and reduce-scattered over ep (`cost.terms.expert_parallel`)
    expert_gather_bytes: np.ndarray = field(default_factory=lambda: np.zeros(0))
    # the routed rows (tokens x top-k) of one MoE layer of stacked experts, whole batch
    expert_routed_rows: float = 0.0
    tp_fallbacks: list[str] = field(default_factory=list)  # ops the TP recipe runs replicated
    # the heavy groups (matmul and attention outputs tied across blocks,
    # `passes.recompute.heavy_groups`) a partial recompute choice names, in column order
    recompute_groups: tuple[str, ...] = ()
    # zero-bubble's stash per slot (-1 .. L), whole batch: the input halves' values the weight
    # halves read (`passes.pipeline_split.weight_half_reads`), held until each W runs
    zb_stash_bytes: np.ndarray = field(default_factory=lambda: np.zeros(0))
    # pipeline cuts balance time under each stage's memory (`cost.stages.StageMemory`); False:
    # by time alone, how measured runs of a framework that cuts so are priced (`RunPricer`)
    memory_cuts: bool = True
    # the loss is a mean over valid tokens (`passes.token_count`): the executor all-reduces
    # their count over the data-parallel ranks every step
    counts_tokens: bool = False
    # memory as the frameworks of measured runs hold it (Megatron-LM, nanotron, llm-foundry's
    # FSDP; `RunPricer` prices their runs so; autopar's own plans keep False, what its passes
    # run): a fused or vocabulary-parallel cross-entropy keeps its fp32 buffer once and writes
    # its gradient in place (`cost.terms.recompute.transient_bytes`); full recompute
    # checkpoints whole blocks, keeping only each block's input
    # (`cost.terms.recompute.framework_kept`); gradients accumulate straight into the fp32
    # buffer, no bf16 copy beside it (`cost.precision.recipe`'s ``fused_accum``)
    framework_memory: bool = False
    # a pipeline's data-parallel reduction hides behind its last micro-batch's backward, as
    # Megatron-LM's overlapped gradient buckets run it (`RunPricer` prices measured runs so);
    # False: autopar's pipeline runtime reduces after the schedule
    # (`runtime.pipeline.reduce_data_parallel`), where nothing hides it
    pipeline_reduce_hidden: bool = False
    # how Megatron-Core's performance recipes (NeMo, Megatron-Bridge: their `CommOverlapConfig`,
    # Transformer Engine) communicate, where autopar's runtime does otherwise (False: its plans):
    # ``tp_overlap_all``: under SP every TP all-gather and reduce-scatter, forward and backward,
    # runs chunked with the GEMM it feeds or that feeds it (Transformer Engine's userbuffers,
    # ``tp_comm_overlap``), not only the forward gathers and the backward reductions;
    # ``p2p_hidden``: the interleaved schedule's stage-to-stage transfers run behind the next
    # micro-batch's compute (``overlap_p2p_comm``, set where the interleave depth is > 1);
    # ``param_gather_hidden``: ZeRO-1/2's weight all-gather after the optimizer runs behind the
    # next step's forward, block by block (``overlap_param_gather``);
    # ``cp_kv_heads`` (True: autopar's ring, `passes.kv_expansion`; Transformer Engine's): the
    # ring exchanges K and V before a grouped-query expansion;
    # ``native_attention`` (True: autopar's runtime): attention runs the architecture's own fused
    # kernel where the GPU has one (`GPUSpec.native_attention_efficiency`): PyTorch's SDPA picks
    # cuDNN's on Hopper (torch 2.11 on an H200, examples/gpu_attention_check.py's run), as
    # Transformer Engine does; False: FlashAttention-2's kernels (nanotron, llm-foundry);
    # ``ring_native_attention``: under cp > 1 the ring's blocks run that kernel too (Transformer
    # Engine's ring; autopar's runs FlashAttention-2's CUDA kernels: `runtime.ring_attention`)
    tp_overlap_all: bool = False
    p2p_hidden: bool = False
    param_gather_hidden: bool = False
    cp_kv_heads: bool = True
    native_attention: bool = True
    ring_native_attention: bool = False
    # what the cost model derives from these facts and reuses across layouts (`cost.facts_cache`;
    # not an init argument: a copy made by `rebatch` or `dataclasses.replace` starts empty)
    cache: FactsCache = field(default_factory=FactsCache, init=False, repr=False, compare=False)

    @property
    def num_params(self) -> int:
        """Parameters counted once each."""
        return sum(self.params.numel.values())

    def clear_cache(self) -> None:
        """Forget the cached prices (a calibration prices the same facts under many parameter
        values); what depends on the graph and the degrees alone stays."""
        self.cache.drop_cluster_dependent()

    def rebatch(self, batch: int) -> StepFacts:
        """The same step with a global batch of ``batch`` sequences (no new capture needed:
        every batch-dependent quantity is linear in the batch)."""
        if batch < 1:
            raise LayoutError(f"batch={batch}: a step needs at least one sequence")
        r = batch / self.batch
        return dataclasses.replace(
            self,
            batch=batch,
            total_flops=self.total_flops * r,
            nodes=self.nodes.rebatch(r),
            saved=self.saved.rebatch(r),
            events=self.events.rebatch(r),
            block_input_bytes=self.block_input_bytes * r,
            expert_io_bytes=self.expert_io_bytes * r,
            expert_gather_bytes=self.expert_gather_bytes * r,
            expert_routed_rows=self.expert_routed_rows * r,
            zb_stash_bytes=self.zb_stash_bytes * r,
        )

    # ---- per-parameter names read outside the cost model (planning, decisions, explain)
    @property
    def param_numel(self) -> dict[str, int]:
        """Elements of every parameter."""
        return self.params.numel

    @property
    def param_tp_sharded(self) -> dict[str, bool]:
        """Parameter -> sharded over TP."""
        return self.params.tp_sharded

    @property
    def param_expert(self) -> dict[str, bool]:
        """Parameter -> belongs to an expert (sharded over EP)."""
        return self.params.expert

    @property
    def param_stages_layer(self) -> dict[str, list[int]]:
        """Parameter -> blocks (effective layers) whose forward reads it."""
        return self.params.stages_layer

    @property
    def param_dtype_bytes(self) -> dict[str, int]:
        """Parameter -> bytes per element."""
        return self.params.dtype_bytes

    @property
    def tp_roles(self) -> dict[str, str]:
        """Parameter -> TP role (col, row, vocab, replicated)."""
        return self.params.tp_role

    @property
    def param_tp_dim(self) -> dict[str, int | None]:
        """Parameter -> dim sharded over TP (None: replicated)."""
        return self.params.tp_dim

    @property
    def param_shape(self) -> dict[str, tuple[int, ...]]:
        """Parameter -> global shape."""
        return self.params.shape

    @property
    def param_tp_parts(self) -> dict[str, int]:
        """Fused projections -> number of parts (q, k, v: 3)."""
        return self.params.tp_parts

    # ---- read-only columns kept for the benches (bench/block.py, cost_model.py)
    @property
    def layer(self) -> np.ndarray:
        """Per node block index (`NodeTable.layer`)."""
        return self.nodes.layer

    @property
    def saved_bytes(self) -> np.ndarray:
        """`SavedTable.bytes` of the values saved without recompute (`kept_none`), as the
        columns below."""
        return self.saved.bytes[self.saved.kept_none]

    @property
    def saved_batch_dep(self) -> np.ndarray:
        """`SavedTable.batch_dep`."""
        return self.saved.batch_dep[self.saved.kept_none]

    @property
    def saved_tp_div(self) -> np.ndarray:
        """`SavedTable.tp_div`."""
        return self.saved.tp_div[self.saved.kept_none]

    @property
    def saved_sp_div(self) -> np.ndarray:
        """`SavedTable.sp_div`."""
        return self.saved.sp_div[self.saved.kept_none]

    @property
    def saved_layer(self) -> np.ndarray:
        """`SavedTable.layer`."""
        return self.saved.layer[self.saved.kept_none]

    @property
    def saved_heavy(self) -> np.ndarray:
        """`SavedTable.heavy`."""
        return self.saved.heavy[self.saved.kept_none]
