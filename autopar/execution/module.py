"""`ParallelModule`: the parallelised model, used like the original.

``loss = pm(*batch)`` runs this rank's graph (`runtime.executor.run_step`); ``pm.parameters()``
are DTensors with the plan's placements; ``pm.dump_graph()`` prints the rank's graph with each
collective commented with the decision behind it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from autopar.errors import InputError
from autopar.planning.plan import Plan
from runtime.executor import RankGraph, run_step
from runtime.pipeline import PipelinePlan


class ParallelModule(nn.Module):
    """The model, parallelised: call it like the original; its parameters are DTensors."""

    def __init__(self, module: nn.Module, rank_graph: RankGraph, plan: Plan, mesh: DeviceMesh,
                 input_shapes: list[tuple[int, ...]], canonical: list[str],
                 local_batch: bool = False, unloaded: set[str] | None = None) -> None:
        super().__init__()
        # adopt the copy's children, weights and buffers: names stay those of the original
        self._modules.update(module._modules)
        self._parameters.update(module._parameters)
        self._buffers.update(module._buffers)
        self.plan = plan
        self.mesh = mesh
        self._rank_graph = rank_graph
        self._input_shapes = input_shapes
        self._canonical = canonical
        self._local_batch = local_batch
        self._unloaded = set(unloaded or ())  # shards of a meta model not yet filled

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """`nn.Module.load_state_dict`; for a model parallelised from the meta device this is
        how its shards are filled (after ``torch.distributed.checkpoint.load(sd, ...)``)."""
        result = super().load_state_dict(state_dict, strict=strict, assign=assign)
        self._unloaded -= set(state_dict)
        return result

    def forward(self, *batch: torch.Tensor) -> torch.Tensor:
        """The loss of the whole (global) batch; ``loss.backward()`` fills the gradients.

        With ``local_batch=True`` at `parallelize`, ``batch`` is this rank's data-parallel
        slice (ranks of one TP group pass the same slice)."""
        if self._unloaded:
            raise InputError(
                f"the model was parallelised from the meta device and {len(self._unloaded)} "
                f"parameters (e.g. {sorted(self._unloaded)[0]!r}) hold no values yet.\n  fix: fill "
                "the shards from a checkpoint first: sd = pm.state_dict(); "
                "torch.distributed.checkpoint.load(sd, checkpoint_id=...); pm.load_state_dict(sd)")
        shapes = [tuple(x.shape) for x in batch]
        if shapes != self._input_shapes:
            what = "this rank's slice of the example inputs" if self._local_batch else "the example inputs"
            raise InputError(
                f"batch shapes {shapes} differ from {what}, {self._input_shapes}, that the step "
                "was planned for: call autopar.parallelize again with these shapes"
            )
        dp = self.plan.layout.dp
        local = batch if self._local_batch else tuple(x.chunk(dp, dim=0)[_dp_rank(self.mesh)] for x in batch)
        named = dict(self.named_parameters(remove_duplicate=False))
        params = [(name, named[name]) for name in self._canonical]
        buffers = dict(self.named_buffers())
        return run_step(self._rank_graph, params, buffers, local)

    def dump_graph(self, rank: int | None = None) -> str:
        """This rank's graph as Python, each collective commented with the decision behind it."""
        me = dist.get_rank() if dist.is_initialized() else 0
        head = f"# per-rank graph of rank {me} (layout {self.plan.layout.short()})"
        if rank is not None and rank != me:
            head += f"; rank {rank} runs the same graph on its own shards"
        if self._rank_graph.pipeline is not None:
            if rank is not None and rank != me:
                head += " if it runs the same pipeline stage (each stage runs its own graphs)"
            return _dump_stage(head, self._rank_graph.pipeline, self.plan)
        nodes = list(self._rank_graph.gm.graph.nodes)
        reasons = {n.name: n.meta["autopar"] for n in nodes if "autopar" in n.meta}
        lines = [head]
        if self._rank_graph.accumulate_gm is not None:
            lines.append(f"# the last of {self._rank_graph.micro_batches} micro-batches; the earlier ones run it "
                         "without the gradient reduction, and their sums come in as 'accum' inputs")
        lines.append("# inputs:")
        placeholders = [n for n in nodes if n.op == "placeholder"]
        for node, (kind, name) in zip(placeholders, self._rank_graph.inputs):
            part = "one micro-batch of this rank's slice" if self._rank_graph.micro_batches > 1 else "this rank's slice"
            label = {"input": f"batch input {name} ({part})",
                     "tangent": "seed gradient of the loss (1 / grad_accum, or with labels ignored "
                                "dp x this micro-batch's share of the step's valid tokens)"}
            note = reasons.get(node.name, "")
            lines.append(f"#   {node.name}: {label.get(kind, f'{kind} {name}')}" + (f" -- {note}" if note else ""))
        for line in self._rank_graph.gm.code.splitlines():
            name = line.strip().split(" = ")[0] if " = " in line else ""
            if name in reasons and not line.strip().startswith("#"):
                line = f"{line}  # {reasons[name]}"
            lines.append(line)
        return "\n".join(lines)


