"""Activation recomputation as a rewrite of the joint forward+backward graph.

Rule. Let R be the set of forward values the plan lets the backward recompute. For every
backward node b and every argument v of b with v in R, b reads a copy v' instead of v, where

    v' = op_v(a'_1, ..., a'_k),   a'_i = copy of a_i if a_i in R, else a_i itself,

so the copies form v's producer chain back to the first kept values (block inputs, parameters,
user inputs, values outside the blocks, and any value not in R). Each copy is inserted right
before the first backward node that needs it and shared by the later ones, so a block's
forward values are rebuilt when its backward starts, and the forward originals, which no
backward node reads any more, die as soon as the forward is done with them. Memory kept from
forward to backward drops from every saved value to the kept values the chains start from; the
price is one more forward of every copied node.

Which values are in R (`values_to_recompute`), per mode:

- "full": every forward node inside a block (a block index in ``layers``) except the block's
  output (read by a forward node outside the block: the next block's input);
- "selective": the same, minus matmul and attention outputs (Korthikanti et al. 2022: the
  element-wise values are cheap to rebuild, the matmuls are not);

- "selective" plus heavy groups (`values_to_recompute(..., also=...)`): the same, and the
  outputs of the named matmuls too (a partial choice between selective and full;
  `heavy_groups` names them, tied across blocks, as the plan does);

and in every mode never a random op (a dropout replayed would draw another mask: its outputs,
the mask included, are kept; attention kernels count as random: their outputs are kept), a
collective other than an all-gather (`_c10d_functional.*`: a reduction's output is kept; an
all-gather, TP+SP's sequence gather before a column matmul, is redone from the kept shards, as
Megatron-SP does, so its full-sequence output is never held to the backward; with
``regather=False``, `Layout.regather`, it is kept instead: one gather fewer, its output held), an op that
mutates an argument, or a value some op mutates, or a getitem of a value that is kept (it
reads the kept tuple anyway).
"""

from __future__ import annotations

import operator
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

import torch
from torch import fx

from vocab.plan_types import block_pattern

aten = torch.ops.aten

MODES = ("none", "selective", "full")
_COLLECTIVE_NAMESPACES = {"_c10d_functional", "c10d_functional", "_c10d_functional_autograd"}
_RANDOM = {"native_dropout", "dropout", "bernoulli", "rand", "randn", "rand_like", "randn_like",
           "randint", "randint_like", "randperm", "normal", "uniform", "multinomial", "poisson"}
# outputs selective recomputation keeps: the expensive matmuls and attention
_HEAVY = {"mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "convolution", "_scaled_mm",
          "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
          "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
          "scaled_dot_product_attention", "_flash_attention_forward", "_efficient_attention_forward"}


@dataclass(frozen=True)
class RecomputeResult:
    """What `apply_recompute` did: the saved values it now recomputes (forward node names of
    the values the backward used to read, views left out: their bytes are their base's) and
    how many nodes it copied into the backward."""

    recomputed: tuple[str, ...] = ()
    copied: int = 0
    copies: dict[str, str] = field(default_factory=dict)  # forward node -> its backward copy


def is_backward(node: fx.Node) -> bool:
    """A backward node of the joint graph (AOTAutograd's partitioner tag)."""
    return node.meta.get("partitioner_tag") == "is_backward"


def _op_name(node: fx.Node) -> str:
    packet = getattr(node.target, "overloadpacket", None)
    return getattr(packet, "__name__", "") if packet is not None else ""


def is_random(node: fx.Node) -> bool:
    """A random op (a replay would draw other numbers) or a seeded attention kernel."""
    # attention kernels are tagged seeded (their dropout_p): kept even at dropout_p 0, which
    # also keeps what is dear to recompute and cheap to store (out and logsumexp); measured on
    # the 4-block llama (h512, s512, b4, fp32), recomputing them in "full" raised the peak from
    # 119 to 139 MiB (the copy is made for o_proj's weight gradient, early in the block's backward)
    tags = getattr(node.target, "tags", ())
    return torch.Tag.nondeterministic_seeded in tags or _op_name(node) in _RANDOM


def is_collective(node: fx.Node) -> bool:
    """A functional collective (or its wait)."""
    return getattr(node.target, "namespace", None) in _COLLECTIVE_NAMESPACES


def _is_gather(node: fx.Node) -> bool:
    """An all-gather, or the wait of one: redone in the backward when its output is recomputed
    (Megatron-SP's choice: the sequence-gathered matmul input is not kept, the backward gathers
    it again from the kept shards; every rank runs the same graph, so the copies are issued
    in the same order on every rank)."""
    if _op_name(node) == "wait_tensor":
        return bool(node.all_input_nodes) and _is_gather(node.all_input_nodes[0])
    return _op_name(node) in ("all_gather_into_tensor", "all_gather_into_tensor_coalesced")


def mutates(node: fx.Node) -> bool:
    """An op that writes into one of its arguments."""
    schema = getattr(node.target, "_schema", None)
    return bool(schema is not None and schema.is_mutable)


def _is_view(node: fx.Node) -> bool:
    if node.target is operator.getitem:  # a part of split/unbind is a view, of sdpa its own
        return _is_view(node.args[0])
    schema = getattr(node.target, "_schema", None)
    returns = schema.returns if schema is not None else ()
    return (getattr(node.target, "is_view", False) or node.target is aten._unsafe_view.default
            or any(r.alias_info is not None for r in returns))


def _base(node: fx.Node) -> fx.Node:
    """The node whose storage ``node`` lives in (itself unless it is a view)."""
    while _is_view(node) and node.all_input_nodes:
        node = node.all_input_nodes[0]
    return node


