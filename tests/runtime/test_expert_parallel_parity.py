"""Expert parallelism (passes/expert_parallel.py) trains like one device.

Loss, every gradient and the parameters after 2 SGD steps, fp32, rtol 1e-5, on gloo ranks: the
zoo Mixtral (4 experts, 5 layers: the capture repeats the middle block) and a plain-PyTorch
top-2 MoE written here (`top2_moe_lm`: 8 SwiGLU experts with biases, every expert on every token
weighted by its renormalised top-2 gate, results stacked along dim -2), each under two losses
(the model's mean cross-entropy, and a label-smoothed one over the tokens left after masking
some labels with -100), with ZeRO and gradient accumulation, and the solver's own plan for the
zoo Mixtral (on a fixed CPU profile it picks ep2); and transformers' Mixtral and Qwen2-MoE, whose
experts are stacked in one parameter (passes/expert_parallel_stacked.py: all-gather dispatch,
reduce-scatter combine, each rank storing its rows). 2 ranks (ep2 x dp2 in one group)
in the default suite; 4 ranks (ep2 in two groups of dp4, whose experts' owners are 2 ranks
over which ZeRO 1-3 shard them, also with full recompute, and ep4; and ep2 x tp2, with and
without SP, with ZeRO-1 and ZeRO-3: TP shards each expert, each TP rank dispatching its tokens
to the ep ranks of its own TP index) under ``slow``. The rank's graph holds the all-to-alls
(`dump_graph` names them). In a pipeline (dp2 x ep2 x pp2, slow): each stage's ep ranks
exchange tokens inside its forward and backward, the experts' gradients are summed over their
owners after the schedule.

Each rank stores only its E/ep experts (`_storage`): its expert parameters are 1/ep of them,
on the mesh of their dp/ep owners, and every rank's together are the model's; the gradients
and updated parameters are compared on the rank that holds them (every expert on its owners).
The user-facing state is whole: ``pm.full_state_dict()`` after training equals the one-device
model's, a torch.distributed.checkpoint save and load and a load of the one-device state dict
restore every rank's experts, and ``pm.eval()`` is refused naming the fix; under ``slow`` the ep checkpoint also loads into the
model parallelised without ep.
"""

import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from looped_moe import LoopedMoELM
from parity_checks import contract, sgd, train_and_compare
from torch import nn

from runtime.launch import spawn


