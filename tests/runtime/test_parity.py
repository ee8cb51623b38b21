"""Parity: a data-parallel / ZeRO training step on gloo ranks equals the single-device step.

Loss, every gradient, and the parameters after 3 AdamW steps, fp32, rtol 1e-5 / atol 1e-6.
One spawn per world size runs every model and ZeRO stage, to keep the suite fast.

AdamW runs with eps=1e-6: GPT-2's key bias has a gradient that is zero in exact arithmetic
(softmax ignores a constant added to every key), so both runs see only rounding noise of about
1e-10 there, and with the default eps=1e-8 Adam's g / (sqrt(v) + eps) turns noise into updates
of lr * 1e-2 that differ between any two summation orders, even two single-device runs.
"""

import copy

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runtime.launch import spawn

MODELS = ("tiny-gpt2", "tiny-llama", "tiny-mixtral")
STAGES = (0, 1, 2, 3)


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.allclose(a, b, rtol=1e-5, atol=1e-6)


def _parity_worker(rank: int, world: int) -> list[tuple]:
    import autopar
    from autopar import models
    from autopar.parallel_module import parallelize

    failures = []
    for name in MODELS:
        for zero in STAGES:
            model = models.build(name, seed=3)
            ref = copy.deepcopy(model)
            batch = models.example_inputs(name, batch=8, seq=16)
            layout = autopar.Layout(dp=world, zero=zero, microbatch=8 // world, precision="fp32")
            pm = parallelize(model, world, example_inputs=batch, layout=layout)
            opt = torch.optim.AdamW(pm.parameters(), lr=1e-3, eps=1e-6)
            ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, eps=1e-6)
            named_ref = dict(ref.named_parameters())
            for step in range(3):
                loss = pm(*batch)
                loss.backward()
                ref_loss = ref(*batch)
                ref_loss.backward()
                if not _close(loss, ref_loss.detach()):
                    failures.append((name, zero, step, "loss", loss.item(), ref_loss.item()))
                for pname, p in pm.named_parameters():
                    if not _close(p.grad.full_tensor(), named_ref[pname].grad):
                        failures.append((name, zero, step, f"grad {pname}"))
                opt.step()
                ref_opt.step()
                opt.zero_grad()
                ref_opt.zero_grad()
            for pname, p in pm.named_parameters():
                if not _close(p.full_tensor(), named_ref[pname].detach()):
                    diff = (p.full_tensor() - named_ref[pname]).abs().max().item()
                    failures.append((name, zero, "params after 3 AdamW steps", pname, diff))
            placements = {str(p.placements) for p in pm.parameters()}
            if zero >= 1 and "(Shard(dim=0),)" not in placements:
                failures.append((name, zero, "no parameter is sharded under ZeRO"))
    return failures


@pytest.mark.parametrize("world", [2, 4])
def test_dp_and_zero_match_one_device(world):
    results = spawn(_parity_worker, world, timeout_s=600)
    assert results == [[]] * world