def _is_heavy(node: fx.Node) -> bool:
    return _op_name(node) in _HEAVY


def _candidates(gm: fx.GraphModule, layers: Mapping[str, int | None],
                regather: bool = True) -> list[fx.Node]:
    """The forward nodes "full" may recompute, in graph order (the module docstring's rule;
    `values_to_recompute` drops the getitems of kept tuples); ``regather`` False keeps the
    all-gathers (TP+SP's sequence gathers) and so their full-sequence outputs."""
    nodes = list(gm.graph.nodes)
    mutated = {a for n in nodes if n.op == "call_function" and mutates(n) for a in n.all_input_nodes}
    out = []
    for node in nodes:
        layer = layers.get(node.name)
        if node.op != "call_function" or is_backward(node) or layer is None:
            continue
        if is_random(node) or (is_collective(node) and not (regather and _is_gather(node))) or mutates(node) \
                or node in mutated:
            continue
        # the block's output feeds the next block: kept, as every block's input is
        if any(u.op == "output" or (not is_backward(u) and layers.get(u.name) != layer)
               for u in node.users):
            continue
        out.append(node)
    return out


def values_to_recompute(gm: fx.GraphModule, layers: Mapping[str, int | None],
                        mode: str, also: Collection[str] = (), regather: bool = True) -> frozenset[str]:
    """The forward values the backward may recompute under ``mode`` (see the module docstring).

    ``layers``: the block index of each node (None or absent: outside the repeated blocks), as
    `autopar.analysis` finds it. ``also`` (mode "selective" only): heavy nodes (matmuls;
    `heavy_groups` keys them) whose outputs are recomputed too. ``regather`` False keeps the
    SP all-gathers' outputs (`Layout.regather`) instead of gathering again."""
    if mode not in MODES:
        raise ValueError(f"recompute mode {mode!r}: one of {', '.join(MODES)}")
    if also and mode != "selective":
        raise ValueError(f"also= adds heavy outputs to 'selective', not to {mode!r}")
    if mode == "none":
        return frozenset()
    extra = set(also)
    out: set[str] = set()
    for node in _candidates(gm, layers, regather):
        if node.target is operator.getitem and node.args[0].name not in out:
            continue  # a kept tuple (attention, dropout): its parts are kept with it
        if mode == "selective" and _is_heavy(node) and node.name not in extra:
            continue
        out.add(node.name)
    return frozenset(out)


def heavy_groups(gm: fx.GraphModule, layers: Mapping[str, int | None],
                 modules: Mapping[str, str], weight_of: Mapping[str, str]) -> dict[str, str]:
    """Every heavy node "full" recomputes and "selective" keeps -> its group: what a partial
    choice names. A matmul reading a weight is named by the weight, block indices as ``*``
    (``layers.*.mlp.up_proj.weight``, `vocab.plan_types.block_pattern`); any other heavy node by
    its module and op (``layers.*.moe:bmm``); a second alike node in one block gets
    ``#1``, and so on. Alike blocks give alike names: a group holds one node per block.

    ``modules``: node -> qualified module name; ``weight_of``: forward matmul -> its weight."""
    seen: dict[tuple[int | None, str], int] = {}
    out: dict[str, str] = {}
    for node in _candidates(gm, layers):
        if not _is_heavy(node):
            continue
        weight = weight_of.get(node.name)
        base = (block_pattern(weight) if weight
                else f"{block_pattern(modules.get(node.name, ''))}:{_op_name(node)}")
        count = seen.get((layers.get(node.name), base), 0)
        seen[(layers.get(node.name), base)] = count + 1
        out[node.name] = base if count == 0 else f"{base}#{count}"
    return out


def apply_recompute(gm: fx.GraphModule, recompute: frozenset[str]) -> RecomputeResult:
    """Rewrite ``gm`` in place: the backward recomputes the forward values named in
    ``recompute`` from the kept ones (the module docstring's rule). Copies carry the backward's
    partitioner tag (later passes see them as backward nodes: ZeRO-3 gathers their weights for
    the backward) and ``meta["recomputes"]`` = the forward node they copy."""
    graph = gm.graph
    targets = {n for n in graph.nodes if n.name in recompute and n.op == "call_function"
               and not is_backward(n)}
    copies: dict[fx.Node, fx.Node] = {}

    def copy_of(node: fx.Node, before: fx.Node) -> fx.Node:
        if node not in targets:
            return node
        if node not in copies:
            args = fx.node.map_arg(node.args, lambda a: copy_of(a, before))
            kwargs = fx.node.map_arg(node.kwargs, lambda a: copy_of(a, before))
            with graph.inserting_before(before):
                new = graph.call_function(node.target, args, kwargs)
            new.meta = {k: v for k, v in node.meta.items() if k not in ("autopar",)}
            new.meta["partitioner_tag"] = "is_backward"
            new.meta["recomputes"] = node.name
            copies[node] = new
        return copies[node]

    recomputed: dict[str, None] = {}  # the saved values recomputed, in backward order
    for node in list(graph.nodes):
        if not is_backward(node) or "recomputes" in node.meta:
            continue
        for value in [a for a in node.all_input_nodes if a in targets]:
            base = _base(value)
            if base in targets:  # a view's bytes are its base's: list the base
                recomputed[base.name] = None
            node.replace_input_with(value, copy_of(value, node))
    graph.lint()
    gm.recompile()
    return RecomputeResult(tuple(recomputed), len(copies), {k.name: v.name for k, v in copies.items()})