def _dump_stage(head: str, pipeline: PipelinePlan, plan: Plan) -> str:
    """The forward and backward graphs of this rank's pipeline stages, inputs and outputs named."""
    n = pipeline.graphs.pp
    lines = [head]
    for s in pipeline.stages:
        graphs = pipeline.graphs.stages[s]
        first, last = plan.stages[s]
        where = ("the embedding, " if s == 0 else "") + f"blocks {first}..{last}" + \
            (", the head and the loss" if s == n - 1 else "")
        lines.append(f"# pipeline stage {s} of {n} on pipeline rank {pipeline.rank} of {pipeline.pp} "
                     f"({where}), schedule {pipeline.schedule}, {plan.layout.grad_accum} micro-batches; "
                     f"parameters held: {len(graphs.params)}"
                     + (f"; shared with other ranks: {sorted(pipeline.shared_groups)}"
                        if pipeline.shared_groups else ""))
        sends = f"{graphs.n_sends} values sent to stage {s + 1}, " if s < n - 1 else ""
        lines += _stage_graph_lines(s, graphs.forward, graphs.forward_inputs, "forward",
                                    sends + f"{graphs.n_saved} saved for the backward"
                                    + (", the loss x its seed" if graphs.has_loss else ""))
        grads = f"{graphs.n_grad_sends} gradient slots sent to stage {s - 1}, " if s > 0 else ""
        split = graphs.weight_split
        if split is None:
            lines += _stage_graph_lines(s, graphs.backward, graphs.backward_inputs, "backward",
                                        grads + f"gradients of {len(graphs.grads)} parameters")
        else:  # zero-bubble: the weight half runs later, in the schedule's W action
            lines += _stage_graph_lines(s, split.input_grad, split.input_grad_inputs,
                                        "backward, input-gradient half",
                                        grads + f"{split.n_stash} values kept for the weight half")
            lines += _stage_graph_lines(s, split.weight_grad, split.weight_grad_inputs,
                                        "backward, weight-gradient half (run later, in a bubble)",
                                        f"gradients of {len(graphs.grads)} parameters")
    return "\n".join(lines)


def _stage_graph_lines(s: int, gm, inputs, title: str, outputs: str) -> list[str]:
    """One of stage ``s``'s graphs as code, its inputs named and its collectives commented."""
    what = {"recv": f"received from stage {s - 1}", "saved": "saved by this stage's forward",
            "input": "batch input (this micro-batch)", "tangent": "seed gradient of the loss",
            "stash": "kept from the input-gradient half"}
    lines = [f"# {title}, once per micro-batch; inputs:"]
    holders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node, source in zip(holders, inputs):
        kind = (f"gradient slot {source.index}, received from stage {s + 1}" if source.kind == "grad"
                else what.get(source.kind, source.kind))
        lines.append(f"#   {node.name}: {kind} {source.name}")
    lines.append(f"# outputs: {outputs}")
    reasons = {n.name: n.meta["autopar"] for n in gm.graph.nodes if "autopar" in n.meta}
    for line in gm.code.splitlines():
        if line.strip():
            name = line.strip().split(" = ")[0] if " = " in line else ""
            lines.append(f"{line}  # {reasons[name]}" if name in reasons else line)
    return lines


def _dp_rank(mesh: DeviceMesh) -> int:
    """This rank's coordinate on the data-parallel axis: which slice of the batch it runs."""
    return mesh.get_local_rank("dp")
