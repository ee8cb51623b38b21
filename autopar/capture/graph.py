"""What a captured training step is: the joint graph and what each input and output means."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch.utils import _pytree as pytree


@dataclass(frozen=True)
class GraphInput:
    """One placeholder of the joint graph.

    kind: "param", "buffer", "input" (a user input), "tangent" (the loss's seed gradient) or
    "zero_tangent" (the seed gradient of another output the model returns, e.g. logits: 0).
    name: the parameter's or buffer's qualified name; ``input{i}`` for user inputs.
    """

    node: str
    kind: str
    name: str


@dataclass(frozen=True)
class GraphOutput:
    """One output of the joint graph.

    kind: "loss"; "grad" (name = the parameter); "other" (name ``output{k}``: the k-th other
    tensor the forward returns, `OutputTree`); "buffer" (name = the buffer whose new value
    this is: the forward updated it in place, as BatchNorm's running statistics, and the
    functionalised graph returns the updated value instead); or "other".
    """

    index: int
    kind: str
    name: str


@dataclass
class OutputTree:
    """The structure of what the forward returns, beside the loss the step trains on.

    The graph returns ``(loss, *others)``: the loss, then every other tensor leaf of the
    module's output (logits, a dict's or ModelOutput's fields), detached, so only the loss is
    differentiated. ``spec`` is the output's pytree; ``loss_leaf`` the loss's position among
    its leaves, ``tensor_leaves`` those of the other tensors (in the graph's order), ``consts``
    the leaves that are no tensor (None fields, Python numbers), returned as traced.
    """

    spec: pytree.TreeSpec
    loss_leaf: int
    tensor_leaves: list[int]
    consts: dict[int, object]

    @classmethod
    def of(cls, out, loss: torch.Tensor) -> OutputTree:
        """The tree of the forward's output ``out`` whose leaf ``loss`` is the loss."""
        leaves, spec = pytree.tree_flatten(out)
        loss_leaf = next(i for i, x in enumerate(leaves) if x is loss)
        tensors = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor) and i != loss_leaf]
        consts = {i: x for i, x in enumerate(leaves) if not isinstance(x, torch.Tensor)}
        return cls(spec, loss_leaf, tensors, consts)

    def flat(self, out) -> tuple[torch.Tensor, ...]:
        """``(loss, *others detached)`` of an output of this structure (what the graph returns)."""
        leaves = pytree.tree_leaves(out)
        return (leaves[self.loss_leaf], *(leaves[i].detach() for i in self.tensor_leaves))

    def build(self, loss, others):
        """The module's output structure from the loss and the other tensors (graph order)."""
        leaves = [None] * self.spec.num_leaves
        leaves[self.loss_leaf] = loss
        for i, value in zip(self.tensor_leaves, others):
            leaves[i] = value
        for i, value in self.consts.items():
            leaves[i] = value
        return pytree.tree_unflatten(leaves, self.spec)


@dataclass
class TrainingGraph:
    """A captured training step: the joint FX graph and what each input and output is.

    Call `run` with real tensors to execute the step: it returns the loss and a dict of
    gradients keyed by parameter name, the same numbers eager autograd gives, and updates the
    buffers the forward mutates in place, as an eager training step does.
    """

    gm: torch.fx.GraphModule
    inputs: list[GraphInput]
    outputs: list[GraphOutput]
    param_shapes: dict[str, tuple[int, ...]]
    param_dtypes: dict[str, torch.dtype]
    aliases: dict[str, str] = field(default_factory=dict)  # tied name -> canonical name
    capture_time_s: float = 0.0
    preflight_time_s: float = 0.0
    capture_note: str = ""  # how a stack of blocks was traced (autopar.capture.repeat)
    # the forward's output structure; None where it is the loss alone. Its other tensors are
    # the "other" outputs named output1, output2, ... (in `OutputTree.tensor_leaves` order)
    output_tree: OutputTree | None = None

    @property
    def graph(self) -> torch.fx.Graph:
        """The joint graph."""
        return self.gm.graph

    @property
    def param_names(self) -> list[str]:
        """Canonical (de-duplicated) parameter names in placeholder order."""
        return [i.name for i in self.inputs if i.kind == "param"]

    @property
    def num_params(self) -> int:
        """Parameters counted once each (tied weights once)."""
        total = 0
        for name in self.param_names:
            n = 1
            for d in self.param_shapes[name]:
                n *= d
            total += n
        return total

    def input_nodes(self, kind: str) -> list[str]:
        """Placeholder node names of one kind."""
        return [i.node for i in self.inputs if i.kind == kind]

    def _lookup(self, tensors: Mapping[str, torch.Tensor], name: str) -> torch.Tensor:
        """A tensor by its graph name or by any tied alias of it."""
        if name in tensors:
            return tensors[name]
        for alias, canonical in self.aliases.items():
            if canonical == name and alias in tensors:
                return tensors[alias]
        raise KeyError(f"no tensor named {name!r} (or a tied alias of it) was given")

    def run(
        self,
        params: Mapping[str, torch.Tensor],
        *user_inputs: torch.Tensor,
        buffers: Mapping[str, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Execute the captured step on real tensors: returns (loss, {param name: grad}).

        Buffers the forward updates (the "buffer" outputs: BatchNorm's running statistics, a
        step counter) are written back into the tensors given in ``buffers``, in place, as
        eager ``loss = model(...); loss.backward()`` updates the module's buffers.
        """
        buffers = buffers or {}
        primals = []
        for inp in self.inputs:
            if inp.kind == "param":
                primals.append(self._lookup(params, inp.name))
            elif inp.kind == "buffer":
                primals.append(self._lookup(buffers, inp.name))
            elif inp.kind == "input":
                primals.append(user_inputs[int(inp.name[len("input"):])])
        device = user_inputs[0].device if user_inputs else torch.device("cpu")
        # The seed gradient of the loss is 1: the graph was traced for loss.backward(); the
        # other outputs' gradients are 0 (they are returned, not differentiated).
        seeds = {name: torch.ones for name in self.input_nodes("tangent")}
        seeds.update({name: torch.zeros for name in self.input_nodes("zero_tangent")})
        tangents = [
            seeds[n.name](tuple(n.meta["val"].shape), dtype=n.meta["val"].dtype, device=device)
            for n in self.gm.graph.nodes
            if n.op == "placeholder" and n.name in seeds
        ]
        loss_index = next(o.index for o in self.outputs if o.kind == "loss")
        with torch.no_grad():
            out = self.gm(*primals, *tangents)
            # the graph is functional: it returns the new values; eager mutates in place
            for o in self.outputs:
                if o.kind == "buffer":
                    self._lookup(buffers, o.name).copy_(out[o.index])
        grads = {o.name: out[o.index] for o in self.outputs if o.kind == "grad"}
        return out[loss_index], grads
