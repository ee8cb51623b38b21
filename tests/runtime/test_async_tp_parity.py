"""Async TP on 2 gloo ranks trains like one device: a TP+SP plan made for GPUs (which hide the
sequence gathers, so the plan cuts each into `CommPlan.sp_gather_chunks` chunks,
`passes.async_tp`) run on CPU ranks gives one device's loss, gradients and parameters after 2
SGD and 2 AdamW steps (fp32, rtol 1e-5); on tiny-llama (mean cross-entropy) and a plain-PyTorch
model of our own (label-smoothed cross-entropy plus an activation penalty)."""

import copy

import torch
from parity_checks import adamw, sgd, tp_checks, train_and_compare
from parity_checks import contract as _contract
from plain_models import Block
from torch import nn

from runtime.launch import spawn


class SmoothedLM(nn.Module):
    """Embedding, two unequal blocks, a head; label smoothing and an activation penalty."""

    def __init__(self, vocab: int = 48, hidden: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList([Block(hidden, 64), Block(hidden, 96)])
        self.head = nn.Linear(hidden, vocab)

    def forward(self, ids, labels):
        h = self.embed(ids)
        for block in self.blocks:
            h = block(h)
        logits = self.head(h).flatten(0, 1)
        return nn.functional.cross_entropy(logits, labels.flatten(), label_smoothing=0.1) + 0.01 * h.pow(2).mean()


def _case(name: str):
    from autopar import models

    if name == "plain":
        torch.manual_seed(5)
        gen = torch.Generator().manual_seed(6)
        return SmoothedLM(), (torch.randint(0, 48, (4, 16), generator=gen), torch.randint(0, 48, (4, 16), generator=gen))
    return models.build(name, seed=5), models.example_inputs(name, batch=4, seq=16)


def _worker(rank: int, world: int) -> list[tuple]:
    import autopar

    failures = []
    for name in ("tiny-llama", "plain"):
        model, batch = _case(name)
        ref = copy.deepcopy(model)
        plan = autopar.plan(model, batch, cluster=autopar.Cluster("h100", nodes=1, gpus_per_node=world),
                            layout=autopar.Layout(tp=world, sp=True, precision="fp32"))
        label = (name, rank)
        if plan.decisions.comm.sp_gather_chunks != world:
            failures.append((*label, "a GPU plan does not chunk its gathers", plan.decisions.comm))
        pm = autopar.parallelize(model, world, example_inputs=batch, plan=plan)
        chunks = pm.dump_graph().count("async TP: sequence chunk 0 of")
        if chunks < 1:
            failures.append((*label, "no sequence gather chunked"))
        # the penalty's mean over the whole activation runs replicated (its sum has no TP rule)
        failures += _contract(pm, label, allowed_fallbacks=("aten.sum.default",) if name == "plain" else ())
        failures += tp_checks(pm, label)
        failures += train_and_compare(pm, ref, batch, label, steps=2, optimizers=(sgd, adamw))
    return failures


def test_chunked_sequence_gathers_match_one_device():
    assert spawn(_worker, 2, timeout_s=300) == [[]] * 2