class SwiGLUExpert(nn.Module):
    """down(silu(gate(x)) * up(x)), with biases."""

    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.gate = nn.Linear(hidden, ffn)
        self.up = nn.Linear(hidden, ffn)
        self.down = nn.Linear(ffn, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Top2MoE(nn.Module):
    """h + sum_e g_e(x) expert_e(x), x = rmsnorm(h), g = the top-2 of softmax(router(x)), renormalised."""

    def __init__(self, hidden: int, ffn: int, experts: int) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(hidden)
        self.router = nn.Linear(hidden, experts, bias=False)
        self.experts = nn.ModuleList(SwiGLUExpert(hidden, ffn) for _ in range(experts))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        x = self.norm(h)
        probs = self.router(x).softmax(-1)
        top, chosen = probs.topk(2, dim=-1)
        gates = torch.zeros_like(probs).scatter(-1, chosen, top / top.sum(-1, keepdim=True))
        outs = torch.stack([expert(x) for expert in self.experts], dim=-2)  # [b, s, E, h]
        return h + (gates.unsqueeze(-1) * outs).sum(-2)


def top2_moe_lm() -> LoopedMoELM:
    """(ids, labels) -> mean next-token cross-entropy; (ids,) -> logits; `Top2MoE` layers."""
    return LoopedMoELM(ffn=48, moe=Top2MoE)


def masked_smoothed(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Label-smoothed cross-entropy over the labels not masked (-100)."""
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, label_smoothing=0.1)


def _batch(vocab: int, size: int = 8, seq: int = 16, mask: bool = False):
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (size, seq), generator=gen)
    labels = torch.roll(ids, -1, dims=1)
    if mask:  # a third of the labels masked, unevenly over the ranks' samples
        labels = torch.where(torch.rand(labels.shape, generator=gen) < 0.33, -100, labels)
    return ids, labels


class HFCausalLM(nn.Module):
    """A transformers model as a training script holds it: (ids, labels) -> mean cross-entropy
    of the logits against labels already shifted; (ids,) -> logits."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        logits = self.model(input_ids=ids, use_cache=False).logits
        return logits if labels is None else F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def _cases():
    import hf_tiny

    from autopar import models

    cfg = dataclasses.replace(models.config("tiny-mixtral"), n_layers=5)
    return {
        "tiny-mixtral": (lambda: models.build(cfg, seed=1), cfg.vocab),
        "top2-moe": (lambda: (torch.manual_seed(2), top2_moe_lm())[1], 64),
        # transformers' experts stacked in one parameter (passes/expert_parallel_stacked.py)
        "hf-mixtral": (lambda: HFCausalLM(hf_tiny.build("mixtral", seed=3).model), hf_tiny.VOCAB),
        "hf-qwen2-moe": (lambda: HFCausalLM(hf_tiny.build("qwen2-moe", seed=4).model), hf_tiny.VOCAB),
    }


def _storage(pm, ref, label, ep: int, dp: int, tp: int = 1) -> list[tuple]:
    """The rank holds 1/ep of the experts' parameters (under a pipeline, of its stage's: each
    expert parameter is on its dp/ep owners x tp ranks only), on their owners' mesh of dp/ep
    ranks (x tp: TP shards each expert); the ranks' names together are the model's."""
    import collections

    import torch.distributed as dist
    from torch.distributed.tensor import Shard

    failures = []
    mine = {n for n, _ in pm.named_parameters()}
    stacked = {n: p for n, p in pm.named_parameters() if "ep" in (p.device_mesh.mesh_dim_names or ())}
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, sorted(stacked))  # every rank of a stage holds their rows
    experts = {n for n, _ in ref.named_parameters() if ".experts." in n} - set().union(*map(set, everyone))
    held = mine & experts
    dist.all_gather_object(everyone, sorted(held))
    copies = collections.Counter(n for names in everyone for n in names)
    if pm.plan.layout.pp == 1 and len(held) * ep != len(experts):
        failures.append((*label, f"holds {len(held)} of {len(experts)} expert parameters, not 1/{ep}"))
    if set(copies) != experts or any(n != dp // ep * tp for n in copies.values()):
        failures.append((*label, f"expert parameters not each on their {dp // ep} owners x tp{tp}"))
    meshes = {p.device_mesh.size() for n, p in pm.named_parameters() if n in held}
    if held and meshes != {dp // ep * tp}:
        failures.append((*label, f"experts on meshes of {meshes} ranks, not their {dp // ep} owners x tp{tp}"))
    for name, p in stacked.items():  # the rank's rows: Shard(0) over ep, then its owners' ZeRO rows
        mesh = p.device_mesh
        if (mesh["ep"].size(), mesh["dp"].size(), p.placements[0]) != (ep, dp // ep, Shard(0)):
            failures.append((*label, f"{name} is not its rows over ep{ep} on its {dp // ep} owners"))
    dist.all_gather_object(everyone, sorted(mine))
    if set().union(*map(set, everyone)) != {n for n, _ in ref.named_parameters()}:
        failures.append((*label, "the ranks' parameters together are not the model's"))
    return failures


def _whole_state(pm, ref, label, path: str | None) -> tuple[list[tuple], dict]:
    """``full_state_dict`` gathers every expert as the one-device model holds it; a DCP save and
    load, and a load of the one-device state dict, bring every rank's experts back after they
    are overwritten; eval is refused. Returns the failures and the gathered state (what a
    checkpoint at ``path`` holds)."""
    import torch.distributed.checkpoint as dcp

    from autopar.errors import InputError

    failures = []
    # copies: like a module's state_dict, a replicated parameter's entry is the parameter itself
    whole = {name: value.clone() for name, value in pm.full_state_dict().items()}
    for name, value in ref.state_dict().items():
        if name not in whole or not torch.allclose(whole[name], value, rtol=1e-5, atol=1e-6):
            failures.append((*label, f"full_state_dict()[{name!r}] is not the one-device value"))
    if path is not None:
        dcp.save(pm.state_dict(), checkpoint_id=path)
        with torch.no_grad():
            for p in pm.parameters():
                p.zero_()
        state = pm.state_dict()
        dcp.load(state, checkpoint_id=path)
        pm.load_state_dict(state)
        for name, p in pm.named_parameters():
            if not torch.equal(p.full_tensor(), whole[name]):
                failures.append((*label, f"{name} not restored by a DCP save and load"))
    with torch.no_grad():
        for p in pm.parameters():
            p.zero_()
    one_device = ref.state_dict()
    pm.load_state_dict(one_device)  # one device's whole tensors: each rank takes its experts
    for name, p in pm.named_parameters():
        if not torch.equal(p.full_tensor(), one_device[name]):
            failures.append((*label, f"{name} not loaded from a one-device state dict"))
    pm.eval()
    try:
        pm(*_batch(64))
        failures.append((*label, "pm.eval() ran on a rank holding a share of the experts"))
    except InputError as exc:
        refused = "pipeline" if pm.plan.layout.pp > 1 else "expert parallelism"  # either names the fix
        if refused not in str(exc) or "full_state_dict" not in str(exc):
            failures.append((*label, "eval refusal does not name the fix", str(exc)))
    pm.train()
    return failures, whole


def _reloaded(build, world: int, batch, loss_fn, layout: dict, path: str, whole: dict, label) -> list[tuple]:
    """The untrained model under another layout (no ep) loads the ep run's DCP checkpoint of the
    trained one: every parameter is the one the ep ranks saved."""
    import torch.distributed.checkpoint as dcp

    import autopar

    fresh = autopar.parallelize(build(), world, example_inputs=batch, layout=autopar.Layout(**layout),
                                loss_fn=loss_fn)
    state = fresh.state_dict()
    dcp.load(state, checkpoint_id=path)
    fresh.load_state_dict(state)
    return [(*label, f"{name} not loaded under {layout}") for name, p in fresh.named_parameters()
            if not torch.equal(p.full_tensor(), whole[name])]


def _worker(rank: int, world: int, runs: list[tuple], path: str | None = None,
            reload: dict | None = None) -> list[tuple]:
    import autopar

    cases = _cases()
    failures = []
    for i, (name, degrees, smoothed) in enumerate(runs):
        build, vocab = cases[name]
        model = build()
        ref = copy.deepcopy(model)
        batch = _batch(vocab, mask=smoothed)
        loss_fn = masked_smoothed if smoothed else None
        if degrees == "solver":  # the solver's own plan, on a fixed CPU profile: it picks ep
            plan = autopar.plan(model, batch, loss_fn=loss_fn,
                                cluster=autopar.Cluster("cpu", nodes=1, gpus_per_node=world))
            degrees = {"dp": plan.layout.dp, "ep": plan.layout.ep}
            if plan.layout.ep == 1:
                failures.append((name, plan.layout.short(), "the solver did not pick ep"))
                continue
            pm = autopar.parallelize(model, world, example_inputs=batch, plan=plan)
        else:
            pm = autopar.parallelize(model, world, example_inputs=batch, layout=autopar.Layout(**degrees),
                                     loss_fn=loss_fn)
        label = (name, pm.plan.layout.short(), "masked smoothed CE" if smoothed else "mean CE")
        # label smoothing's sum over a vocabulary split by TP runs replicated (the plan says so)
        failures += contract(pm, label, ("aten.sum",) if smoothed and degrees.get("tp", 1) > 1 else ())
        dump = pm.dump_graph()
        moved = dump.count("all_to_all_single") + dump.count("reduce_scatter_tensor")
        if moved < 2 * 2 or dump.count("EP over") < 4 * 2:
            failures.append((*label, "dump_graph shows no dispatch and combine with their decision"))
        if not smoothed:
            ref_fn = ref
        else:
            def ref_fn(ids, labels, ref=ref):
                return masked_smoothed(ref(ids), labels)
        failures += _storage(pm, ref, label, degrees["ep"], degrees["dp"], degrees.get("tp", 1))
        failures += train_and_compare(pm, _Ref(ref, ref_fn), batch, label, steps=2, optimizers=(sgd,))
        saved = f"{path}/{i}" if path and i == 0 else None
        problems, whole = _whole_state(pm, ref, label, saved)
        failures += problems
        if saved and reload:
            failures += _reloaded(build, world, batch, loss_fn, reload, saved, whole, label)
        torch.distributed.barrier()
    return failures


class _Ref(nn.Module):
    """The one-device model with the run's loss (the reference `train_and_compare` steps)."""

    def __init__(self, model: nn.Module, loss) -> None:
        super().__init__()
        self.model = model
        self._loss = (loss,)

    def forward(self, *batch):
        return self._loss[0](*batch)

    def named_parameters(self, *args, **kwargs):
        return self.model.named_parameters(*args, **kwargs)


def test_ep2_matches_one_device(tmp_path):
    runs = [("tiny-mixtral", "solver", False),  # the solver's plan: dp2 ep2
            ("tiny-mixtral", {"dp": 2, "ep": 2, "zero": 3}, True),
            ("top2-moe", {"dp": 2, "ep": 2, "zero": 1, "grad_accum": 2}, False),
            ("top2-moe", {"dp": 2, "ep": 2, "zero": 2}, True),
            ("hf-mixtral", {"dp": 2, "ep": 2}, True)]  # experts stacked in one parameter
    assert spawn(_worker, 2, (runs, str(tmp_path)), timeout_s=900) == [[], []]


@pytest.mark.slow
def test_stacked_experts_on_two_ranks(tmp_path):
    """transformers' Qwen2-MoE (a shared expert beside the routed ones) and Mixtral under ZeRO and
    gradient accumulation; the checkpoint loads without ep."""
    runs = [("hf-qwen2-moe", {"dp": 2, "ep": 2, "zero": 3}, True),
            ("hf-mixtral", {"dp": 2, "ep": 2, "zero": 1, "grad_accum": 2}, False)]
    assert spawn(_worker, 2, (runs, str(tmp_path), {"dp": 2}), timeout_s=900) == [[], []]


@pytest.mark.slow
def test_ep_on_four_ranks_matches_one_device(tmp_path):
    runs = [("top2-moe", {"dp": 4, "ep": 2, "zero": 3}, True),
            ("tiny-mixtral", {"dp": 4, "ep": 2, "recompute": "full"}, False),
            ("tiny-mixtral", {"dp": 4, "ep": 2, "zero": 2}, True),
            ("tiny-mixtral", {"dp": 4, "ep": 4, "zero": 3}, True),
            ("top2-moe", {"dp": 4, "ep": 4}, True),
            ("top2-moe", {"dp": 4, "ep": 2, "zero": 1, "grad_accum": 2}, False),
            # ep x tp: TP inside each expert, the tokens dispatched to the ep ranks of each TP index
            ("tiny-mixtral", {"dp": 2, "tp": 2, "ep": 2}, False),
            ("top2-moe", {"dp": 2, "tp": 2, "sp": True, "ep": 2, "zero": 1}, True),
            ("tiny-mixtral", {"dp": 2, "tp": 2, "sp": True, "ep": 2, "zero": 3}, True),
            # transformers' stacked experts: ep4, the owners' ZeRO rows, recompute, TP inside
            ("hf-mixtral", {"dp": 4, "ep": 4, "zero": 2}, True),
            ("hf-qwen2-moe", {"dp": 4, "ep": 4}, False),
            ("hf-qwen2-moe", {"dp": 4, "ep": 2, "zero": 3, "recompute": "full"}, False),
            ("hf-qwen2-moe", {"dp": 2, "tp": 2, "ep": 2}, False),
            ("hf-mixtral", {"dp": 2, "tp": 2, "sp": True, "ep": 2, "zero": 3}, True)]
    reload = {"dp": 4, "zero": 1}  # the ep2 x ZeRO-3 checkpoint loaded without ep
    assert spawn(_worker, 4, (runs, str(tmp_path), reload), timeout_s=1500) == [[], [], [], []]


def _one_row_worker(rank: int, world: int) -> list[tuple]:
    """One row per rank: transformers' MoE's loss is proven on its step at two rows
    (`autopar.execution.parallelize._loss_reduction`), then trains like one device."""
    import autopar

    failures = []
    for name, degrees in (("hf-mixtral", {"dp": 2, "ep": 2}), ("hf-qwen2-moe", {"dp": 2})):
        build, vocab = _cases()[name]
        model = build()
        ref = copy.deepcopy(model)
        batch = _batch(vocab, size=2, mask=True)
        pm = autopar.parallelize(model, world, example_inputs=batch, layout=autopar.Layout(**degrees))
        label = (name, pm.plan.layout.short(), "one row per rank")
        failures += contract(pm, label) + train_and_compare(pm, ref, batch, label, steps=2, optimizers=(sgd,))
    return failures


@pytest.mark.slow
def test_one_row_per_rank():
    assert spawn(_one_row_worker, 2, timeout_s=600) == [[], []]


@pytest.mark.slow
def test_ep_in_a_pipeline_matches_one_device(tmp_path):
    """dp2 x ep2 x pp2: each stage's ep ranks (one per data-parallel pipeline) exchange tokens
    inside the stage's forward and backward, the experts' gradients summed over their owners
    after the schedule (one rank each here: a sum over the dp group would add other experts'),
    ZeRO-1's rows over the dp ranks; lists of experts and transformers' stacked ones."""
    runs = [("tiny-mixtral", {"dp": 2, "ep": 2, "pp": 2, "schedule": "1f1b", "grad_accum": 2}, False),
            ("top2-moe", {"dp": 2, "ep": 2, "pp": 2, "zero": 1, "grad_accum": 2}, True),
            ("hf-mixtral", {"dp": 2, "ep": 2, "pp": 2, "grad_accum": 2}, True)]
    assert spawn(_worker, 4, (runs, str(tmp_path)), timeout_s=900) == [[], [], [], []]


@pytest.mark.slow
def test_ep_in_a_pipeline_on_eight_ranks(tmp_path):
    """dp4 x ep2 x pp2: each expert on 2 owners per stage, its gradient all-reduced over them
    after the schedule (`runtime.pipeline.reduce_experts`), ZeRO-1's rows over them."""
    runs = [("top2-moe", {"dp": 4, "ep": 2, "pp": 2, "zero": 1, "grad_accum": 2}, True)]
    assert spawn(_worker, 8, (runs, str(tmp_path)), timeout_s=900) == [[]] * 8
