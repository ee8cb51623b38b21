"""What a captured training step does: per node shapes, FLOPs, bytes, module and layer; the
forward values saved for the backward; and the L repeated transformer blocks.

FLOPs count multiply-adds as 2 (the convention of `torch.utils.flop_counter` and of the
playbook's 6·N per token). Attention is counted non-causal, as the playbook counts it.
"""

from __future__ import annotations

import operator
import re
from collections import Counter, defaultdict
from dataclasses import dataclass, field

import torch
from torch.utils.flop_counter import flop_registry

from autopar.capture.joint import TrainingGraph
from passes.grouped_matmul import grouped_flops, is_grouped

aten = torch.ops.aten

# Ops that alias their input without a copy, beyond those whose schema says so.
_EXTRA_VIEWS = {aten._unsafe_view.default}
# Matmul-like ops: their FLOPs run on tensor cores and their weights decide the sharding.
_MATMULS = {
    aten.mm.default,
    aten.addmm.default,
    aten.bmm.default,
    aten.baddbmm.default,
    aten.matmul.default,
    aten.linear.default,
    aten.convolution.default,
    aten.convolution_backward.default,
}
_CPU_FLASH = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_CPU_FLASH_BWD = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
_LAYER_RE = re.compile(r"^(.*?)\.?(\d+)(?:\.|$)")


@dataclass
class NodeInfo:
    """Facts about one node of the joint graph."""

    name: str
    target: str
    phase: str  # "input", "forward", "backward", "output"
    shape: tuple[int, ...] | None
    dtype: torch.dtype | None
    nbytes: int  # bytes of the node's value (all outputs of a multi-output op)
    flops: float  # tensor-core FLOPs (matmul, attention)
    vector_flops: float  # element-wise work, about one op per output element
    bytes_read: int
    bytes_written: int
    module: str  # qualified name of the innermost module that produced it ("" = root)
    layer: int | None  # index of the repeated block it belongs to, if any
    is_view: bool
    is_matmul: bool
    storage: str  # name of the node whose storage this value lives in
    # share of ``flops`` the kernel executes: 1/2 for causal flash attention, which skips the
    # masked blocks; ``flops`` itself keeps the playbook's non-causal count (MFU's convention)
    causal_share: float = 1.0

    @property
    def executed_flops(self) -> float:
        """The tensor-core FLOPs the kernel runs (what its time is priced on)."""
        return self.flops * self.causal_share


@dataclass
class RepeatedBlocks:
    """The repeated layers of the model: ``count`` copies of one block under ``prefix``.

    ``classes`` groups layer indices whose forward+backward op sequences are identical; a
    standard transformer has one class holding every layer.
    """

    prefix: str
    count: int
    classes: list[list[int]]
    nodes_per_block: int
    nodes: dict[int, list[str]] = field(default_factory=dict)

    @property
    def identical(self) -> bool:
        """True when every block is a copy of the first."""
        return len(self.classes) == 1


@dataclass
class GraphAnalysis:
    """Per-node facts plus the totals a cost model needs."""

    nodes: dict[str, NodeInfo]
    saved: dict[str, int]  # storage node -> bytes, forward values the backward reads
    blocks: RepeatedBlocks | None
    op_counts: Counter

    def _sum(self, attr: str, phase: str | None = None) -> float:
        return sum(getattr(n, attr) for n in self.nodes.values() if phase is None or n.phase == phase)

    @property
    def forward_flops(self) -> float:
        """Tensor-core FLOPs of the forward pass."""
        return self._sum("flops", "forward")

    @property
    def backward_flops(self) -> float:
        """Tensor-core FLOPs of the backward pass."""
        return self._sum("flops", "backward")

    @property
    def saved_bytes(self) -> int:
        """Bytes of activations kept from forward to backward (weights and inputs excluded)."""
        return sum(self.saved.values())

    def saved_bytes_by_layer(self) -> dict[int | None, int]:
        """Saved activation bytes per repeated block (None: outside the blocks)."""
        out: dict[int | None, int] = defaultdict(int)
        for name, nbytes in self.saved.items():
            out[self.nodes[name].layer] += nbytes
        return dict(out)


def analyze(graph: TrainingGraph) -> GraphAnalysis:
    """Analyse a captured training step (no tensors are allocated)."""
    kinds = {i.node: i.kind for i in graph.inputs}
    nodes: dict[str, NodeInfo] = {}
    prefix = _blocks_prefix(graph)
    for node in graph.gm.graph.nodes:
        nodes[node.name] = _node_info(node, kinds, nodes, prefix)
    saved = _saved_activations(graph, nodes, kinds)
    blocks = _repeated_blocks(nodes, prefix)
    counts = Counter(n.target for n in nodes.values() if n.phase in ("forward", "backward"))
    return GraphAnalysis(nodes=nodes, saved=saved, blocks=blocks, op_counts=counts)


