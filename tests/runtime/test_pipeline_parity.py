"""Pipeline parallelism on gloo ranks trains like one device.

Loss, every gradient and the updated parameters after 2 SGD then 2 AdamW steps (fp32, rtol 1e-5,
`parity_checks`), under GPipe ("afab"), 1F1B with 1, 2 and 8 micro-batches, interleaved 1F1B
(two stages per rank), zero-bubble (ZB1P: input and weight gradients apart), pp=4 (also with
fewer micro-batches than stages), pp x dp with ZeRO-1 (its gradients all-reduced as on CPU,
and reduce-scattered as on GPUs), pp x tp with SP, with selective and full
recompute (also a different choice per stage); on tiny-llama, tiny-gpt2
(its tied embedding and head live on the first and last stage), tiny-mixtral and a plain-PyTorch
model of our own. Every parameter lives on exactly one stage (both ends for the tied one), with
the plan's placements; the stages are the plan's cut. The transformers models run with
``-m slow``.
"""

import copy
import dataclasses
import multiprocessing

import pytest
import torch
from parity_checks import adamw, sgd
from parity_checks import contract as _contract
from parity_checks import train_and_compare as _train_and_compare
from plain_models import Block
from torch import nn

from runtime.launch import RankFailedError, spawn


class PlainNet(nn.Module):
    """A model of our own in plain PyTorch: embedding, 4 unequal blocks, a head, cross-entropy."""

    def __init__(self, vocab: int = 50, hidden: int = 32, layers: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(Block(hidden, hidden * (2 + 2 * (i % 2))) for i in range(layers))
        self.head = nn.Linear(hidden, vocab)

    def forward(self, ids, labels):
        h = self.embed(ids)
        for layer in self.layers:
            h = layer(h)
        return nn.functional.cross_entropy(self.head(h).flatten(0, 1), labels.flatten())


def _model(name: str, layers: int):
    from autopar import models

    if name == "plain":
        torch.manual_seed(3)
        gen = torch.Generator().manual_seed(4)
        ids = torch.randint(0, 50, (8, 12), generator=gen)
        return PlainNet(layers=layers), (ids, torch.randint(0, 50, (8, 12), generator=gen))
    if name.startswith("hf-"):
        import hf_tiny

        return hf_tiny.build(name[3:], seed=3), hf_tiny.batch(size=8, seq=16)
    cfg = dataclasses.replace(models.config(name), n_layers=layers)
    return models.build(cfg, seed=3), models.example_inputs(cfg, batch=8, seq=16)


def _pipeline_worker(rank: int, world: int, cases: list[tuple[str, int, dict]]) -> list[tuple]:
    import torch.distributed as dist

    import autopar

    failures = []
    from vocab.plan_types import RecomputeChoice

    for name, layers, degrees in cases:
        model, batch = _model(name, layers)
        ref = copy.deepcopy(model)
        degrees = dict(degrees)
        per_stage = degrees.pop("per_stage", None)
        scatter = degrees.pop("reduce_scatter", False)
        if scatter:  # ZeRO-1's gradients reduce-scattered, as plans for GPUs run them
            plan = autopar.plan(model, batch, cluster=autopar.Cluster("cpu", nodes=1, gpus_per_node=world),
                                layout=autopar.Layout(**degrees))
            plan.decisions.comm = dataclasses.replace(plan.decisions.comm, reduce_scatter=True)
            pm = autopar.parallelize(model, world, example_inputs=batch, plan=plan)
        elif per_stage:  # each stage recomputes its own (what "auto" picks on a squeezed device)
            plan = autopar.plan(model, batch, cluster=autopar.Cluster("h100", nodes=1, gpus_per_node=world),
                                layout=autopar.Layout(**degrees, precision="fp32"))
            plan.decisions.recompute_per_stage = tuple(RecomputeChoice(*c) for c in per_stage)
            pm = autopar.parallelize(model, world, example_inputs=batch, plan=plan)
            ran = {int(line.split(":")[0].split()[1]) for line in pm.plan.recompute}
            stage_blocks = {b for (first, last), c in zip(pm.plan.stages, per_stage) if c[0] != "none"
                            for b in range(first, last + 1)}
            if ran != stage_blocks:
                failures.append((name, "recomputed blocks", sorted(ran), "expected", sorted(stage_blocks)))
        else:
            pm = autopar.parallelize(model, world, example_inputs=batch, layout=autopar.Layout(**degrees))
        label = (name, pm.plan.layout.short(), rank)
        failures += _contract(pm, label)
        failures += _train_and_compare(pm, ref, batch, label, steps=2, optimizers=(sgd, adamw))
        # every parameter is somewhere, each stage holds its own (the tied one on both ends)
        held = [None] * world
        dist.all_gather_object(held, sorted(n for n, _ in pm.named_parameters()))
        names = {n for n, _ in ref.named_parameters()}
        if set().union(*held) != names:
            failures.append((*label, "parameters held by no stage", sorted(names - set().union(*held))))
        if pm.plan.layout.pp > 1 and len(set(map(tuple, held))) < pm.plan.layout.pp:
            failures.append((*label, "the stages hold the same parameters"))
        dump = pm.dump_graph()
        pipeline = pm._rank_graph.pipeline
        if not all(f"pipeline stage {s} of {len(pm.plan.stages)}" in dump for s in pipeline.stages):
            failures.append((*label, "dump_graph does not show the stage"))
        if (pm.plan.layout.schedule == "zero-bubble") != ("weight-gradient half" in dump):
            failures.append((*label, "dump_graph does not show zero-bubble's two halves"))
    return failures


# every model under 1F1B; all-forward-all-backward and 8 micro-batches on two models each (the
# other pairs in TWO_RANKS_MORE, slow)
_SCHEDULES = {"tiny-llama": (("afab", 1), ("1f1b", 2)), "plain": (("afab", 1), ("1f1b", 2)),
              "tiny-gpt2": (("1f1b", 2), ("1f1b", 8)), "tiny-mixtral": (("1f1b", 2), ("1f1b", 8))}
TWO_RANKS_MORE = [(name, 2, dict(pp=2, schedule=schedule, grad_accum=m))
                  for name in _SCHEDULES for schedule, m in (("afab", 1), ("1f1b", 2), ("1f1b", 8))
                  if (schedule, m) not in _SCHEDULES[name]]
TWO_RANKS = [(name, 2, dict(pp=2, schedule=schedule, grad_accum=m))
             for name, pairs in _SCHEDULES.items() for schedule, m in pairs] + [
    # recompute composes: the copies run on their block's stage
    ("tiny-gpt2", 2, dict(pp=2, grad_accum=2, recompute="selective")),
    ("tiny-llama", 2, dict(pp=2, grad_accum=2, recompute="full")),
    # stages choose apart: full recompute on the first, none on the second (and the other way)
    ("tiny-llama", 4, dict(pp=2, grad_accum=2, per_stage=[("full", ()), ("none", ())])),
    ("plain", 4, dict(pp=2, grad_accum=2, per_stage=[("none", ()), ("selective", ())])),
    # interleaved 1F1B: 4 stages on 2 ranks (stage c on rank c mod 2); GPT-2's tied embedding
    # and head on stages 0 and 3, ranks 0 and 1
    ("tiny-llama", 4, dict(pp=2, schedule="interleaved-1f1b", virtual_stages=2, grad_accum=4)),
    ("tiny-gpt2", 4, dict(pp=2, schedule="interleaved-1f1b", virtual_stages=2, grad_accum=2)),
    # zero-bubble (ZB1P): each backward's weight half runs in the bubbles
    ("tiny-llama", 2, dict(pp=2, schedule="zero-bubble", grad_accum=4)),
    ("tiny-mixtral", 2, dict(pp=2, schedule="zero-bubble", grad_accum=2)),
]


def test_pipeline_on_two_ranks_matches_one_device():
    results = spawn(_pipeline_worker, 2, args=(TWO_RANKS,), timeout_s=900)
    assert results == [[]] * 2


@pytest.mark.slow
def test_pipeline_on_two_ranks_other_schedules_match_one_device():
    results = spawn(_pipeline_worker, 2, args=(TWO_RANKS_MORE,), timeout_s=900)
    assert results == [[]] * 2


FOUR_RANKS = {
    # pipelines composed with DP and TP need 4 ranks: in the default suite
    "composed": [("tiny-gpt2", 2, dict(pp=2, dp=2, zero=1, grad_accum=2)),
                 ("tiny-llama", 2, dict(pp=2, tp=2, sp=True, grad_accum=2))],
    # four stages: what two stages check, deeper (slow)
    "deep": [("tiny-llama", 4, dict(pp=4, grad_accum=8)),
             ("tiny-gpt2", 4, dict(pp=4, schedule="zero-bubble", grad_accum=8)),
             ("plain", 4, dict(pp=4, grad_accum=2))],  # fewer micro-batches than stages
}


@pytest.mark.parametrize("cases", ["composed", pytest.param("deep", marks=pytest.mark.slow)])
def test_pipeline_on_four_ranks_matches_one_device(cases):
    results = spawn(_pipeline_worker, 4, args=(FOUR_RANKS[cases],), timeout_s=900)
    assert results == [[]] * 4


@pytest.mark.slow
def test_pipeline_of_transformers_models_matches_one_device():
    cases = [(f"hf-{family}", 2, dict(pp=2, grad_accum=2)) for family in ("llama", "gpt2", "mixtral")]
    assert spawn(_pipeline_worker, 2, args=(cases,), timeout_s=900) == [[]] * 2


@pytest.mark.slow
def test_more_pipeline_layouts_on_four_ranks_match_one_device():
    cases = [("tiny-mixtral", 4, dict(pp=4, schedule="afab", grad_accum=4)),
             ("tiny-mixtral", 2, dict(pp=2, dp=2, grad_accum=4)),
             ("tiny-gpt2", 2, dict(pp=2, tp=2, sp=True, grad_accum=2)),
             ("plain", 2, dict(pp=2, dp=2, zero=1, grad_accum=4)),
             ("tiny-llama", 2, dict(pp=2, dp=2, zero=1, grad_accum=2, reduce_scatter=True)),
             ("hf-llama", 2, dict(pp=2, tp=2, sp=True, grad_accum=2)),
             ("plain", 8, dict(pp=4, schedule="interleaved-1f1b", virtual_stages=2, grad_accum=8)),
             ("tiny-llama", 4, dict(pp=2, dp=2, zero=1, schedule="interleaved-1f1b", virtual_stages=2,
                                    grad_accum=4))]
    assert spawn(_pipeline_worker, 4, args=(cases,), timeout_s=900) == [[]] * 4


def _dies_mid_schedule(rank: int, world: int) -> str:
    import os

    import autopar
    import runtime.pipeline as pipeline
    from autopar import models

    model = models.build("tiny-llama", seed=3)
    batch = models.example_inputs("tiny-llama", batch=8, seq=16)
    pm = autopar.parallelize(model, world, example_inputs=batch, layout=autopar.Layout(pp=2, grad_accum=4))
    forward, calls = pipeline.run_forward, []

    def dying(*args, **kwargs):
        calls.append(1)
        if rank == 1 and len(calls) == 3:  # stage 1, third micro-batch: rank 0 is mid-schedule
            os._exit(3)
        return forward(*args, **kwargs)

    pipeline.run_forward = dying
    pm(*batch).backward()
    return "finished"


def test_a_rank_dying_mid_schedule_ends_the_run_with_its_name():
    # The launch's limit guards against a hang only. Rank 0 (stage 0) waits on its dead
    # peer; with the collective timeout as long as the launch's (spawn never lets it be
    # longer; it starts later), only noticing the death gives a RankFailedError rather than
    # the launch's TimeoutError.
    with pytest.raises(RankFailedError, match="rank 1 died.*exit code 3"):
        spawn(_dies_mid_schedule, 2, timeout_s=300, collective_timeout_s=300)
    assert multiprocessing.active_children() == []  # rank 0 was ended, not left waiting


def _zero_bubble_order(rank: int, world: int) -> str:
    import autopar
    import runtime.pipeline as pipeline

    model, batch = _model("tiny-llama", 4)
    pm = autopar.parallelize(model, world, example_inputs=batch,
                             layout=autopar.Layout(pp=world, schedule="zero-bubble", grad_accum=8))
    log = []

    def logged(run, letter):
        def call(*args, **kwargs):
            log.append(letter)
            return run(*args, **kwargs)
        return call

    for name, letter in (("run_forward", "F"), ("run_backward_input", "I"), ("run_backward_weight", "W")):
        setattr(pipeline, name, logged(getattr(pipeline, name), letter))
    pm(*batch).backward()
    return "".join(log)


def test_zero_bubble_runs_weight_gradients_later():
    """ZB1P's order on each rank: every micro-batch's F, I and W once; the last rank runs a
    forward between an input half and its weight half (the W fills a bubble later)."""
    orders = spawn(_zero_bubble_order, 4, timeout_s=300)
    assert all(o.count("F") == o.count("I") == o.count("W") == 8 for o in orders)
    assert "IF" in orders[-1] and orders[-1].endswith("WW")


def _checkpoint_worker(rank: int, world: int, path: str) -> list:
    """A checkpoint saved under one plan loads under another, pipelines included."""
    import torch.distributed as dist
    from parity_checks import moved_checkpoint

    import autopar
    from autopar import models

    batch = models.example_inputs("tiny-gpt2", batch=4, seq=16)
    layouts = [autopar.Layout(pp=world, grad_accum=2), autopar.Layout(dp=world, zero=3),
               autopar.Layout(pp=world, schedule="afab", grad_accum=4)]
    failures = []
    for k, (before, after) in enumerate(zip(layouts, layouts[1:])):
        pm, fresh = moved_checkpoint(lambda seed: models.build("tiny-gpt2", seed=seed), world, batch,
                                     before, after, f"{path}/{k}",
                                     lambda params: torch.optim.SGD(params, lr=0.1))
        # every rank's values, from whichever stage held them on either side
        mine = [{n: p.full_tensor() for n, p in m.named_parameters()} for m in (pm, fresh)]
        both = [None] * world
        dist.all_gather_object(both, mine)
        old = {n: t for rank_views in both for n, t in rank_views[0].items()}
        new = {n: t for rank_views in both for n, t in rank_views[1].items()}
        if set(old) != set(new) or not all(torch.equal(old[n], new[n]) for n in old):
            failures.append((before.short(), after.short()))
    return failures


def test_checkpoints_move_between_pipeline_and_zero_plans(tmp_path):
    assert spawn(_checkpoint_worker, 2, args=(str(tmp_path),), timeout_s=300) == [[], []]
