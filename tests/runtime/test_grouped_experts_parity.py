"""Experts captured as one grouped computation (autopar.capture.experts) train like one device.

The zoo Mixtral (16 experts, a loop over `self.experts`) and a plain-PyTorch top-2 MoE whose
experts run in a Python loop (tests/looped_moe.py), under dp2 and tp2 on 2 gloo ranks: loss,
every gradient and the parameters after 2 SGD steps, fp32, rtol 1e-5; and the zoo Mixtral with
8 experts (below `MIN_EXPERTS`: each expert traced as it is) under dp2. Under TP the grouped
experts' weights stay replicated (the recipe shards the attention and the head around them).
One spawn runs every case.
"""

import copy
import dataclasses

from parity_checks import contract, sgd, train_and_compare

from runtime.launch import spawn

LAYOUTS = [{"dp": 2}, {"tp": 2}]


def _worker(rank: int, world: int) -> list[tuple]:
    import looped_moe
    import torch

    import autopar
    from autopar import models

    cfg = dataclasses.replace(models.config("tiny-mixtral"), name="tiny-mixtral-16", n_experts=16)
    few = dataclasses.replace(cfg, name="tiny-mixtral-8", n_experts=8)
    cases = [("tiny-mixtral-16", lambda: models.build(cfg, seed=1), models.example_inputs(cfg, batch=4, seq=16), 16),
             ("looped-moe", lambda: looped_moe.build(16), looped_moe.batch(size=4), 16),
             ("tiny-mixtral-8", lambda: models.build(few, seed=1), models.example_inputs(few, batch=4, seq=16), 0)]
    failures = []
    for name, build, batch, experts in cases:
        for degrees in LAYOUTS if experts else LAYOUTS[:1]:
            model = build()
            ref = copy.deepcopy(model)
            pm = autopar.parallelize(model, world, example_inputs=batch, layout=autopar.Layout(**degrees))
            label = (name, pm.plan.layout.short())
            failures += contract(pm, label)
            nodes = list(pm._rank_graph.gm.graph.nodes)
            grouped = {n.meta["expert_group"] for n in nodes if "expert_group" in n.meta}
            bmm = sum(n.target == torch.ops.aten.bmm.default for n in nodes)
            # the experts' batched matmuls, 2 or 3 forward and twice that backward per layer
            # (under TP the rank's graph is traced again through DTensor, without the labels)
            if experts and ((degrees.get("tp", 1) == 1 and {e for _, e in grouped} != {experts}) or bmm < 2 * 6):
                failures.append((*label, "experts not grouped in the rank's graph", sorted(grouped), bmm))
            failures += train_and_compare(pm, ref, batch, label, steps=2, optimizers=(sgd,))
            torch.distributed.barrier()
    return failures


def test_grouped_experts_match_one_device():
    assert spawn(_worker, 2, timeout_s=900) == [[], []]
