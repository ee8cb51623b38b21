"""Checks shared by the multi-process parity tests: what runs is the plan, and it trains like
one device (loss, every gradient and the updated parameters, fp32, rtol 1e-5 / atol 1e-6).

Each check returns a list of failures (tuples naming the model, layout, step and the size of
the difference) rather than asserting, so a worker reports every mismatch of a run at once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.allclose(a, b, rtol=1e-5, atol=1e-6)


def contract(pm, label, allowed_fallbacks: Sequence[str] = ()) -> list[tuple]:
    """The DTensor placements of ``pm.parameters()`` are ``pm.plan.placements``, and no op fell
    back to replication except those whose name contains one of ``allowed_fallbacks``."""
    from autopar.execution.placement import placement_of

    failures = []
    for name, p in pm.named_parameters():
        axes = p.device_mesh.mesh_dim_names  # under a pipeline: the (dp, tp) mesh of its stage
        runs = {axis: str(placement_of(q)) for axis, q in zip(axes, p.placements)
                if axis in pm.plan.placements[name]}
        if runs != pm.plan.placements[name]:
            failures.append((*label, f"{name} runs {runs}, the plan says {pm.plan.placements[name]}"))
    unexpected = [f.op for f in pm.plan.fallbacks if not any(a in f.op for a in allowed_fallbacks)]
    if unexpected:
        failures.append((*label, "fallbacks", unexpected))
    return failures


def adamw(params):
    """AdamW with eps=1e-5: see test_parity's docstring for why not 1e-8."""
    return torch.optim.AdamW(params, lr=1e-3, eps=1e-5)


def sgd(params):
    return torch.optim.SGD(params, lr=0.1)


def _step_both(pm, ref, batch, label, opt, ref_opt) -> list[tuple]:
    """One step on both: every mismatch of the loss or a gradient (labelled ``label``)."""
    failures = []
    named_ref = dict(ref.named_parameters())
    loss = pm(*batch)
    loss.backward()
    ref_loss = ref(*batch)
    ref_loss.backward()
    if not close(loss, ref_loss.detach()):
        failures.append((*label, "loss", loss.item(), ref_loss.item()))
    for pname, p in pm.named_parameters():
        if not close(p.grad.full_tensor(), named_ref[pname].grad):
            diff = (p.grad.full_tensor() - named_ref[pname].grad).abs().max().item()
            failures.append((*label, f"grad {pname}", diff))
    opt.step()
    ref_opt.step()
    opt.zero_grad()
    ref_opt.zero_grad()
    return failures


def _param_mismatches(pm, ref, label) -> list[tuple]:
    named_ref = dict(ref.named_parameters())
    failures = []
    for pname, p in pm.named_parameters():
        if not close(p.full_tensor(), named_ref[pname].detach()):
            diff = (p.full_tensor() - named_ref[pname]).abs().max().item()
            failures.append((*label, pname, diff))
    return failures


def train_and_compare_step(pm, ref, batch, label, opt, ref_opt) -> list[tuple]:
    """One step on both (``opt`` / ``ref_opt`` step them): every mismatch of the loss, a
    gradient or an updated parameter, with its size."""
    return _step_both(pm, ref, batch, label, opt, ref_opt) + _param_mismatches(pm, ref, (*label, "updated"))


def train_and_compare(pm, ref, batch, label, steps: int = 3,
                      optimizers: Sequence[Callable] = (adamw,)) -> list[tuple]:
    """``steps`` steps on both under each optimizer in turn; every mismatch of loss, gradient or
    parameter (after each optimizer's steps), with its size."""
    failures = []
    for make in optimizers:
        opt, ref_opt = make(pm.parameters()), make(ref.parameters())
        for step in range(steps):
            failures += _step_both(pm, ref, batch, (*label, make.__name__, step), opt, ref_opt)
        failures += _param_mismatches(pm, ref, (*label, f"params after {steps} {make.__name__} steps"))
    return failures


def tp_checks(pm, label) -> list[tuple]:
    """Weights sharded over TP (every expert weight of an MoE), and no gather of a fused
    projection's output to split it into its parts (or of its gradient's parts to join them)."""
    from autopar.execution.placement import placement_of

    failures = []
    sharded = {n for n, q in pm.named_parameters() if any(placement_of(p).is_shard for p in q.placements[1:])}
    experts = {n for n, _ in pm.named_parameters() if ".experts." in n}
    if not sharded or experts - sharded:
        failures.append((*label, "not sharded over TP", sorted(experts - sharded) or "any parameter"))
    moved = [n.meta.get("autopar", "") for n in pm._rank_graph.gm.graph.nodes
             if str(n.target).startswith("_c10d_functional.")]
    split = [m for m in moved if "(split.Tensor)" in m or "(cat.default)" in m]
    if split:
        failures.append((*label, "fused parts gathered", split))
    return failures


def moved_checkpoint(build: Callable[[int], torch.nn.Module], world: int, batch, before, after,
                     path: str, optimizer: Callable) -> tuple:
    """(trained, loaded): ``build(seed=1)`` parallelised under layout ``before`` and trained one
    step with ``optimizer``, its state saved with torch.distributed.checkpoint to ``path``, and
    ``build(seed=2)`` parallelised under ``after`` with that checkpoint loaded into it."""
    import torch.distributed.checkpoint as dcp

    import autopar

    pm = autopar.parallelize(build(1), world, example_inputs=batch, layout=before)
    opt = optimizer(pm.parameters())
    pm(*batch).backward()
    opt.step()
    dcp.save(pm.state_dict(), checkpoint_id=path)
    fresh = autopar.parallelize(build(2), world, example_inputs=batch, layout=after)
    state = fresh.state_dict()
    dcp.load(state, checkpoint_id=path)
    fresh.load_state_dict(state)
    return pm, fresh