def _val_bytes(val) -> int:
    if isinstance(val, torch.Tensor):
        return val.numel() * val.element_size()
    if isinstance(val, (tuple, list)):
        return sum(_val_bytes(v) for v in val)
    return 0


def _module_path(node: torch.fx.Node) -> str:
    if "module" in node.meta:  # set by capture
        return node.meta["module"]
    stack = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack") or {}
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    # export names look like "layers.0.attn" (or L['self'].layers[0] from strict mode)
    path = re.sub(r"\[(\d+)\]", r".\1", path.replace("L['self'].", ""))
    return path


def _blocks_prefix(graph: TrainingGraph) -> str | None:
    """The container of repeated layers: the module prefix followed by the most indices."""
    indices: dict[str, set[int]] = defaultdict(set)
    for node in graph.gm.graph.nodes:
        match = _LAYER_RE.match(_module_path(node))
        if match:
            indices[match.group(1)].add(int(match.group(2)))
    if not indices:
        return None
    return max(indices, key=lambda p: (len(indices[p]), -len(p)))


def _layer_of(module: str, prefix: str | None) -> int | None:
    if prefix is None:
        return None
    match = _LAYER_RE.match(module)
    if match and match.group(1) == prefix:
        return int(match.group(2))
    return None


def _node_info(node, kinds, nodes: dict[str, NodeInfo], prefix) -> NodeInfo:
    val = node.meta.get("val")
    tensor = val if isinstance(val, torch.Tensor) else None
    shape = tuple(int(d) for d in tensor.shape) if tensor is not None else None
    dtype = tensor.dtype if tensor is not None else None
    nbytes = _val_bytes(val)
    module = _module_path(node)
    target = node.target
    if node.op == "placeholder":
        return NodeInfo(node.name, f"input:{kinds.get(node.name, '?')}", "input", shape, dtype,
                        nbytes, 0.0, 0.0, 0, 0, "", None, False, False, node.name)
    if node.op == "output":
        return NodeInfo(node.name, "output", "output", None, None, 0, 0.0, 0.0, 0, 0, "", None,
                        False, False, node.name)
    phase = "backward" if node.meta.get("partitioner_tag") == "is_backward" else "forward"
    is_view = target is operator.getitem or getattr(target, "is_view", False) or target in _EXTRA_VIEWS
    storage = node.name
    if is_view:
        src = node.args[0]
        # getitem of a multi-output op (sdpa, split) reads one output: a storage of its own,
        # except for split/unbind whose outputs are views of their input.
        if target is operator.getitem and not getattr(src.target, "is_view", False):
            is_view, storage = False, node.name
        else:
            storage = nodes[src.name].storage
    in_bytes = sum(_val_bytes(a.meta.get("val")) for a in node.all_input_nodes)
    flops = 0.0 if is_view else _flops(node)
    is_matmul = target in _MATMULS or is_grouped(node)
    vector = 0.0 if (is_view or is_matmul or flops) else float(tensor.numel() if tensor is not None else 0)
    return NodeInfo(
        name=node.name,
        target=str(target),
        phase=phase,
        shape=shape,
        dtype=dtype,
        nbytes=nbytes,
        flops=flops,
        vector_flops=vector,
        bytes_read=0 if is_view else in_bytes,
        bytes_written=0 if is_view else nbytes,
        module=module,
        layer=_layer_of(module, prefix),
        is_view=is_view,
        is_matmul=is_matmul,
        storage=storage,
        causal_share=_causal_share(node) if flops else 1.0,
    )


def _flops(node: torch.fx.Node) -> float:
    """Tensor-core FLOPs of one node, from PyTorch's registry plus CPU flash attention."""
    target = node.target
    args = torch.fx.node.map_arg(node.args, lambda n: n.meta.get("val"))
    kwargs = torch.fx.node.map_arg(node.kwargs, lambda n: n.meta.get("val"))
    if _CPU_FLASH is not None and target == _CPU_FLASH.default:
        q, k, v = args[:3]
        return _attention_flops(q, k, v)
    if _CPU_FLASH_BWD is not None and target == _CPU_FLASH_BWD.default:
        q, k, v = args[1:4]
        return 2.0 * _attention_flops(q, k, v)  # dQ, dK, dV and dP: twice the forward
    if is_grouped(node):  # MoE experts: no formula in PyTorch's registry
        return grouped_flops(node)
    packet = getattr(target, "overloadpacket", None)
    formula = flop_registry.get(packet)
    if formula is None:
        return 0.0
    try:
        return float(formula(*args, out_val=node.meta.get("val"), **kwargs))
    except Exception:  # a formula that cannot read these args counts as no matmul work
        return 0.0


