"""Capture a deep stack of identical blocks by tracing four of them and repeating one.

Tracing is the slow part of planning (about 0.2 s per llama3-8b block on 2 cores), and a
transformer is one block repeated L times. So when the model holds a `ModuleList` (or
`Sequential`) of L >= 5 blocks that are alike (same class, same parameter and buffer shapes,
same attributes but their index), `capture_repeated` traces the model with four of them,
blocks [0, 1, 2, L-1], and writes the joint graph of the whole stack from it:

    forward   F_0 F_1 F_2 F_3          ->  F_0 F_1 ... F_{L-2} F_{L-1}
    backward  B_3 B_2 B_1 B_0          ->  B_{L-1} B_{L-2} ... B_1 B_0

Block 2 is the template of the middle blocks 1..L-2: each copy reads its own parameters, the
previous copy's values where block 2 read block 1's, the next copy's where it read block 3's
(the gradient flowing back), and the values outside the stack (rotary tables, masks) as they
are. Blocks 0 and L-1 keep their own nodes, the first and last block often differ a little.

It is exact, not an approximation: the result is the graph a full trace gives, node for node
(ops, shapes, module labels, autograd sequence numbers; tests compare them on the zoo and the
transformers families). Anything that would break that is checked on the traced graph, and
the caller traces the whole model instead (`NotRepeatable`): blocks 1 and 2 not traced alike,
a value outside the stack that reads a middle block (an auxiliary loss summed over layers),
a parameter tied across blocks, nodes of two middle blocks interleaved, a block whose forward
computes with its own index (`_WatchedIndex`: it may run other ops). Ties are looked up on
the whole model before tracing: a tie with a block left out of the trace leaves no mark on it.
The expansion itself, and what makes two blocks alike, is `_BlockExpansion`.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

import numpy as np
import torch
from torch import fx, nn
from torch.fx._lazy_graph_module import _make_graph_module

from autopar.capture.graph import GraphInput, GraphOutput, TrainingGraph

MIN_BLOCKS = 5  # below this a full trace costs about the same
_TRACED = 4  # blocks traced: the first, two middle ones (template and its check), the last


class NotRepeatable(Exception):
    """The traced blocks do not repeat exactly; trace the whole model instead."""


@dataclass(frozen=True)
class BlockStack:
    """A list of alike blocks: its qualified name in the model and its length."""

    path: str
    count: int

    def index(self, name: str) -> int | None:
        """The block a qualified module or parameter name lies in (None: outside the stack)."""
        prefix = self.path + "."
        if not name.startswith(prefix):
            return None
        head = name[len(prefix):].split(".", 1)[0]
        return int(head) if head.isdigit() else None

    def encloses(self, name: str) -> bool:
        """``name`` is the model, the list itself or a module whose forward runs the stack."""
        return name in ("", self.path) or self.path.startswith(name + ".")

    def rename(self, name: str, block: int) -> str:
        """``name`` inside block ``i`` renamed to the same place in ``block``."""
        prefix = self.path + "."
        head, _, rest = name[len(prefix):].partition(".")
        return f"{prefix}{block}" + (f".{rest}" if rest else "")


def find_stack(model: nn.Module) -> BlockStack | None:
    """The model's longest list of at least `MIN_BLOCKS` alike blocks, or None. A list inside
    the blocks of another (a MoE layer's experts inside a stack of layers) is not a candidate:
    the outer one repeats it."""
    best: BlockStack | None = None
    found: list[str] = []
    for path, module in model.named_modules():  # outer modules first
        if type(module) not in (nn.ModuleList, nn.Sequential) or len(module) < MIN_BLOCKS:
            continue
        if any(path.startswith(outer + ".") for outer in found):
            continue
        blocks = list(module)
        if all(_alike(blocks[1], blocks[i], 1, i) for i in range(2, len(blocks) - 1)) and \
                _same_tensors(blocks[0], blocks[1]) and _same_tensors(blocks[-1], blocks[1]):
            found.append(path)
            if best is None or len(blocks) > best.count:
                best = BlockStack(path, len(blocks))
    return best


def _same_tensors(a: nn.Module, b: nn.Module) -> bool:
    """Same class, and parameters and buffers of the same names, shapes, dtypes."""
    def sig(m):
        return ([(n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in m.named_parameters()],
                [(n, tuple(t.shape), t.dtype) for n, t in m.named_buffers()])
    return type(a) is type(b) and sig(a) == sig(b)


def _alike(a: nn.Module, b: nn.Module, ia: int, ib: int) -> bool:
    """Blocks ``a`` (index ia) and ``b`` (index ib) trace alike: same tensors, and every plain
    attribute of every submodule equal, but those that hold the block's own index."""
    if not _same_tensors(a, b):
        return False
    subs_a, subs_b = list(a.named_modules()), list(b.named_modules())
    if [n for n, _ in subs_a] != [n for n, _ in subs_b]:
        return False
    for (_, ma), (_, mb) in zip(subs_a, subs_b):
        if type(ma) is not type(mb) or ma.training != mb.training:
            return False
        va = {k: v for k, v in vars(ma).items() if not k.startswith("_") and k != "training"}
        vb = {k: v for k, v in vars(mb).items() if not k.startswith("_") and k != "training"}
        if va.keys() != vb.keys():
            return False
        for key, x in va.items():
            y = vb[key]
            if x is y or (type(x) is int and type(y) is int and (x, y) == (ia, ib)):
                continue  # the same object, or the block's index (HF's layer_idx)
            if not _equal(x, y):
                return False
    return True


def _equal(x, y) -> bool:
    """Plain attribute values equal (a functools.partial by what it calls: Gemma's activation)."""
    if isinstance(x, functools.partial) and isinstance(y, functools.partial):
        return x.func is y.func and _equal(x.args, y.args) and _equal(x.keywords, y.keywords)
    if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
        return x is y
    if isinstance(x, int) and isinstance(y, int):  # int's own comparison: a watched index records none
        return type(x) is type(y) and int.__eq__(x, y)
    try:
        return bool(x == y)
    except Exception:
        return False


@contextlib.contextmanager
def traced_blocks(model: nn.Module, stack: BlockStack) -> Iterator[None]:
    """Temporarily hold only blocks [0, 1, 2, L-1] in the model's list (restored after)."""
    parent_path, _, name = stack.path.rpartition(".")
    parent = model.get_submodule(parent_path)
    full = parent._modules[name]
    blocks = list(full)
    short = type(full)(*[blocks[0], blocks[1], blocks[2], blocks[-1]]) if isinstance(full, nn.Sequential) \
        else nn.ModuleList([blocks[0], blocks[1], blocks[2], blocks[-1]])
    parent._modules[name] = short
    try:
        yield
    finally:
        parent._modules[name] = full


class _WatchedIndex(int):
    """A block's index attribute (``self.layer_idx = i``) that records being computed with:
    compared, hashed, formatted or used in arithmetic (``if self.idx % 4 == 3``). Passed along
    untouched (HF hands ``layer_idx`` to a KV cache it does not have in training) it records
    nothing. A torch op reading it bakes the value into the graph, where the comparison of
    blocks 1 and 2 sees it."""

    read: set[str]
    name: str
    value: int

    def __new__(cls, value: int, name: str, read: set[str]):
        self = super().__new__(cls, value)
        self.name, self.read, self.value = name, read, value
        return self


def _watching(method: str):
    base = getattr(int, method)

    def watched(self, *args):
        self.read.add(self.name)
        return base(self.value, *args)

    return watched


for _method in ("__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__", "__hash__", "__bool__",
                "__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__mod__", "__rmod__",
                "__floordiv__", "__rfloordiv__", "__truediv__", "__rtruediv__", "__pow__", "__rpow__",
                "__divmod__", "__rdivmod__", "__and__", "__rand__", "__or__", "__ror__", "__xor__",
                "__rxor__", "__lshift__", "__rshift__", "__neg__", "__abs__", "__index__", "__int__",
                "__float__", "__format__", "__str__"):
    setattr(_WatchedIndex, _method, _watching(_method))


@contextlib.contextmanager
def watched_indices(model: nn.Module, stack: BlockStack) -> Iterator[set[str]]:
    """While tracing, the blocks' index attributes (an int equal to the block's index in blocks 1
    and 2, the attributes `_alike` lets differ) record being computed with; yields the set of
    their names read so (restored after)."""
    blocks = list(model.get_submodule(stack.path))
    read: set[str] = set()
    saved: list[tuple[nn.Module, str, int]] = []
    for (name, m1), (_, m2) in zip(blocks[1].named_modules(), blocks[2].named_modules()):
        for key, value in vars(m1).items():
            if type(value) is int and value == 1 and type(vars(m2).get(key)) is int and vars(m2)[key] == 2:
                for b, m in ((1, m1), (2, m2)):
                    saved.append((m, key, b))
                    m.__dict__[key] = _WatchedIndex(b, f"{name + '.' if name else ''}{key}", read)
    try:
        yield read
    finally:
        for m, key, value in saved:
            m.__dict__[key] = value


def capture_repeated(model: nn.Module, example_inputs, trace: Callable[..., TrainingGraph],
                     loss_fn=None, dtype=None) -> tuple[TrainingGraph | None, str]:
    """The joint graph of ``model``'s step traced (by ``trace``, the whole-model capture) with
    four blocks of its stack and the middle block repeated, and a line saying so; (None, why)
    when the model has no such stack or its blocks do not repeat (the caller traces it whole)."""
    stack = find_stack(model)
    if stack is None:
        return None, ""
    if _tied_in_stack(model, stack):  # the shortened stack would not show the tie
        return None, f"traced all {stack.count} blocks of {stack.path} (they do not repeat exactly: a tensor tied across blocks)"
    t0 = time.perf_counter()
    with traced_blocks(model, stack), watched_indices(model, stack) as read:
        try:
            small = trace(model, example_inputs, loss_fn=loss_fn, dtype=dtype)
        except Exception:
            if not read:
                raise
    if read:  # the blocks' code computes with its index: each block may run other ops
        return None, (f"traced all {stack.count} blocks of {stack.path} (their forward computes with "
                      f"their index {', '.join(sorted(read))}, so no block stands for another)")
    if any(n.meta.get("expert_group", ("",))[0] == stack.path for n in small.gm.graph.nodes):
        return None, ""  # a group of experts run side by side, not a stack: grouped as a whole
    try:
        graph = expand(small, stack)
    except NotRepeatable as exc:
        return None, f"traced all {stack.count} blocks of {stack.path} (they do not repeat exactly: {exc})"
    except (KeyError, IndexError) as exc:  # a layout the checks missed: the full trace is right
        return None, f"traced all {stack.count} blocks of {stack.path} (repeating them failed: {exc!r})"
    note = f"traced {_TRACED} of the {stack.count} blocks of {stack.path}; the others repeat block 2"
    return replace(graph, capture_time_s=time.perf_counter() - t0, capture_note=note), note


def _tied_in_stack(model: nn.Module, stack: BlockStack) -> bool:
    """A tensor of the stack is shared under another name (with another block, or with a
    module outside the stack). Only the four traced blocks' ties reach the traced graph, so
    the check looks at the whole model: a tie with an untraced middle block would be lost."""
    names: dict[int, list[str]] = {}
    for name, tensor in itertools.chain(model.named_parameters(remove_duplicate=False),
                                        model.named_buffers(remove_duplicate=False)):
        names.setdefault(id(tensor), []).append(name)
    return any(len(group) > 1 and any(stack.index(n) is not None for n in group) for group in names.values())


def _val_sig(node: fx.Node):
    """A node's value as compared between blocks: shape, dtype and strides of each tensor."""
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return (tuple(val.shape), val.dtype, tuple(val.stride()))
    if isinstance(val, (list, tuple)):
        return tuple((tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else repr(v) for v in val)
    return repr(val)


def expand(small: TrainingGraph, stack: BlockStack) -> TrainingGraph:
    """The graph of ``small`` (traced with blocks [0, 1, 2, L-1] as 0..3) with blocks 1..L-2.

    Raises `NotRepeatable` when blocks 1 and 2 were not traced alike or the stack's nodes
    are not laid out as a repeat of them (see the module docstring and `_BlockExpansion`).
    """
    return _BlockExpansion(small, stack).run()


@dataclass(frozen=True)
class _SeqNumbers:
    """Autograd sequence numbers of the middle blocks' forward nodes: block 1's span
    [lo1, hi1], block 2's [lo2, end]. Copy c of block 2 is numbered ``seq + (c - 2) * step``
    with ``step = lo2 - lo1``; a number after ``end`` (later blocks, the backward's gradient
    sums, which carry the loss's number) moves by the ``extra`` copies' ``extra * step``."""

    lo1: int
    hi1: int
    lo2: int
    end: int

    @property
    def step(self) -> int:
        return self.lo2 - self.lo1

    def renumber(self, seq: int, copy: int | None, extra: int) -> int:
        """The number of a node numbered ``seq`` in the small graph, as ``copy`` (None: kept)."""
        if copy is not None and self.lo2 <= seq <= self.end:
            return seq + (copy - 2) * self.step
        if seq > self.end:
            return seq + extra * self.step
        return seq


@dataclass
class _Runs:
    """Block 1's placeholders in runs of neighbours (its parameters, later its buffers): each
    run is written once per middle copy, copy after copy, where block 1's run was traced.

    ``twin`` maps a tensor's name inside the block to block 2's placeholder of it (the
    template); ``grown[k]`` is how many placeholders the extra copies of the first k runs add.
    """

    runs: list[list[fx.Node]]
    run_of: dict[fx.Node, int]
    twin: dict[str, fx.Node]
    grown: np.ndarray


def _number(n: fx.Node) -> int:
    """k of a ``primals_k`` placeholder (AOTAutograd's numbering), 0 for any other node."""
    return int(n.name.removeprefix("primals_")) if n.name.startswith("primals_") else 0


class _BlockExpansion:
    """Writes the joint graph of an L-block stack from the graph traced with four blocks.

    The small graph holds blocks [0, 1, 2, L-1], called 0..3 here. Every node is given the
    block it belongs to: its module label; a placeholder by the tensor it holds; a node of a
    module around the stack (the parent's code between blocks, autograd's gradient sums) by
    the blocks it reads, which must be one block b or neighbours b, b+1 (a backward node is
    block b's, a forward join block b+1's). Node k of block b then has a *role* per input: a
    value outside the stack, a tensor of its own block (by its name inside the block), or
    node j of block b + d with d in {-1, 0, 1}.

    Blocks 1 and 2 are *alike* when, node for node, op, target, value (shape, dtype,
    strides), forward/backward tag, input roles, module label (renamed to block 0), constant
    arguments are equal, and their autograd sequence numbers repeat with one step (`_SeqNumbers`).
    Then block 2 is the template: copy c in 1..L-2 is block 2's nodes with d-relative inputs
    read from copy c + d (copy 0 is block 0, copy L-1 is block 3), its own tensors renamed to
    block c; blocks 0 and 3 keep their nodes, reading copy 1 and copy L-2 where they read
    blocks 1 and 2. Each run of middle-block nodes in the small graph (1 then 2 in the forward,
    2 then 1 in the backward) becomes copies 1..L-2 (or L-2..1) of block 2's nodes.
    Placeholders keep AOTAutograd's ``primals_k`` numbering; outputs keep its order: the
    buffers' new values, then one gradient slot per primal input.

    Refused (`NotRepeatable`), since the copies would not be the full trace: a tensor tied
    across blocks; a node reading blocks further apart than neighbours; blocks 1 and 2 not
    alike; a node outside the middle blocks reading one of their values, other than block 0
    reading block 1 and block 3 reading block 2 (an auxiliary loss summed over layers), or
    one of their tensors (only the output reads them: their gradients); middle-block nodes
    interleaved otherwise than one block's run after the other's; outputs not laid out as
    described.
    """

    seq: _SeqNumbers  # found by the checks
    runs: _Runs

    def __init__(self, small: TrainingGraph, stack: BlockStack) -> None:
        self.small = small
        self.stack = stack
        self.count = stack.count
        self.extra = stack.count - _TRACED  # the middle copies the small graph lacks
        self.nodes: list[fx.Node] = list(small.gm.graph.nodes)
        self.spec: dict[str, GraphInput] = {i.node: i for i in small.inputs}
        self.holders: list[fx.Node] = [n for n in self.nodes if n.op == "placeholder"]
        self.block: dict[fx.Node, int | None] = {}
        self.members: dict[int, list[fx.Node]] = {}
        self.pos: dict[fx.Node, int] = {}  # a node's index among its block's members
        self.suffix: dict[fx.Node, str] = {}  # a block tensor's name inside its block
        # the long graph: (traced node, copy) -> new node; copy None for nodes kept as they are
        self.new = fx.Graph()
        self.env: dict[tuple[fx.Node, int | None], fx.Node] = {}
        self.tensor_of: dict[tuple[int, str], fx.Node] = {}  # (block, suffix) -> new placeholder
        self.new_inputs: list[GraphInput] = []
        self.new_primals: list[tuple[fx.Node, int | None]] = []  # in the new graph's order
        self.values: list = []
        self.new_outputs: list[GraphOutput] = []

    def run(self) -> TrainingGraph:
        """Check the small graph repeats, then write and return the long one."""
        stack = self.stack
        if any(stack.index(a) is not None or stack.index(c) is not None for a, c in self.small.aliases.items()):
            raise NotRepeatable("a tensor tied across blocks")
        self._assign_blocks()
        self._group_members()
        self._check_alike()
        self.seq = self._check_sequence_numbers()
        self._check_outside_reads()
        self.runs = self._find_runs()
        self._write_placeholders()
        self._write_body()
        self._write_outputs()
        return self._result()

    # -- which block each node belongs to ---------------------------------------------------

    def _assign_blocks(self) -> None:
        """Each node's block: its module label; placeholders by their tensor; unlabelled nodes
        (autograd's gradient sums, code in the parent's forward) by their inputs."""
        stack, block = self.stack, self.block
        for n in self.nodes:
            if n.op == "output":
                continue
            if n.op == "placeholder":
                s = self.spec.get(n.name)
                block[n] = stack.index(s.name) if s is not None and s.kind in ("param", "buffer") else None
                continue
            label = n.meta.get("module", "")
            if stack.index(label) is not None:
                block[n] = stack.index(label)
            elif not stack.encloses(label):
                block[n] = None  # a module outside the stack: the embedding, the head, the loss
            else:
                block[n] = self._block_of_join(n)

    def _block_of_join(self, n: fx.Node) -> int | None:
        """The block of code around the stack, by its inputs. The sum of the residual stream's
        gradient reads block b+1's part and block b's: it is block b's backward (and a forward
        join is the later block's)."""
        found = sorted({self.block[a] for a in n.all_input_nodes if self.block.get(a) is not None})
        if len(found) > 2 or (len(found) == 2 and found[1] - found[0] != 1):
            raise NotRepeatable(f"{n.name} reads blocks {found}")
        backward = n.meta.get("partitioner_tag") == "is_backward"
        return (found[0] if backward else found[-1]) if found else None

    def _group_members(self) -> None:
        """Each block's nodes in order, a node's position in its block, a tensor's suffix."""
        self.members = {b: [] for b in range(_TRACED)}
        for n in self.nodes:
            if n.op not in ("placeholder", "output") and self.block[n] is not None:
                self.members[self.block[n]].append(n)
        self.pos = {n: i for b in self.members for i, n in enumerate(self.members[b])}
        depth = len(self.stack.path.split(".")) + 1
        self.suffix = {n: self.spec[n.name].name.split(".", depth)[-1]
                       for n in self.holders if self.block[n] is not None}

    # -- the checks that make block 2 a template ---------------------------------------------

    def _role(self, a: fx.Node, b: int):
        """What input ``a`` of a node of block ``b`` is, relative to ``b``."""
        ab = self.block.get(a)
        if ab is None:
            return ("outside", a)
        if a.op == "placeholder":
            if ab != b:
                raise NotRepeatable(f"block {b} reads block {ab}'s tensor {a.name}")
            return ("tensor", self.suffix[a])
        if ab - b not in (-1, 0, 1):
            raise NotRepeatable(f"block {b} reads block {ab}")
        return (ab - b, self.pos[a])

    def _signature(self, n: fx.Node, b: int) -> tuple:
        """Node ``n`` of block ``b`` as compared with its twin in the other middle block."""
        roles: list = []
        fx.node.map_arg((n.args, n.kwargs), lambda a: roles.append(self._role(a, b)) or a)
        label = n.meta.get("module", "")
        stack = self.stack
        return (n.op, n.target, _val_sig(n), n.meta.get("partitioner_tag"), tuple(roles),
                stack.rename(label, 0) if stack.index(label) is not None else label,
                _plain_args((n.args, n.kwargs)))

    def _check_alike(self) -> None:
        one, two = self.members[1], self.members[2]
        if len(one) != len(two) or not two:
            raise NotRepeatable("blocks 1 and 2 traced to different node counts")
        for x, y in zip(one, two):
            if self._signature(x, 1) != self._signature(y, 2):
                raise NotRepeatable(f"{x.name} and {y.name} (blocks 1 and 2) differ")

    def _check_sequence_numbers(self) -> _SeqNumbers:
        """The middle blocks' own numbers repeat with a step; the others (the gradient sums
        carry the loss's) are equal in both and shift with the blocks after them."""
        one, two = self.members[1], self.members[2]
        own = [[n.meta["seq_nr"] for n in m if "seq_nr" in n.meta and n.meta.get("partitioner_tag") != "is_backward"]
               for m in (one, two)]
        if not own[0] or not own[1]:
            raise NotRepeatable("the middle blocks have no forward nodes")
        seq = _SeqNumbers(min(own[0]), max(own[0]), min(own[1]), max(own[1]))
        if seq.end - seq.hi1 != seq.step or seq.lo2 <= seq.hi1:
            raise NotRepeatable("sequence numbers do not repeat")
        for x, y in zip(one, two):
            sx, sy = x.meta.get("seq_nr"), y.meta.get("seq_nr")
            if (sx is None) != (sy is None):
                raise NotRepeatable("sequence numbers differ")
            if sx is not None and not (sy - sx == seq.step and seq.lo1 <= sx <= seq.hi1) and \
                    not (sx == sy and (sx > seq.end or sx < seq.lo1)):
                raise NotRepeatable(f"sequence numbers of {x.name} and {y.name} do not repeat")
        return seq

    def _check_outside_reads(self) -> None:
        """Only neighbours read the middle blocks' values, only the output their tensors' gradients."""
        block = self.block
        for n in self.nodes:
            if n.op == "output" or block.get(n) in (1, 2):
                continue
            for a in n.all_input_nodes:
                if block.get(a) in (1, 2) and (a.op == "placeholder" or (block[n], block[a]) not in ((0, 1), (3, 2))):
                    raise NotRepeatable(f"{n.name} (outside the middle blocks) reads {a.name}")

    def _find_runs(self) -> _Runs:
        """Block 1's placeholder runs (`_Runs`); its tensors must be block 2's."""
        block, suffix = self.block, self.suffix
        twin = {suffix[n]: n for n in self.holders if block[n] == 2}
        runs: list[list[fx.Node]] = []
        for i, n in enumerate(self.holders):
            if block[n] == 1:
                if i and block[self.holders[i - 1]] == 1:
                    runs[-1].append(n)
                else:
                    runs.append([n])
        if sorted(suffix[n] for run in runs for n in run) != sorted(twin):
            raise NotRepeatable("blocks 1 and 2 have different tensors")
        grown = np.cumsum([0] + [self.extra * len(run) for run in runs])
        return _Runs(runs, {n: r for r, run in enumerate(runs) for n in run}, twin, grown)

    # -- writing the long graph ----------------------------------------------------------------

    def _instance(self, b: int) -> int:
        """The block of the model that kept traced block ``b`` (0 or 3) stands for."""
        return {0: 0, 3: self.count - 1}[b]

    def _fix_meta(self, node: fx.Node, src: fx.Node, copy: int | None) -> None:
        """``src``'s meta on its copy ``node``: module label renamed, sequence number moved."""
        node.meta = dict(src.meta)
        label = node.meta.get("module", "")
        if self.stack.index(label) is not None:
            block = copy if copy is not None else self._instance(self.block.get(src))
            node.meta["module"] = self.stack.rename(label, block)
            group = node.meta.get("expert_group")
            if group is not None:  # grouped experts: the list of this block (labelled "<list>.*")
                node.meta["expert_group"] = (node.meta["module"].removesuffix(".*"), group[1])
        seq = node.meta.get("seq_nr")
        if seq is not None:
            node.meta["seq_nr"] = self.seq.renumber(seq, copy, self.extra)

    def _shift(self, n: fx.Node) -> int:
        """How far ``n``'s ``primals_k`` number moves: the extra copies of block 1's runs
        numbered before it (tied tensors leave gaps in AOTAutograd's numbering)."""
        runs = self.runs
        return int(runs.grown[sum(1 for run in runs.runs if _number(run[0]) < _number(n))])

    def _placeholder(self, src: fx.Node, copy: int | None, anchor: fx.Node | None = None) -> None:
        """Write placeholder ``src`` (as ``copy``; ``anchor``: block 1's placeholder of this
        run and position) with its number, meta and input record."""
        name = src.name
        if copy is not None:
            run = self.runs.runs[self.runs.run_of[anchor]]
            first = run[0]
            name = f"primals_{_number(first) + self._shift(first) + (copy - 1) * len(run) + run.index(anchor)}"
        elif _number(src):
            name = f"primals_{_number(src) + self._shift(src)}"
        node = self.new.placeholder(name)
        self._fix_meta(node, src, copy)
        s = self.spec.get(src.name)
        if s is None or s.kind not in ("tangent", "zero_tangent"):
            self.new_primals.append((src, copy))
        if s is not None:
            b = self.block[src]
            where = None if b is None else (copy if copy is not None else self._instance(b))
            self.new_inputs.append(GraphInput(node.name, s.kind, s.name if b is None else self.stack.rename(s.name, where)))
            if b is not None:
                self.tensor_of[(where, self.suffix[src])] = node
        self.env[(src, copy)] = node

    def _write_placeholders(self) -> None:
        """Placeholders in order, each run of block 1's replaced by its copies 1..L-2."""
        runs = self.runs
        for n in self.holders:
            if self.block[n] == 2:
                continue
            if self.block[n] != 1:
                self._placeholder(n, None)
            elif n is runs.runs[runs.run_of[n]][0]:
                for copy in range(1, self.count - 1):
                    for m in runs.runs[runs.run_of[n]]:
                        self._placeholder(runs.twin[self.suffix[m]], copy, anchor=m)

    def _arg_of(self, a: fx.Node, b: int | None, copy: int | None) -> fx.Node:
        """The new node an input ``a`` of a node of block ``b`` (this ``copy``) stands for."""
        ab, env, pos, two = self.block.get(a), self.env, self.pos, self.members[2]
        if copy is None:  # a kept node: block 0 reads copy 1's values, block 3 copy L-2's
            if ab in (1, 2) and a.op != "placeholder":
                return env[(two[pos[a]], 1 if ab == 1 else self.count - 2)]
            return env[(a, None)]
        if ab is None:
            return env[(a, None)]
        if a.op == "placeholder":
            return self.tensor_of[(copy, self.suffix[a])]
        other = copy + (ab - b)
        if other == 0:
            return env[(self.members[0][pos[a]], None)]
        if other == self.count - 1:
            return env[(self.members[3][pos[a]], None)]
        return env[(two[pos[a]], other)]

    def _emit(self, src: fx.Node, copy: int | None) -> None:
        """Write node ``src`` as ``copy`` (None: kept as it is)."""
        b = self.block.get(src) if copy is not None else None
        args = fx.node.map_arg(src.args, lambda a: self._arg_of(a, b, copy))
        kwargs = fx.node.map_arg(src.kwargs, lambda a: self._arg_of(a, b, copy))
        # the tracer's names: the op's name, numbered in order of appearance
        node = self.new.create_node(src.op, src.target, args, kwargs, name=re.sub(r"_\d+$", "", src.name))
        self._fix_meta(node, src, copy)
        self.env[(src, copy)] = node

    def _write_body(self) -> None:
        """Nodes in order; each run of middle-block nodes is block 1 then block 2 (forward) or
        2 then 1 (backward), written as block 2's nodes once per copy."""
        block, pos = self.block, self.pos
        body = [n for n in self.nodes if n.op not in ("placeholder", "output")]
        i = 0
        while i < len(body):
            n = body[i]
            if block[n] not in (1, 2):
                self._emit(n, None)
                i += 1
                continue
            j = i
            while j < len(body) and block[body[j]] in (1, 2):
                j += 1
            run = body[i:j]
            firsts = [m for m in run if block[m] == block[run[0]]]
            seconds = run[len(firsts):]
            if [pos[m] for m in firsts] != [pos[m] for m in seconds] or any(block[m] == block[run[0]] for m in seconds):
                raise NotRepeatable(f"the middle blocks' nodes from {run[0].name} are interleaved")
            copies = range(1, self.count - 1) if block[run[0]] == 1 else range(self.count - 2, 0, -1)
            for copy in copies:
                for m in firsts:
                    self._emit(self.members[2][pos[m]], copy)
            i = j

    def _put(self, value, o: GraphOutput | None, name: str | None = None) -> None:
        if o is not None:
            self.new_outputs.append(GraphOutput(len(self.values), o.kind, name or o.name))
        self.values.append(value)

    def _write_outputs(self) -> None:
        """The forward's outputs (the buffers' new values first, block by block: the middle
        blocks' where block 1's were), then one gradient slot per primal placeholder, in the
        new placeholders' order (None for buffers and inputs)."""
        out_node = self.nodes[-1]
        outs = list(out_node.args[0])
        spec = self.spec
        primals = [n for n in self.holders if spec.get(n.name) is None or spec[n.name].kind not in ("tangent", "zero_tangent")]
        lead = len(outs) - len(primals)
        by_index = {o.index: o for o in self.small.outputs}
        if lead < 0 or any(o.kind == "grad" and (o.index < lead or spec[primals[o.index - lead].name].name != o.name)
                           for o in self.small.outputs):
            raise NotRepeatable("the gradient outputs are not one per input in order")
        self._forward_outputs(outs, lead, by_index)
        self._gradient_outputs(outs, {n: lead + i for i, n in enumerate(primals)}, by_index)
        out = self.new.output(type(out_node.args[0])(self.values))
        out.meta = dict(out_node.meta)
        out.meta.pop("desc", None)  # the traced graph's descriptors name four blocks

    def _forward_outputs(self, outs: list, lead: int, by_index: dict[int, GraphOutput]) -> None:
        stack = self.stack
        middle = [o for o in self.small.outputs if o.index < lead and o.kind == "buffer" and stack.index(o.name) in (1, 2)]
        for index in range(lead):
            value, o = outs[index], by_index.get(index)
            b = stack.index(o.name) if o is not None and o.kind == "buffer" else None
            if b in (1, 2):
                if o is middle[0]:
                    template = [x for x in middle if stack.index(x.name) == 2]
                    if len(template) * 2 != len(middle):
                        raise NotRepeatable("blocks 1 and 2 update different buffers")
                    for copy in range(1, self.count - 1):
                        for x in template:
                            self._put(self.env[(outs[x.index], copy)], x, stack.rename(x.name, copy))
                continue
            if isinstance(value, fx.Node) and self.block.get(value) in (1, 2):
                raise NotRepeatable(f"output {index} is a value of a middle block")
            self._put(fx.node.map_arg(value, lambda a: self._arg_of(a, None, None)), o,
                      None if b is None else stack.rename(o.name, self._instance(b)))

    def _gradient_outputs(self, outs: list, slot: dict[fx.Node, int], by_index: dict[int, GraphOutput]) -> None:
        stack = self.stack
        for src, copy in self.new_primals:
            value, o = outs[slot[src]], by_index.get(slot[src])
            if copy is not None:
                self._put(None if value is None else self.env[(value, copy)], o, o and stack.rename(o.name, copy))
            else:
                b = self.block.get(src)
                self._put(fx.node.map_arg(value, lambda a: self._arg_of(a, None, None)), o,
                          o and (o.name if b is None else stack.rename(o.name, self._instance(b))))

    def _result(self) -> TrainingGraph:
        small = self.small
        long = _make_graph_module(small.gm, self.new)  # lazy code under `_use_lazy_graph_module`
        shapes, dtypes = {}, {}
        placeholders = {n.name: n for n in long.graph.nodes if n.op == "placeholder"}
        for s in self.new_inputs:
            if s.kind == "param":
                val = placeholders[s.node].meta["val"]
                shapes[s.name], dtypes[s.name] = tuple(int(d) for d in val.shape), val.dtype
        return TrainingGraph(gm=long, inputs=self.new_inputs, outputs=self.new_outputs, param_shapes=shapes,
                             param_dtypes=dtypes, aliases=dict(small.aliases),
                             capture_time_s=small.capture_time_s, preflight_time_s=small.preflight_time_s)


def _plain_args(tree) -> tuple:
    """The non-node leaves of an argument tree (constants, dtypes, shapes), for comparing."""
    leaves: list = []

    def walk(x):
        if isinstance(x, (list, tuple)):
            for y in x:
                walk(y)
        elif isinstance(x, dict):
            for k in sorted(x):
                leaves.append(k)
                walk(x[k])
        elif not isinstance(x, fx.Node):
            leaves.append(repr(x))

    walk(tree)
    return tuple(leaves)
