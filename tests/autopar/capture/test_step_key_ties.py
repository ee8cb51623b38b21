"""A tied and an untied model of one class are different steps: the memoised capture of one is
never reused for the other (the tied graph reads one weight where the untied reads two)."""

import torch
from torch import nn

from autopar.capture.fingerprint import step_key
from autopar.search.step import captured_step


class HeadLM(nn.Module):
    def __init__(self, tie: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.head = nn.Linear(16, 32, bias=False)
        if tie:
            self.head.weight = self.embed.weight

    def forward(self, ids, labels):
        return nn.functional.cross_entropy(self.head(torch.tanh(self.embed(ids))).flatten(0, 1), labels.flatten())


def test_tying_changes_the_step_key_and_the_capture():
    ids = torch.zeros(4, 8, dtype=torch.long)
    untied, tied = HeadLM(False), HeadLM(True)
    assert step_key(untied, (ids, ids), None) != step_key(tied, (ids, ids), None)
    assert step_key(HeadLM(True), (ids, ids), None) == step_key(tied, (ids, ids), None)
    first = captured_step(untied, (ids, ids), None, torch.float32)
    second = captured_step(tied, (ids, ids), None, torch.float32)
    assert set(first.graph.param_names) == {"embed.weight", "head.weight"}
    assert set(second.graph.param_names) == {"embed.weight"}
