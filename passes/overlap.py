"""Communication overlapped with compute: a scheduling pass over a rank's graph.

The passes that insert collectives (tensor parallelism above all) write each one as
``wait_tensor(collective(x))`` right before the op that needs it, so nothing runs while it is in
flight. This pass reorders the graph, changing no value, so that each functional collective
(``_c10d_functional.*``) is issued as early as its input allows and waited for as late as its
first use allows, the independent compute running in between:

1. **Issue early.** For a collective c, scan back from c over a window W (stopping at the
   previous collective, at a wait that c needs, at a barrier, or after ``window`` nodes). The
   nodes of W that c (transitively) needs, D, keep their order; the others, I, move after c:

       [... W ..., c]  ->  [D, c, I]

   I reads nothing of c (else it would not precede c), and no node of D reads I (else it would
   be in D), so [D, c, I] is a topological order. In the backward of a column-parallel matmul
   (Y = X W_i), D is the input gradient's chain (dX = dY W_i^T, the partial sum c reduces) and I
   holds the weight gradient (dW_i = dY^T X): dW_i is computed while dX is being reduced, as
   Megatron does.
2. **Wait late.** Each wait, with the views of its result that follow it (split, getitem, cat,
   view ...), moves to right before the first other op that reads them, staying in its phase
   (forward or backward) and before any op that mutates an input or is not aten.

Rules that keep every rank's execution correct and deadlock-free:

- No collective moves past another: the issue order of all collectives, on every process
  group, is the graph's, the same on every rank (the reorder depends on the graph only).
- A barrier is never crossed by an issue's window: a random op (the generator's draw order
  stays), an op that mutates an input, an op outside aten (a custom op may communicate), a
  placeholder, the forward/backward boundary. A collective that mutates its input
  (``all_reduce_``) is not moved.
- Only D (the collective's own producers, a bounded window) moves earlier, so the peak of live
  memory moves by at most the collective's output held over I (`runtime.memory.peak_live_bytes`
  before and after is in tests/passes/test_overlap.py).

Each moved wait's ``meta["autopar"]`` ends with "overlapped with N ops" (N: the compute ops now
between its issue and it), which `pm.dump_graph()` prints; ``meta["overlap_ops"]`` holds N.
"""

from __future__ import annotations

import operator
import os
from dataclasses import dataclass, field

import torch
from torch import fx

from passes.recompute import is_backward, is_random

aten = torch.ops.aten
c10d = torch.ops._c10d_functional

ENV_SWITCH = "AUTOPAR_OVERLAP"  # "0": keep every wait right after its issue (measured baseline)
WINDOW = 160  # the most nodes an issue's window reaches back (a block's backward section)

# Ops that only rearrange or copy their input: moved with a wait (they read nothing else new).
_VIEWS = {
    aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.permute.default,
    aten.transpose.int, aten.t.default, aten.expand.default, aten.unsqueeze.default,
    aten.squeeze.dim, aten.squeeze.default, aten.alias.default, aten.detach.default,
    aten.slice.Tensor, aten.select.int, aten.split.Tensor, aten.split_with_sizes.default,
    aten.chunk.default, aten.cat.default, aten.clone.default, aten.as_strided.default,
    operator.getitem,
}


@dataclass
class OverlapReport:
    """What `overlap_communication` did: per collective issue (node name), the compute ops now
    between it and its wait; and how many nodes it moved."""

    overlapped: dict[str, int] = field(default_factory=dict)
    moved: int = 0


def enabled() -> bool:
    """Whether the overlap pass runs (`ENV_SWITCH` unset or not "0")."""
    return os.environ.get(ENV_SWITCH, "1") != "0"


def is_collective(node: fx.Node) -> bool:
    """A functional collective's issue (not its wait)."""
    return _namespace(node) == "_c10d_functional" and node.target is not c10d.wait_tensor.default


def is_wait(node: fx.Node) -> bool:
    """A functional collective's ``wait_tensor``."""
    return node.op == "call_function" and node.target is c10d.wait_tensor.default