# Flash attention under a causal mask computes only the blocks on and below the diagonal:
# (s/B)(s/B + 1)/2 of (s/B)^2 tiles, 1/2 for long sequences (FlashAttention-2, Dao 2023, sec. 3.1:
# "we can skip the blocks ... about 1.7-1.8x speedup"); taken as 1/2.
CAUSAL_ATTENTION_SHARE = 0.5


def _causal_share(node: torch.fx.Node) -> float:
    """`CAUSAL_ATTENTION_SHARE` for a causal attention node (forward or backward), else 1."""
    target = node.target
    if _CPU_FLASH is not None and target == _CPU_FLASH.default:
        causal = node.kwargs.get("is_causal", node.args[4] if len(node.args) > 4 else False)
    elif _CPU_FLASH_BWD is not None and target == _CPU_FLASH_BWD.default:
        causal = node.kwargs.get("is_causal", node.args[7] if len(node.args) > 7 else False)
    else:
        return 1.0
    return CAUSAL_ATTENTION_SHARE if causal is True else 1.0


def _attention_flops(q, k, v) -> float:
    """QK^T and PV, non-causal: 2·b·h·s_q·s_k·d each (playbook convention)."""
    b, h, s_q, d = q.shape
    s_k = k.shape[-2]
    d_v = v.shape[-1]
    return 2.0 * b * h * s_q * s_k * d + 2.0 * b * h * s_q * s_k * d_v


def _saved_activations(graph: TrainingGraph, nodes: dict[str, NodeInfo], kinds) -> dict[str, int]:
    """Storages of forward values that a backward node reads (the autograd 'saved tensors')."""
    saved: dict[str, int] = {}
    for node in graph.gm.graph.nodes:
        info = nodes[node.name]
        if info.phase != "backward":
            continue
        for arg in node.all_input_nodes:
            src = nodes[arg.name]
            root = nodes[src.storage]
            if src.phase == "forward" and root.phase == "forward":
                saved[root.name] = root.nbytes
    return saved


def _repeated_blocks(nodes: dict[str, NodeInfo], prefix: str | None) -> RepeatedBlocks | None:
    """Group nodes by block index and compare each block's op signature with the others."""
    if prefix is None:
        return None
    members: dict[int, list[str]] = defaultdict(list)
    for info in nodes.values():
        if info.layer is not None:
            members[info.layer].append(info.name)
    signatures: dict[tuple, list[int]] = defaultdict(list)
    for index in sorted(members):
        sig = tuple(
            (nodes[n].phase, nodes[n].target, nodes[n].shape, str(nodes[n].dtype)) for n in members[index]
        )
        signatures[sig].append(index)
    classes = sorted(signatures.values(), key=lambda c: c[0])
    return RepeatedBlocks(
        prefix=prefix,
        count=len(members),
        classes=classes,
        nodes_per_block=len(members[min(members)]),
        nodes=dict(members),
    )


ATTENTION_OPS = ("scaled_dot_product", "flash_attention", "efficient_attention")


def attention_keys(node: torch.fx.Node) -> int:
    """The keys a fused attention node attends over, forward or backward (0 for any other
    node), read off its key (argument 1 of the forward ops, 2 of their backward ops, after the
    output's gradient): dim -2 of SDPA's [batch, heads, keys, dim], dim -3 of the flash and
    memory-efficient kernels' own [batch, keys, heads, dim]; the tokens of a language model,
    the patches of an image model."""
    shape, target = _attention_key_shape(node)
    dim = -2 if "scaled_dot_product" in target else -3
    return int(shape[dim]) if shape is not None and len(shape) >= -dim else 0


def attention_head_dim(node: torch.fx.Node) -> int:
    """The head dim of a fused attention node's key (its last dim in every kernel's layout),
    forward or backward; 0 for any other node."""
    shape, _ = _attention_key_shape(node)
    return int(shape[-1]) if shape is not None and len(shape) >= 3 else 0


def _attention_key_shape(node: torch.fx.Node) -> tuple:
    """(the key's shape or None, the op's name) of a fused attention node."""
    target = str(node.target)
    if node.op != "call_function" or not any(k in target for k in ATTENTION_OPS):
        return None, target
    index = 2 if "backward" in target else 1
    key = node.args[index] if len(node.args) > index else None
    return (getattr(key.meta.get("val"), "shape", None) if isinstance(key, torch.fx.Node) else None), target
