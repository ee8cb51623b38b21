"""Capture a model's training step as one joint forward+backward aten graph.

AOTAutograd's joint export traces forward and backward into a single FX graph whose inputs and
outputs carry descriptors (which parameter, which gradient). By default it traces the eager
module directly, with forward hooks noting which module produced which node; ``via_export=True``
first runs `torch.export` (non-strict), as PyTorch's AutoParallel does, which is about three
times slower on large models (llama3-405b: 77 s against about 25 s on 2 cores).
Everything runs on fake tensors, so a model built on the meta device captures without
allocating its weights. Meta parameters must be swapped for fake ones first: a meta model traces
without error but its joint graph has no parameter gradients (see shared torch-2.13 notes).
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils import _pytree as pytree

from autopar.capture import experts
from autopar.capture.graph import GraphInput, GraphOutput, OutputTree, TrainingGraph
from autopar.capture.repeat import capture_repeated
from autopar.errors import CaptureError, InputError, locate_user_frame


class _Step(nn.Module):
    """The step's module: ``model(*inputs)``, or ``loss_fn(model(*inputs[:-1]), inputs[-1])``;
    with an `OutputTree`, its output flattened to ``(loss, *other tensors detached)``."""

    def __init__(self, model: nn.Module, loss_fn: Callable | None = None) -> None:
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn
        self.tree: OutputTree | None = None

    def forward(self, *args):
        if self.loss_fn is None:
            out = self.model(*args)
        else:
            out = self.loss_fn(self.model(*args[:-1]), args[-1])
        return out if self.tree is None else self.tree.flat(out)


def _output_tree(out, model: nn.Module) -> OutputTree | None:
    """The structure of the forward's output ``out`` (fake), None for a tensor: the loss is a
    mapping's ``loss`` field (a transformers ModelOutput called with labels), else the first
    leaf (``(loss, logits)``)."""
    if isinstance(out, torch.Tensor):
        return None
    loss = _loss_field(out, model)
    if loss is None:
        leaves = pytree.tree_leaves(out)
        loss = leaves[0] if leaves else None
        if not isinstance(loss, torch.Tensor):
            raise CaptureError(
                f"{type(model).__name__} returned a {type(out).__name__} whose first value is "
                f"{type(loss).__name__}, not the loss.\n  fix: return the loss first, e.g. "
                "(loss, logits), or a dict with a 'loss' key")
        if loss.numel() != 1:
            raise CaptureError(
                f"{type(model).__name__} returned a {type(out).__name__} whose first value is a "
                f"tensor of shape {list(loss.shape)}, not a scalar loss: the step trains on the "
                "first value of a tuple or list, or on a dict's 'loss' key.\n  fix: return the "
                "loss first, e.g. (loss, logits), or a dict with a 'loss' key")
    return OutputTree.of(out, loss)


def _loss_field(out, model: nn.Module) -> torch.Tensor | None:
    """The loss of a mapping-like output (a ModelOutput called with labels); None for a plain
    tensor or tuple. `CaptureError` for a mapping without one (called without labels)."""
    if isinstance(out, torch.Tensor) or not hasattr(out, "keys"):
        return None
    loss = out.get("loss") if hasattr(out, "get") else None
    if isinstance(loss, torch.Tensor):
        return loss
    fields = ", ".join(str(k) for k in out.keys())
    raise CaptureError(
        f"{type(model).__name__} returned a {type(out).__name__} without a loss (fields: {fields}), "
        "so there is nothing to train on.\n  fix: call the model with its labels and return the "
        "loss (a wrapper whose forward(ids, labels) returns model(input_ids=ids, labels=labels)"
        ".loss), or pass loss_fn=lambda output, labels: ... with the labels as the last example input"
    )


def capture(
    model: nn.Module,
    example_inputs: Sequence[torch.Tensor],
    loss_fn: Callable | None = None,
    via_export: bool = False,
    dtype: torch.dtype | None = None,
    repeat_blocks: bool = True,
    group_experts: bool = True,
    min_experts: int = experts.MIN_EXPERTS,
) -> TrainingGraph:
    """Capture ``loss = model(*example_inputs); loss.backward()`` as a joint aten graph.

    The model may live on the meta device or on real tensors; either way the capture runs on
    fake tensors and allocates no weight memory. With ``loss_fn`` the model is called on all
    inputs but the last and the loss is ``loss_fn(output, example_inputs[-1])``.
    Raises `CaptureError` naming the module, the source line and the fix when the model cannot
    be traced, and `InputError` for example inputs that do not fit the model.
    ``dtype`` captures with every floating parameter and buffer in that dtype (planning a bf16
    step of a model built in fp32), without touching the model.
    ``repeat_blocks`` traces a deep stack of alike blocks with four of them and writes the
    others from the middle one (`autopar.capture.repeat`: the same graph, several times
    faster); the whole model is traced where the blocks do not repeat exactly.
    ``group_experts`` traces a loop over a list of alike experts as one grouped computation
    (`autopar.capture.experts`); the experts are traced one by one where that does not apply.
    ``min_experts``: the fewest experts in a list grouped (expert parallelism groups every
    list: its pass rewrites the grouped computation).
    """
    from autopar.capture.validate import validate_inputs

    note = ""
    if repeat_blocks and not via_export:
        graph, note = _capture_repeated(model, example_inputs, loss_fn, dtype, min_experts)
        if graph is not None:
            return graph

    example_inputs = tuple(example_inputs)
    validate_inputs(model, example_inputs, loss_fn)
    root = _Step(model, loss_fn)
    module_names = {id(m): name for name, m in (root if loss_fn is not None else model).named_modules()}

    t0 = time.perf_counter()
    expert_lists = experts.find_expert_lists(model, min_experts) if group_experts and not via_export else []
    fake_mode = FakeTensorMode(allow_non_fake_inputs=False)
    with _tracing_flags(), _fake_parameters(root, fake_mode, dtype) as groups:
        fake_inputs = tuple(_to_fake(x, fake_mode, dtype) for x in example_inputs)
        with experts.screening(expert_lists):
            out = _preflight(root, fake_inputs, fake_mode, module_names)
        tree = _output_tree(out, model)
        root.tree = tree  # with a tree, the graph returns (loss, *the other tensors)
        t_preflight = time.perf_counter() - t0
        try:
            with _track_modules({id(m): n for n, m in model.named_modules()}), \
                    experts.expert_stubs(expert_lists):
                traced = torch.export.export(root, fake_inputs, strict=False).module() if via_export else root
                wrapper = "model." if root is not model else ""
                gm, inputs, outputs = _joint(traced, fake_inputs, wrapper)
        except CaptureError:
            raise  # already says what to fix
        except Exception as exc:
            if expert_lists:  # a list that is no group of experts: trace it as it is
                with experts.excluding(exc, expert_lists):
                    return capture(model, example_inputs, loss_fn, via_export, dtype, repeat_blocks,
                                   min_experts=min_experts)
            raise CaptureError.from_exception(exc, module_names) from exc
        if not via_export:  # export's own nn_module_stack metadata serves otherwise
            _label_modules(gm)
        if expert_lists:
            try:
                note = experts.grouped_note(experts.group_experts(gm, expert_lists, functools.partial(_trace_fake, fake_mode=fake_mode)), note)
            except experts.NotGroupable as exc:
                with experts.excluding(exc, expert_lists):
                    return capture(model, example_inputs, loss_fn, via_export, dtype, repeat_blocks,
                                   min_experts=min_experts)
    gm, inputs, outputs, aliases = _merge_tied(gm, inputs, outputs, groups)
    shapes, dtypes = _param_shapes(gm, inputs)
    if root is not model:  # report names as the user's model knows them
        inputs, outputs, shapes, dtypes, aliases = _without_prefix(
            "model.", inputs, outputs, shapes, dtypes, aliases)
    _check_loss(outputs, gm)
    return TrainingGraph(gm=gm, inputs=inputs, outputs=outputs, param_shapes=shapes,
                         param_dtypes=dtypes, aliases=aliases,
                         capture_time_s=time.perf_counter() - t0, preflight_time_s=t_preflight,
                         capture_note=note, output_tree=tree)


def _capture_repeated(model: nn.Module, example_inputs, loss_fn, dtype,
                      min_experts: int = experts.MIN_EXPERTS) -> tuple[TrainingGraph | None, str]:
    """`capture_repeated` with the whole-model trace; (None, why) where the blocks do not
    repeat, and (None, "") where tracing the shortened stack fails (the full trace then
    reports the error with the model's own names)."""
    traced: list[TrainingGraph] = []

    def trace(*args, **kwargs) -> TrainingGraph:
        traced.append(_trace_whole(*args, min_experts=min_experts, **kwargs))
        return traced[-1]

    try:
        graph, note = capture_repeated(model, example_inputs, trace, loss_fn=loss_fn, dtype=dtype)
    except (CaptureError, InputError):
        return None, ""
    if graph is not None:
        # the shortened stack returns what the whole one does: an output that grows with the
        # depth holds a middle block's value, which the repeat refuses
        graph.output_tree = traced[-1].output_tree
    return graph, note


def _param_shapes(gm: torch.fx.GraphModule, inputs: list[GraphInput]):
    """{parameter: shape} and {parameter: dtype} of the graph's parameter placeholders."""
    shapes, dtypes = {}, {}
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            spec = next((i for i in inputs if i.node == node.name), None)
            if spec is not None and spec.kind == "param":
                shapes[spec.name] = tuple(int(d) for d in node.meta["val"].shape)
                dtypes[spec.name] = node.meta["val"].dtype
    return shapes, dtypes


def _without_prefix(prefix: str, inputs: list[GraphInput], outputs: list[GraphOutput],
                    shapes: dict, dtypes: dict, aliases: dict[str, str]):
    """The graph's names (inputs, outputs, shapes, dtypes, aliases) without the loss
    wrapper's ``prefix``, as the user's model knows them."""
    def strip(name: str) -> str:
        return name.removeprefix(prefix)

    # buffer outputs are named like buffer inputs: strip the wrapper's prefix the same way
    return ([GraphInput(i.node, i.kind, strip(i.name)) for i in inputs],
            [GraphOutput(o.index, o.kind, strip(o.name)) for o in outputs],
            {strip(k): v for k, v in shapes.items()}, {strip(k): v for k, v in dtypes.items()},
            {strip(k): strip(v) for k, v in aliases.items()})


def other_outputs_at(model: nn.Module, graph: TrainingGraph, inputs: Sequence[torch.Tensor],
                     loss_fn: Callable | None = None) -> list[torch.Tensor]:
    """The forward's other tensors (fake; `OutputTree` order) for ``inputs`` of other shapes than
    ``graph`` was captured with: one forward on fake tensors, no graph
    (`autopar.capture.outputs.output_joins` reads which of them grow with the batch)."""
    root = _Step(model, loss_fn)
    root.tree = graph.output_tree
    module_names = {id(m): name for name, m in root.named_modules()}
    fake_mode = FakeTensorMode(allow_non_fake_inputs=False)
    with _tracing_flags(), _fake_parameters(root, fake_mode):
        fake_inputs = tuple(_to_fake(x, fake_mode) for x in inputs)
        return list(_preflight(root, fake_inputs, fake_mode, module_names)[1:])


def capture_with_sources(model: nn.Module, example_inputs: Sequence[torch.Tensor],
                         loss_fn: Callable | None = None) -> TrainingGraph:
    """`capture` of the whole model (no repeated blocks) with each node's user source lines
    in ``meta["stack_trace"]``: the frames from the model's first ``forward`` on, torch's and
    autopar's own left out. The everyday capture records none (formatting a traceback per
    node costs time on large models); an error that names the user's line traces again."""
    from torch.fx.experimental import proxy_tensor

    class _Recording(proxy_tensor.PythonKeyTracer):
        # the joint export builds its tracer with stack traces off and sets the flag per
        # instance; these properties keep them on for this capture only
        record_stack_traces = property(lambda self: True, lambda self, value: None)
        _record_forward_stack_traces_only = property(lambda self: False, lambda self, value: None)

    saved = proxy_tensor.PythonKeyTracer
    proxy_tensor.PythonKeyTracer = _Recording
    try:
        graph = capture(model, example_inputs, loss_fn=loss_fn, repeat_blocks=False)
    finally:
        proxy_tensor.PythonKeyTracer = saved
    own = (str(Path(__file__).resolve().parents[1]), str(Path(torch.__file__).resolve().parent))
    for node in graph.gm.graph.nodes:
        trace = node.meta.get("stack_trace")
        if trace:
            node.meta["stack_trace"] = _user_frames(trace, own)
    return graph


def _user_frames(trace: str, package_dirs: Sequence[str]) -> str:
    """A formatted stack trace without the frames of files under ``package_dirs``."""
    blocks, current = [], []
    for line in trace.splitlines():
        if line.lstrip().startswith("File ") and current:
            blocks.append(current)
            current = []
        current.append(line)
    if current:
        blocks.append(current)
    kept = [b for b in blocks if not any(d in b[0] for d in package_dirs)]
    return "\n".join(line for b in kept for line in b)


def _trace_whole(model: nn.Module, example_inputs, loss_fn=None, dtype=None,
                 min_experts: int = experts.MIN_EXPERTS) -> TrainingGraph:
    """`capture` without repeating blocks (what `capture_repeated` traces its four with)."""
    return capture(model, example_inputs, loss_fn=loss_fn, dtype=dtype, repeat_blocks=False,
                   min_experts=min_experts)


def _trace_fake(root: nn.Module, fake_mode: FakeTensorMode):
    """The joint graph of a module without inputs whose parameters are meta tensors."""
    with _fake_parameters(root, fake_mode):
        return _joint(root, ())


def _joint(root: nn.Module, fake_inputs, prefix: str = ""):
    """AOTAutograd joint export of the module; returns (gm, inputs, outputs).

    ``prefix`` (the loss wrapper's "model.") is left out of the names in error messages.
    """
    from torch._functorch._aot_autograd.descriptors import (
        BufferAOTInput,
        GradAOTOutput,
        InputMutationAOTOutput,
        ParamAOTInput,
        PlainAOTInput,
        PlainAOTOutput,
        TangentAOTInput,
    )
    from torch._functorch.aot_autograd import aot_export_joint_with_descriptors

    with contextlib.ExitStack() as stack:
        joint = aot_export_joint_with_descriptors(stack, root, fake_inputs)
        gm = joint.graph_module
    # Flat calling convention, gm(*primals, *tangents) -> flat outputs: simpler for the passes
    # and the runtime than the pytree-structured (primals, tangents) signature.
    gm.graph._codegen = torch.fx.graph.CodeGen()
    gm.recompile()
    inputs: list[GraphInput] = []
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        desc = node.meta.get("desc")
        if isinstance(desc, ParamAOTInput):
            inputs.append(GraphInput(node.name, "param", desc.target))
        elif isinstance(desc, BufferAOTInput):
            inputs.append(GraphInput(node.name, "buffer", desc.target))
        elif isinstance(desc, PlainAOTInput):
            inputs.append(GraphInput(node.name, "input", f"input{desc.idx}"))
        elif isinstance(desc, TangentAOTInput):
            # only the loss is differentiated: eager loss.backward() gives the other outputs
            # (a model returning (loss, logits)) a zero gradient, not a seed of ones
            is_loss = isinstance(desc.output, PlainAOTOutput) and desc.output.idx == 0
            inputs.append(GraphInput(node.name, "tangent" if is_loss else "zero_tangent", str(desc.output)))
        else:
            inputs.append(GraphInput(node.name, "other", str(desc)))
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    outputs: list[GraphOutput] = []
    for index, desc in enumerate(out_node.meta.get("desc") or []):
        if isinstance(desc, GradAOTOutput) and isinstance(desc.grad_of, ParamAOTInput):
            outputs.append(GraphOutput(index, "grad", desc.grad_of.target))
        elif isinstance(desc, PlainAOTOutput):
            outputs.append(GraphOutput(index, "loss" if desc.idx == 0 else "other", f"output{desc.idx}"))
        elif isinstance(desc, InputMutationAOTOutput):
            outputs.append(GraphOutput(index, "buffer", _mutated_buffer(desc.mutated_input, prefix)))
        elif desc is not None:
            outputs.append(GraphOutput(index, "other", str(desc)))
    for node in gm.graph.nodes:
        desc = node.meta.get("desc") if node.op == "placeholder" else None
        if isinstance(desc, TangentAOTInput) and isinstance(desc.output, InputMutationAOTOutput):
            name = _mutated_buffer(desc.output.mutated_input, prefix).removeprefix(prefix)
            raise CaptureError(
                f"the forward writes a value that requires grad into buffer {name!r} (its new "
                "value is part of the autograd graph, so loss.backward() would need a seed "
                "gradient for it).\n  fix: update the buffer from detached values, e.g. "
                "buf.copy_(x.detach()), or inside `with torch.no_grad():`"
            )
    return gm, inputs, outputs


def _mutated_buffer(mutated, prefix: str = "") -> str:
    """The buffer an in-place update of the forward wrote to; `CaptureError` for anything else.

    The joint export functionalises in-place updates of graph inputs: each comes out as an
    extra output (descriptor ``InputMutationAOTOutput``) holding the input's new value. For a
    buffer that is the running state eager PyTorch keeps in the module; updating a parameter
    or a user input inside the training step has no faithful place in a parallel step (a
    parameter's shards and its optimizer state would diverge from the update).
    """
    from torch._functorch._aot_autograd.descriptors import (
        BufferAOTInput,
        ParamAOTInput,
        PlainAOTInput,
    )

    if isinstance(mutated, BufferAOTInput):
        return mutated.target
    if isinstance(mutated, ParamAOTInput):
        name = mutated.target.removeprefix(prefix)
        raise CaptureError(
            f"the forward modifies parameter {name!r} in place (an in-place op such as mul_, "
            "copy_ or .data.mul_ on it); autopar cannot capture a step that updates "
            "a parameter inside forward.\n  fix: move the update out of forward (after "
            "optimizer.step()), or, if the tensor is not trained, register it as a buffer "
            "(module.register_buffer) so that the step may update it"
        )
    if isinstance(mutated, PlainAOTInput):
        raise CaptureError(
            f"the forward modifies its input {mutated.idx} (example_inputs[{mutated.idx}]) in "
            "place; autopar cannot capture a step that changes the batch it is given.\n  fix: "
            "use the out-of-place op (x = x * 2 instead of x.mul_(2)) or clone the input first "
            "(x = x.clone())"
        )
    raise CaptureError(
        f"the forward modifies a graph input in place that is neither a buffer, a parameter nor "
        f"a user input ({mutated}).\n  fix: update only registered buffers in forward"
    )


_MODULE = "autopar_module"  # node meta: the innermost module whose forward made the node


@contextlib.contextmanager
def _track_modules(names: dict[int, str]):
    """Label the graph nodes each module makes while AOTAutograd traces the forward.

    Global forward hooks note the tracer graph's last node when a module is entered; when it
    is left, the nodes made since get the module's name (``meta[_MODULE]``) unless an inner
    module labelled them first. Labels sit on the nodes themselves: the tracer later removes
    dead nodes from the same graph, which would shift any position-based record. Tracing the
    eager module directly is about three times faster than going through torch.export first,
    and this is the one piece of export's metadata the analysis needs.
    """
    from torch.fx.experimental.proxy_tensor import get_proxy_mode
    from torch.nn.modules.module import (
        register_module_forward_hook,
        register_module_forward_pre_hook,
    )

    open_calls: list[tuple[str, object]] = []

    def enter(module, args):
        mode = get_proxy_mode()
        if mode is not None and id(module) in names:
            last = next(iter(reversed(mode.tracer.graph.nodes)), None)
            open_calls.append((names[id(module)], last))

    def leave(module, args, output):
        mode = get_proxy_mode()
        if mode is not None and id(module) in names and open_calls:
            name, before = open_calls.pop()
            for node in reversed(mode.tracer.graph.nodes):
                if node is before:
                    break
                node.meta.setdefault(_MODULE, name)

    handles = [register_module_forward_pre_hook(enter), register_module_forward_hook(leave)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _label_modules(gm: torch.fx.GraphModule) -> None:
    """Set node.meta["module"]: the innermost module of each forward node, and for backward
    nodes the module of the forward node with the same autograd sequence number."""
    nodes = list(gm.graph.nodes)
    by_seq: dict[int, str] = {}
    for node in nodes:
        if node.meta.get("partitioner_tag") == "is_forward" and "seq_nr" in node.meta:
            by_seq.setdefault(node.meta["seq_nr"], node.meta.get(_MODULE, ""))
    for node in nodes:
        label = node.meta.pop(_MODULE, "")
        if node.meta.get("partitioner_tag") == "is_backward":
            label = by_seq.get(node.meta.get("seq_nr"), "")
        node.meta["module"] = label


def _merge_tied(gm, inputs, outputs, groups):
    """Make each tied tensor one graph input whose gradient is the sum over its uses.

    The joint export lifts tied parameters as separate placeholders with separate gradients;
    an optimizer must see one parameter and the total gradient, as eager autograd gives it.
    Returns (gm, inputs, outputs, {alias: canonical name}).
    """
    aten = torch.ops.aten
    by_name = {i.name: i for i in inputs if i.kind in ("param", "buffer")}
    nodes = {n.name: n for n in gm.graph.nodes}
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    out_args = list(out_node.args[0])
    aliases: dict[str, str] = {}
    drop_inputs: set[str] = set()
    drop_outputs: set[int] = set()
    for names in groups:
        present = [n for n in names if n in by_name]
        canonical = present[0] if present else names[0]
        aliases.update({n: canonical for n in names if n != canonical})
        grad_index = {o.name: o.index for o in outputs if o.kind == "grad"}
        for alias in present[1:]:
            alias_node = nodes[by_name[alias].node]
            alias_node.replace_all_uses_with(nodes[by_name[canonical].node])
            gm.graph.erase_node(alias_node)
            drop_inputs.add(alias)
            if alias in grad_index and canonical in grad_index:
                a, b = out_args[grad_index[canonical]], out_args[grad_index[alias]]
                if a is None or b is None:
                    total = a if b is None else b
                else:
                    with gm.graph.inserting_before(out_node):
                        total = gm.graph.call_function(aten.add.Tensor, (a, b))
                    total.meta.update(a.meta)
                out_args[grad_index[canonical]] = total
                drop_outputs.add(grad_index[alias])
    if not drop_inputs:
        return gm, inputs, outputs, aliases
    kept = [i for i in range(len(out_args)) if i not in drop_outputs]
    out_node.args = (tuple(out_args[i] for i in kept),)
    renumber = {old: new for new, old in enumerate(kept)}
    # a tied buffer's new value goes to the one tensor all its names share
    outputs = [GraphOutput(renumber[o.index], o.kind,
                           aliases.get(o.name, o.name) if o.kind == "buffer" else o.name)
               for o in outputs if o.index in renumber]
    inputs = [i for i in inputs if not (i.kind in ("param", "buffer") and i.name in drop_inputs)]
    gm.graph.lint()
    gm.recompile()
    return gm, inputs, outputs, aliases


def _check_loss(outputs: list[GraphOutput], gm: torch.fx.GraphModule) -> None:
    """The step must produce one scalar loss."""
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    loss = next((o for o in outputs if o.kind == "loss"), None)
    if loss is None:
        raise CaptureError("the model returned no tensor: return the loss from forward or pass loss_fn")
    val = out_node.args[0][loss.index].meta.get("val")
    if val is not None and val.numel() != 1:
        raise CaptureError(
            f"the model returned a tensor of shape {list(val.shape)}, not a scalar loss: make "
            "forward return the loss (the zoo models do when given labels) or pass "
            "loss_fn=lambda output, target: ..."
        )


def _to_fake(x, fake_mode: FakeTensorMode, dtype: torch.dtype | None = None):
    """A fake CPU tensor with x's shape and dtype (meta and real tensors alike); floating
    tensors take ``dtype`` when one is given."""
    if not isinstance(x, torch.Tensor):
        return x
    device = torch.device("cpu") if x.device.type == "meta" else x.device
    target = dtype if dtype is not None and x.is_floating_point() else x.dtype
    with fake_mode:
        return torch.empty(x.shape, dtype=target, device=device)


@contextlib.contextmanager
def _fake_parameters(root: nn.Module, fake_mode: FakeTensorMode, dtype: torch.dtype | None = None):
    """Temporarily swap every parameter and buffer of ``root`` for a fake CPU tensor.

    Tied parameters stay tied (one fake per original tensor). Yields the groups of names that
    share one tensor (groups of two or more only).
    The user's module is restored on exit, whatever happens.
    """
    saved: list[tuple[nn.Module, str, str, torch.Tensor]] = []
    fakes: dict[int, torch.Tensor] = {}
    names: dict[int, list[str]] = {}
    try:
        for mod_name, module in root.named_modules(remove_duplicate=False):
            for kind in ("_parameters", "_buffers"):
                for name, tensor in list(getattr(module, kind).items()):
                    if tensor is None:
                        continue
                    qual = f"{mod_name}.{name}" if mod_name else name
                    key = id(tensor)
                    if qual not in names.setdefault(key, []):
                        names[key].append(qual)
                    if key not in fakes:
                        fake = _to_fake(tensor.detach(), fake_mode, dtype)
                        if kind == "_parameters":
                            fake = nn.Parameter(fake, requires_grad=tensor.requires_grad)
                        fakes[key] = fake
                    saved.append((module, kind, name, tensor))
                    getattr(module, kind)[name] = fakes[key]
        yield [group for group in names.values() if len(group) > 1]
    finally:
        for module, kind, name, tensor in saved:
            getattr(module, kind)[name] = tensor
        for module in root.modules():  # an RNN caches its weights: point it back at the real ones
            if isinstance(module, nn.RNNBase):
                module._init_flat_weights()


@contextlib.contextmanager
def _tracing_flags():
    """Tell model code that a graph is being compiled, as `torch.compile` does.

    Libraries branch on `torch.compiler.is_compiling()` to take a path without data-dependent
    Python control flow: transformers' mask code otherwise asks ``(mask == 0).all()`` of a
    fake tensor (inside AOTAutograd's functional wrappers its own FakeTensor check does not
    see one). Non-strict `torch.export` sets this flag too, and the export flag, which we leave
    off (it only makes transformers keep shape-generic paths; our graph is specialised to its
    shapes). transformers still passes SDPA an explicit causal mask under tracing (its
    packed-sequence check on position ids cannot be read): the TP pass shards it with the heads.
    """
    compiler = torch.compiler
    saved = compiler._is_compiling_flag
    compiler._is_compiling_flag = True
    try:
        yield
    finally:
        compiler._is_compiling_flag = saved


def _preflight(root: nn.Module, fake_inputs, fake_mode: FakeTensorMode, module_names):
    """Run the forward once on fake tensors: wrong shapes fail here, named by module and line.
    Returns the forward's output (fake)."""
    try:
        with fake_mode, torch.no_grad():
            return root(*fake_inputs)
    except Exception as exc:
        frame = locate_user_frame(exc, module_names)
        raise CaptureError.from_exception(exc, module_names, frame=frame, preflight=True) from exc
