"""Capture-cache keys of recurrent modules: an ``nn.GRU`` caches its flat weights; the capture
points them back at the real parameters, the key skips them (the parameters themselves are
keyed), so a GRU model is captured, looked up again and planned."""

import torch
import torch.nn.functional as F
from torch import nn

import autopar
from autopar.capture.fingerprint import step_key
from autopar.search.step import captured_step


class GRULM(nn.Module):
    def __init__(self, vocab: int = 64, hidden: int = 16):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(vocab, hidden)
        self.gru = nn.GRU(hidden, hidden, batch_first=True)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, ids, labels):
        y, _ = self.gru(self.embed(ids))
        logits = self.head(y)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def _batch():
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 64, (4, 8), generator=g), torch.randint(0, 64, (4, 8), generator=g)


def test_gru_captures_twice_with_one_key():
    model, batch = GRULM(), _batch()
    first = step_key(model, batch, None)
    graph = captured_step(model, batch, None, None)
    assert step_key(model, batch, None) == first  # the capture's leftovers change nothing
    assert captured_step(model, batch, None, None) is graph  # the second lookup hits the cache
    flat = dict(model.gru.named_parameters())  # the module holds no trace's stand-ins
    assert all(any(w is p for p in flat.values()) for w in model.gru._flat_weights)
    model.gru.bias = False  # an attribute still keys the graph
    assert step_key(model, batch, None) != first


def test_gru_model_plans():
    model, batch = GRULM(), _batch()
    plan = autopar.plan(model, batch)
    again = autopar.plan(model, batch)
    assert plan.layout == again.layout
    assert {n for n in plan.placements} == {n for n, _ in model.named_parameters()}
