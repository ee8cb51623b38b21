"""Expert parallelism priced as it runs (passes/expert_parallel.py): a rank stores E/ep of the
experts, with their gradients and optimizer state; ZeRO shards them over their dp/ep owners;
their gradients are reduced (and ZeRO's gathers run) over those owners, not over every dp rank."""

import dataclasses

import pytest
import torch

from autopar import models
from autopar.search.step import captured_step
from cost import Cluster, Layout
from cost.memory import model_state_bytes
from cost.precision import recipe
from cost.step import predict, predict_memory
from cost.terms.data_parallel import dp_comm, expert_owners

H100_8 = Cluster("h100", nodes=1, gpus_per_node=8)


@pytest.fixture(scope="module")
def moe_facts():
    """mixtral-8x7b widths, 2 layers of 8 experts, batch 8 x seq 512, bf16, on meta."""
    cfg = dataclasses.replace(models.config("mixtral-8x7b"), n_layers=2)
    model = models.build(cfg, device="meta", dtype=torch.bfloat16)
    inputs = models.example_inputs(cfg, batch=8, seq=512, device="meta")
    return captured_step(model, inputs, None, torch.bfloat16).facts()


def test_model_state_counts_experts_over_their_owners():
    """Ψ = 100 parameters on a rank, 60 of them its experts' (E/ep), dp 8, ep 4: unsharded
    states count all 100; ZeRO-sharded ones 40/8 dense + 60/(8/4) experts."""
    rec = recipe("bf16")
    plain = model_state_bytes(100.0, rec, 0, 8, 60.0, 4)
    assert plain == model_state_bytes(100.0, rec, 0, 8)
    z3 = model_state_bytes(100.0, rec, 3, 8, 60.0, 4)
    per = model_state_bytes(1.0, rec, 3, 1)
    for key in ("params", "grads", "optimizer"):
        assert z3[key] == pytest.approx((40 / 8 + 60 / 2) * per[key])
    with pytest.raises(ValueError, match="ep=3 must divide dp=8"):
        model_state_bytes(100.0, rec, 1, 8, 60.0, 3)


def test_ep_divides_the_experts_state(moe_facts):
    """Without ZeRO every state holds the dense parameters and 1/ep of the experts; under ZeRO-3
    each rank holds 1/dp of everything (the experts 1/ep, sharded over dp/ep owners)."""
    params = moe_facts.params
    experts = sum(n for p, n in params.numel.items() if params.expert[p])
    dense = sum(params.numel.values()) - experts
    assert experts > 4 * dense  # a MoE: most parameters are experts'
    for zero in (0, 3):
        mem = {ep: predict_memory(moe_facts, H100_8, Layout(dp=8, ep=ep, zero=zero, microbatch=1))
               for ep in (1, 2, 8)}
        for ep, m in mem.items():
            expected = (dense + experts / ep) if zero == 0 else (dense + experts) / 8
            assert m.params == pytest.approx(expected * 2, rel=1e-9), (zero, ep)  # bf16
            assert m.optimizer < mem[1].optimizer * 1.000001
        if zero == 0:
            assert mem[8].params + mem[8].grads + mem[8].optimizer < \
                0.3 * (mem[1].params + mem[1].grads + mem[1].optimizer)


def test_expert_gradients_reduced_over_their_owners(moe_facts):
    """The experts' part of the DP sync goes over dp/ep owners: none when each rank is its
    experts' only owner (ep = dp), so the sync is the dense part's alone; ZeRO-3 gathers only a
    rank's own experts, so ep shortens its DP communication."""
    rec = recipe("bf16")
    lay = Layout(dp=8, ep=8, zero=0, microbatch=1).resolve(8, "bf16")
    assert expert_owners(H100_8, lay) is None
    assert expert_owners(H100_8, dataclasses.replace(lay, ep=4)).size == 2
    args = (H100_8, lay, rec)
    times = (2, 0.1, 0.2, 0.0)
    with_experts = dp_comm(*args, 1e9, *times, expert_params=6e8)
    dense_only = dp_comm(*args, 4e8, *times)
    assert with_experts == pytest.approx(dense_only)
    step = {ep: predict(moe_facts, H100_8, Layout(dp=8, ep=ep, zero=3, microbatch=1)) for ep in (1, 8)}
    assert step[8].time_breakdown["dp_comm_total_s"] < 0.5 * step[1].time_breakdown["dp_comm_total_s"]
