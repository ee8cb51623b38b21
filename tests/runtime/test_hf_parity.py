"""Parity for Hugging Face transformers models: a parallel step on gloo ranks equals one device.

Tiny Llama, Qwen2, GPT-2, Mistral, Mixtral and Qwen2-MoE configs (tests/hf_tiny.py) under DP,
ZeRO-3, TP+SP and the solver's own plan on 2 ranks, and ZeRO-3, DP x TP+SP and the solver's
plan on 4: loss, every gradient and the parameters after 2 SGD then 2 AdamW steps, fp32, rtol
1e-5. One spawn per world size runs them all. The default suite runs each family under two of
the 2-rank layouts (each layout on three families, dense and MoE); the whole 2-rank matrix and
the 4-rank run are marked slow (`python -m pytest -m slow`).

Under TP every weight the plan shards is sharded, no op falls back to replication, and no
fused projection (GPT-2's q, k, v; the experts' gate and up) is gathered to be split or
concatenated: the MoE experts (transformers' grouped matmuls) run column- and row-parallel.
"""

import copy

import pytest
from parity_checks import adamw, contract, sgd, tp_checks, train_and_compare

from runtime.launch import spawn

FAMILIES = ("llama", "qwen2", "gpt2", "mistral", "mixtral", "qwen2-moe")
# plain DP, ZeRO-3, TP+SP and the solver's own plan ({})
LAYOUTS = {2: [{"dp": 2}, {"dp": 2, "zero": 3}, {"tp": 2, "sp": True}, {}],
           4: [{"dp": 4, "zero": 3}, {"dp": 2, "tp": 2, "sp": True, "zero": 1}, {}]}
DP, ZERO3, TP_SP, SOLVER = LAYOUTS[2]
ROTATED = {"llama": [DP, TP_SP], "qwen2": [ZERO3, SOLVER], "gpt2": [DP, TP_SP],
           "mistral": [ZERO3, SOLVER], "mixtral": [TP_SP, ZERO3], "qwen2-moe": [DP, SOLVER]}
CASES = {"2-rotated": (2, ROTATED), "2": (2, {f: LAYOUTS[2] for f in FAMILIES}),
         "4": (4, {f: LAYOUTS[4] for f in FAMILIES})}


def _worker(rank: int, world: int, layouts: dict[str, list[dict]]) -> list[tuple]:
    import hf_tiny

    import autopar

    failures = []
    for family in FAMILIES:
        for degrees in layouts[family]:
            wrapper = hf_tiny.build(family)
            ref = copy.deepcopy(wrapper)
            batch = hf_tiny.batch(size=8)
            layout = autopar.Layout(**degrees) if degrees else None
            pm = autopar.parallelize(wrapper, world, example_inputs=batch, layout=layout)
            label = (family, pm.plan.layout.short())
            failures += contract(pm, label)
            if pm.plan.layout.tp > 1:
                failures += tp_checks(pm, label)
            failures += train_and_compare(pm, ref, batch, label, steps=2, optimizers=(sgd, adamw))
    return failures


# the whole 2-rank matrix and 4 ranks (several times the cost of 2) are slow
@pytest.mark.parametrize("case", ["2-rotated", pytest.param("2", marks=pytest.mark.slow),
                                  pytest.param("4", marks=pytest.mark.slow)])
def test_transformers_models_match_one_device(case):
    world, layouts = CASES[case]
    assert spawn(_worker, world, args=(layouts,), timeout_s=900) == [[]] * world