def overlap_communication(gm: fx.GraphModule, window: int = WINDOW) -> OverlapReport:
    """Reorder ``gm`` in place: every collective issued early, every wait late (the module
    docstring gives the rule). Values, and the order of the collectives, are unchanged."""
    report = OverlapReport()
    order_before = [n.name for n in gm.graph.nodes if is_collective(n)]
    for c in [n for n in gm.graph.nodes if is_collective(n)]:
        report.moved += _issue_early(c, window)
    for w in [n for n in gm.graph.nodes if is_wait(n)]:
        report.moved += _wait_late(w)
    if [n.name for n in gm.graph.nodes if is_collective(n)] != order_before:  # by construction
        raise RuntimeError("the overlap pass changed the collectives' order: a bug in passes/overlap.py")
    gm.graph.lint()
    gm.recompile()
    for c in gm.graph.nodes:
        if not is_collective(c):
            continue
        waits = [u for u in c.users if is_wait(u)]
        if not waits:
            continue
        n = _compute_between(c, waits[0])
        report.overlapped[c.name] = n
        if n:
            w = waits[0]
            w.meta["overlap_ops"] = n
            reason = w.meta.get("autopar") or c.meta.get("autopar") or "wait"
            w.meta["autopar"] = f"{reason}; overlapped with {n} ops"
    return report


def _issue_early(c: fx.Node, window: int) -> int:
    """Move the nodes before ``c`` that it does not need after it ([W, c] -> [D, c, I])."""
    if _mutates(c):
        return 0
    phase = is_backward(c)
    needed: set[fx.Node] = {c}
    independent: list[fx.Node] = []
    n = c.prev
    for _ in range(window):
        if n.op == "root" or is_collective(n) or is_barrier(n) or is_backward(n) != phase:
            break
        if any(u in needed for u in n.users):
            if is_wait(n):  # a wait c needs stays before it: its own overlap is not shortened
                break
            needed.add(n)
        else:
            independent.append(n)
        n = n.prev
    anchor = c
    for node in reversed(independent):  # back to graph order, right after c
        anchor.append(node)
        anchor = node
    return len(independent)


def _wait_late(w: fx.Node) -> int:
    """Move ``w`` and the views of its result right before the first other op reading them."""
    if any(_mutates(i) for i in w.all_input_nodes):  # an in-place collective: its input's
        return 0  # readers may alias the result
    phase = is_backward(w)
    members = {w}
    chain: list[fx.Node] = []
    n = w.next
    while n.op != "output" and is_backward(n) == phase and not _writes(n):
        if any(i in members for i in n.all_input_nodes):
            if n.op != "call_function" or n.target not in _VIEWS:
                break
            members.add(n)
            chain.append(n)
        n = n.next
    target = n
    if target is w.next or (chain and target is chain[-1].next and _contiguous(w, chain)):
        return 0
    for node in [w, *chain]:
        target.prepend(node)
    return 1 + len(chain)


def _contiguous(w: fx.Node, chain: list[fx.Node]) -> bool:
    n = w
    for node in chain:
        if n.next is not node:
            return False
        n = node
    return True


def _compute_between(c: fx.Node, w: fx.Node) -> int:
    """The ops between issue ``c`` and wait ``w`` that compute (no view, no communication)."""
    count, n = 0, c.next
    while n is not w and n.op != "output":
        if n.op == "call_function" and n.target not in _VIEWS and _namespace(n) != "_c10d_functional":
            count += 1
        n = n.next
    return count


def _namespace(node: fx.Node) -> str:
    if node.op != "call_function":
        return ""
    return getattr(node.target, "namespace", "")


def _mutates(node: fx.Node) -> bool:
    schema = getattr(node.target, "_schema", None)
    return bool(schema is not None and schema.is_mutable)


def _writes(node: fx.Node) -> bool:
    """An op a wait and its views do not pass: one that mutates an input (a moved view or cat
    would read the written value) or a custom op (it may)."""
    custom = node.op == "call_function" and node.target is not operator.getitem and \
        _namespace(node) not in ("aten", "_c10d_functional")
    return custom or _mutates(node)


def is_barrier(node: fx.Node) -> bool:
    """A node no issue's window crosses (the module docstring lists them)."""
    if node.op == "get_attr":
        return False
    if node.op != "call_function":
        return True
    if node.target is operator.getitem:
        return False
    if _namespace(node) != "aten" or _mutates(node):
        return True
    return is_random(node)
