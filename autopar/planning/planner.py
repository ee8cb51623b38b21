"""`autopar.plan`: capture a model's step on fake tensors and plan it on a cluster."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch
from torch import nn

from autopar.capture.fingerprint import model_fingerprint
from autopar.errors import InputError
from autopar.planning.plan import Plan, make_plan
from autopar.search.solver import solve
from autopar.search.step import captured_step
from cost import Cluster, Layout, LayoutError
from cost.step import check_layout, default_precision

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp8": torch.bfloat16}


def model_precision(model: nn.Module, cluster: Cluster | None = None) -> str:
    """The precision a layout without one trains ``model`` in: the model's own dtype ("fp32"
    or "bf16"; what `autopar.parallelize` runs, given no ``cluster``). Planned for a
    ``cluster`` of GPUs with bf16 tensor cores, an fp32 model is priced in bf16 mixed
    precision, its fp32 weights the master copy (how such models are trained there)."""
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    names = {torch.float32: "fp32", torch.bfloat16: "bf16"}
    if len(dtypes) > 1 or not dtypes <= set(names):
        raise InputError(f"the model's parameters have dtypes {sorted(map(str, dtypes))}: autopar "
                         "plans and runs fp32 or bf16 models of one dtype; convert it with "
                         "model.float() or model.to(torch.bfloat16), or pass Layout(precision=...)")
    own = names[next(iter(dtypes))] if dtypes else "fp32"
    if own == "fp32" and cluster is not None:
        return default_precision(cluster)
    return own


def plan(
    model: nn.Module,
    example_inputs: Sequence[torch.Tensor],
    cluster: Cluster | None = None,
    loss_fn: Callable | None = None,
    layout: Layout | None = None,
    progress: Callable[[str], None] | None = None,
    **search,
) -> Plan:
    """Plan one training step of ``model`` on ``cluster``; nothing runs, nothing is allocated.

    ``example_inputs`` describe the whole step (the global batch, dim 0). With ``layout`` the
    plan evaluates that manual layout (its degrees are constraints; omitted micro-batch,
    accumulation and precision are derived, see `Layout.resolve`); without, the solver
    searches for the fastest layout that fits. ``search`` options go to
    `autopar.search.solver.solve` (``allow_fp8``, ``compare_manual``, ``executable_only``,
    ``precision``, ``recompute``: the recompute modes searched, "auto" by default).
    """
    cluster = cluster if cluster is not None else Cluster.local()
    example_inputs = tuple(example_inputs)
    if not example_inputs or not example_inputs[0].dim():
        raise InputError("example_inputs: one global batch, the first input with a batch "
                         "dimension (dim 0)")
    batch = example_inputs[0].shape[0]
    precision = search.pop("precision", None) or model_precision(model, cluster)
    if layout is not None:
        # degrees that cannot match the cluster fail here, before a capture
        layout = layout.resolve(batch, precision)
        if layout.world_size != cluster.world_size:
            raise LayoutError(
                f"layout {layout.short()} uses dp*cp*pp*tp = {layout.world_size} ranks but the "
                f"cluster has {cluster.world_size} ({cluster.nodes} nodes x "
                f"{cluster.gpus_per_node}); change the degrees to multiply to {cluster.world_size}")
        precision = layout.precision
    dtype = _DTYPES[precision] if "bf16" in cluster.gpu.peak_flops else torch.float32
    t0 = time.perf_counter()
    if progress:
        progress(f"capturing the training step ({dtype}) on fake tensors ...")
    # CPU ranks run eager PyTorch, one kernel per op; GPU plans assume fused element-wise kernels
    fused = not cluster.gpu.is_cpu
    step = captured_step(model, example_inputs, loss_fn, dtype, fused=fused)
    if progress:
        note = f": {step.graph.capture_note}" if step.graph.capture_note else ""
        progress(f"  captured in {time.perf_counter() - t0:.1f} s{note}")
    fingerprint = model_fingerprint(model)
    name = getattr(getattr(model, "config", None), "name", type(model).__name__)
    if layout is not None:
        check_layout(step.facts_for(cluster, layout), cluster, layout)
        result = make_plan(step, cluster, layout, model=name, fingerprint=fingerprint)
        result.solve = {"method": "manual layout", "evaluated": 1, "time_s": time.perf_counter() - t0}
        return result
    solution = solve(step, cluster, model=name, progress=progress, precision=precision, **search)
    result = make_plan(step, cluster, solution.layout, model=name, fingerprint=fingerprint,
                       prediction=solution.prediction, facts=solution.facts)
    result.alternatives = [v for v in solution.manual.values() if v]
    result.alternative_labels = [k for k, v in solution.manual.items() if v]
    result.solve = {k: v for k, v in solution.stats.items() if k != "closest_misses"}
    return result
