"""Losses that read the vocabulary-parallel log-softmax other than through ``nll_loss`` train as
on one device under TP: label-smoothed cross-entropy, the gather form
``-log_softmax(logits).gather(-1, labels).mean()`` (RL and preference losses) and cross-entropy
plus an entropy bonus, class weights with label smoothing over padded labels plus an unreduced
cross-entropy. Loss, every gradient and the parameters after 2 SGD steps match one
device (fp32, rtol 1e-5) under tp=2 (dp=1) for a plain-PyTorch LM and the zoo's tiny Llama.

Under TP the logits are sharded over the vocabulary; the log-softmax's backward
``grad - softmax * sum(grad)`` needs the sum over the whole vocabulary, so a loss reading the
log-probabilities directly is wrong if that sum is taken over one rank's shard only.
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from parity_checks import sgd, train_and_compare
from torch import nn

from runtime.launch import spawn

VOCAB, HIDDEN = 64, 32


def smoothed(logits, labels):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), label_smoothing=0.1)


def gathered(logits, labels):
    logp = F.log_softmax(logits.float(), dim=-1)
    return -logp.gather(-1, labels.unsqueeze(-1)).mean()


def entropy_bonus(logits, labels):
    flat = logits.reshape(-1, logits.shape[-1])
    logp = F.log_softmax(flat, dim=-1)
    entropy = -(logp.exp() * logp).sum(-1).mean()
    return F.cross_entropy(flat, labels.reshape(-1)) - 0.01 * entropy


def weighted_unreduced(logits, labels):
    """Class weights with label smoothing over padded labels, plus an unreduced CE summed."""
    vocab = logits.shape[-1]
    flat, labels = logits.reshape(-1, vocab), labels.reshape(-1)
    labels = labels.masked_fill(labels % 5 == 0, -100)
    weight = torch.linspace(0.5, 1.5, vocab, device=logits.device)
    smoothed = F.cross_entropy(flat, labels, weight=weight, label_smoothing=0.1)
    return smoothed + F.cross_entropy(flat, labels, reduction="none").sum() / labels.numel()


LOSSES = {"label_smoothing": smoothed, "gather": gathered, "entropy_bonus": entropy_bonus,
          "weighted_unreduced": weighted_unreduced}


class PlainLM(nn.Module):
    """Embedding, a two-layer MLP block with a residual, and an untied head."""

    def __init__(self, loss):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.up = nn.Linear(HIDDEN, 4 * HIDDEN)
        self.down = nn.Linear(4 * HIDDEN, HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)
        self.loss = loss

    def forward(self, ids, labels):
        x = self.embed(ids)
        x = x + self.down(F.gelu(self.up(x)))
        return self.loss(self.head(x), labels)


class ZooLM(nn.Module):
    """The zoo's tiny Llama's logits under another loss."""

    def __init__(self, loss):
        super().__init__()
        from autopar import models

        self.lm = models.build("tiny-llama", seed=3)
        self.loss = loss

    def forward(self, ids, labels):
        return self.loss(self.lm(ids), labels)


def _worker(rank: int, world: int, cases: list[tuple[str, str]]) -> list[tuple]:
    import autopar

    failures = []
    for model_name, loss_name in cases:
        make = {"PlainLM": PlainLM, "ZooLM": ZooLM}[model_name]
        model = make(LOSSES[loss_name])
        vocab = model.lm.config.vocab if make is ZooLM else VOCAB
        g = torch.Generator().manual_seed(1)
        ids = torch.randint(0, vocab, (4, 16), generator=g)
        labels = torch.randint(0, vocab, (4, 16), generator=g)
        ref = copy.deepcopy(model)
        pm = autopar.parallelize(model, world, example_inputs=(ids, labels),
                                 layout=autopar.Layout(dp=1, tp=world))
        failures += train_and_compare(pm, ref, (ids, labels), (model_name, loss_name), steps=2,
                                      optimizers=(sgd,))
    return failures


def test_log_softmax_losses_match_one_device_under_tp():
    cases = [("PlainLM", loss) for loss in LOSSES] + [("ZooLM", "gather")]
    assert spawn(_worker, 2, (cases,), timeout_s=900) == [[], []]


@pytest.mark.slow
def test_log_softmax_losses_of_the_zoo_match_one_device_under_tp():
    cases = [("ZooLM", "label_smoothing"), ("ZooLM", "entropy_bonus"), ("ZooLM", "weighted_unreduced")]
    assert spawn(_worker, 2, (cases,), timeout_s=900) == [[], []]