def _errors_worker(rank: int, world: int) -> list[str]:
    import autopar
    from autopar import models
    from autopar.parallel_module import UnsupportedLayoutError, parallelize

    model = models.build("tiny-llama")
    batch = models.example_inputs("tiny-llama", batch=4, seq=16)
    seen = []
    try:
        parallelize(model, world + 1, example_inputs=batch)
    except autopar.InputError as exc:
        seen.append("mesh" if "process group has" in str(exc) else str(exc))
    try:
        parallelize(model, world, example_inputs=models.example_inputs("tiny-llama", batch=3, seq=16),
                    layout=autopar.Layout(dp=world, microbatch=1, grad_accum=1, precision="fp32"))
    except (autopar.InputError, autopar.LayoutError) as exc:
        seen.append("batch" if "batch" in str(exc) else str(exc))
    try:
        parallelize(model, world, example_inputs=batch,
                    layout=autopar.Layout(tp=world, microbatch=4, precision="fp32"))
    except UnsupportedLayoutError as exc:
        seen.append("tp" if "not implemented yet" in str(exc) else str(exc))
    other = models.build("tiny-gpt2")
    plan = autopar.plan(other, models.example_inputs("tiny-gpt2", batch=4, seq=16),
                        cluster=autopar.Cluster("h100", nodes=1, gpus_per_node=world),
                        layout=autopar.Layout(dp=world, microbatch=4 // world, precision="fp32"))
    try:
        parallelize(model, world, example_inputs=batch, plan=plan)
    except autopar.InputError as exc:
        seen.append("model" if "another model" in str(exc) else str(exc))
    pm = parallelize(model, world, example_inputs=batch,
                     layout=autopar.Layout(dp=world, zero=1, microbatch=4 // world, precision="fp32"))
    text = pm.dump_graph(rank=0)
    collectives = [line for line in text.splitlines() if "_c10d_functional" in line and "wait_tensor" not in line]
    # ZeRO-1: one gather per sharded weight, one reduce-scatter or all-reduce per gradient,
    # one all-reduce of the loss; every collective says why it is there
    n_params = len(list(pm.parameters()))
    if not all("# " in line for line in collectives):
        seen.append("uncommented collective")
    gathers = sum("all_gather" in line for line in collectives)
    reductions = sum("reduce_scatter" in line or "all_reduce" in line for line in collectives)
    seen.append((gathers, reductions, n_params))
    return seen


def test_bad_input_and_dump_graph():
    results = spawn(_errors_worker, 2, timeout_s=300)
    seen = results[0]
    assert seen[:4] == ["mesh", "batch", "tp", "model"]
    assert "uncommented collective" not in seen
    gathers, reductions, n_params = seen[-1]
    assert gathers == n_params  # tiny-llama: every weight's first dim divides by 2
    assert reductions == n_params + 1  # each gradient, plus the loss


def _checkpoint_worker(rank: int, world: int, path: str) -> bool:
    import torch.distributed.checkpoint as dcp

    import autopar
    from autopar import models

    batch = models.example_inputs("tiny-llama", batch=4, seq=16)
    layout = autopar.Layout(dp=world, zero=3, microbatch=4 // world, precision="fp32")
    pm = autopar.parallelize(models.build("tiny-llama", seed=1), world, example_inputs=batch, layout=layout)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
    pm(*batch).backward()
    opt.step()
    dcp.save(pm.state_dict(), checkpoint_id=path)
    fresh = autopar.parallelize(models.build("tiny-llama", seed=2), world, example_inputs=batch, layout=layout)
    state = fresh.state_dict()
    dcp.load(state, checkpoint_id=path)
    fresh.load_state_dict(state)
    return all(torch.equal(a.full_tensor(), b.full_tensor())
               for a, b in zip(pm.parameters(), fresh.parameters()))


def test_distributed_checkpoint_round_trip(tmp_path):
    assert spawn(_checkpoint_worker, 2, args=(str(tmp_path / "ckpt"),), timeout_s=300) == [True, True]


def _random_worker(rank: int, world: int, family: str, hidden: int, layers: int, zero: int) -> list:
    import dataclasses

    import autopar
    from autopar import models

    heads = 4
    cfg = dataclasses.replace(models.config(f"tiny-{family}"), name=f"random-{family}", hidden=hidden,
                              n_layers=layers, n_heads=heads, n_kv_heads=heads // 2 if family != "gpt2" else heads,
                              ffn=2 * hidden)
    model = models.build(cfg, seed=5)
    ref = copy.deepcopy(model)
    batch = models.example_inputs(cfg, batch=2 * world, seq=8)
    layout = autopar.Layout(dp=world, zero=zero, microbatch=2, precision="fp32")
    pm = autopar.parallelize(model, world, example_inputs=batch, layout=layout)
    loss = pm(*batch)
    loss.backward()
    ref_loss = ref(*batch)
    ref_loss.backward()
    named = dict(ref.named_parameters())
    bad = [] if _close(loss, ref_loss.detach()) else ["loss"]
    bad += [n for n, p in pm.named_parameters() if not _close(p.grad.full_tensor(), named[n].grad)]
    return bad


@settings(max_examples=3, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    family=st.sampled_from(["gpt2", "llama", "mixtral"]),
    hidden=st.sampled_from([16, 32, 48]),
    layers=st.integers(1, 3),
    world=st.sampled_from([2, 4]),
    zero=st.integers(0, 3),
)
def test_random_models_and_layouts_match_one_device(family, hidden, layers, world, zero):
    results = spawn(_random_worker, world, args=(family, hidden, layers, zero), timeout_s=300)
    assert results == [[]] * world
