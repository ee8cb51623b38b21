"""Padding labels (-100) train as on one device: the loss is the mean over the valid tokens of
the whole global batch, not the mean of each rank's (or micro-batch's) own mean.

30 % of the labels are ignored, unevenly: the first rows of the batch are mostly padding, the
last hardly any, so every data-parallel rank and micro-batch has its own count. Loss, every
gradient and the parameters after 2 SGD and 2 AdamW steps match one device (fp32, rtol 1e-5),
under DP with gradient accumulation, ZeRO-3, TP+SP and a 1F1B pipeline, for the zoo's tiny Llama and
transformers' Llama (which shifts its labels inside the model); with ``local_batch=True`` each
rank passes only its slice.
"""

import copy

import torch
from parity_checks import adamw, sgd, train_and_compare

from runtime.launch import spawn

LAYOUTS = [{"dp": 2, "grad_accum": 2}, {"dp": 2, "zero": 3}, {"tp": 2, "sp": True, "grad_accum": 2},
           {"pp": 2, "grad_accum": 4}]  # a pipeline: each micro-batch seeded by its share


def padded(labels: torch.Tensor, share: float = 0.3, seed: int = 7) -> torch.Tensor:
    """``labels`` with about ``share`` of them set to -100, row i padded with probability
    rising from 0 (last row) to 2 * share (first row)."""
    rows = labels.shape[0]
    rate = torch.linspace(2 * share, 0.0, rows).unsqueeze(1).expand_as(labels)
    drop = torch.rand(labels.shape, generator=torch.Generator().manual_seed(seed)) < rate
    return labels.masked_fill(drop, -100)


def _models():
    import hf_tiny

    from autopar import models

    zoo = models.build("tiny-llama", seed=3)
    ids, labels = models.example_inputs("tiny-llama", batch=8, seq=16)
    yield "tiny-llama", zoo, (ids, padded(labels))
    ids, labels = hf_tiny.batch(size=8)
    yield "hf-llama", hf_tiny.build("llama"), (ids, padded(labels))


def _worker(rank: int, world: int) -> list[tuple]:
    import autopar

    failures = []
    for name, model, batch in _models():
        share = (batch[1] == -100).float().mean().item()
        assert 0.2 < share < 0.4, share
        for degrees in LAYOUTS:
            ref = copy.deepcopy(model)
            pm = autopar.parallelize(model, world, example_inputs=batch, layout=autopar.Layout(**degrees))
            label = (name, pm.plan.layout.short())
            failures += train_and_compare(pm, ref, batch, label, steps=2, optimizers=(sgd, adamw))
        # local_batch: each rank passes its data-parallel slice, as a DistributedSampler gives it
        ref = copy.deepcopy(model)
        pm = autopar.parallelize(model, world, example_inputs=batch, layout=autopar.Layout(dp=world),
                                 local_batch=True)
        mine = tuple(x.chunk(world)[rank] for x in batch)
        loss = pm(*mine)
        loss.backward()
        ref_loss = ref(*batch)
        ref_loss.backward()
        if not torch.allclose(loss, ref_loss.detach(), rtol=1e-5, atol=1e-6):
            failures.append((name, "local_batch loss", loss.item(), ref_loss.item()))
        named = dict(ref.named_parameters())
        failures += [(name, "local_batch grad", n) for n, p in pm.named_parameters()
                     if not torch.allclose(p.grad.full_tensor(), named[n].grad, rtol=1e-5, atol=1e-6)]
    return failures


def test_padding_labels_match_one_device():
    assert spawn(_worker, 2, timeout_s=600) == [[], []]
