"""The forward's other outputs: which join over grad_accum micro-batches, what comes back.

In process (no ranks): `check_mergeable` refuses an output whose dim 0 is not the batch (a
feature statistic, also one whose length happens to equal the micro-batch) and a 0-dim bool,
and passes per-sample tensors with float and integer scalars (zoo tiny-llama and a plain
model); `merge_micro_batches` keeps each value's dtype; a non-constant leaf (transformers'
DynamicCache) comes back as None with a warning; ``(logits, loss)`` is refused naming the order.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from autopar import models
from autopar.capture.graph import OutputTree
from autopar.capture.joint import capture
from autopar.capture.outputs import check_mergeable
from autopar.errors import CaptureError, InputError
from runtime.executor import merge_micro_batches

V = 16


class Stats(nn.Module):
    """Returns the loss and the outputs ``kind`` names."""

    def __init__(self, kind: str, hidden: int = 8) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.head = nn.Embedding(V, hidden), nn.Linear(hidden, V)
        self.kind = kind

    def forward(self, ids, labels):
        h = self.embed(ids)
        z = self.head(h)
        loss = F.cross_entropy(z.flatten(0, 1), labels.flatten())
        if self.kind == "logits_first":
            return z, loss
        if self.kind == "feature_stat":
            return loss, h.mean((0, 1))  # [hidden]: dim 0 is no batch
        if self.kind == "flag":
            return loss, torch.isfinite(z).all()
        count = (z > 0).sum().to(torch.int32)
        return {"loss": loss, "logits": z, "count": count, "acc": (z.argmax(-1) == labels).float().mean()}


class ZooWithLogits(nn.Module):
    """tiny-llama's logits, the loss first; ``stat`` adds a per-position mean (dim 0 the sequence)."""

    def __init__(self, stat: bool) -> None:
        super().__init__()
        self.body, self.stat = models.build("tiny-llama", seed=3), stat

    def forward(self, ids, labels):
        logits = self.body(ids)
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        return (loss, logits, logits.mean((0, 2))) if self.stat else (loss, logits, loss.detach() * 2)


def _batch(rows: int, seq: int = 6, vocab: int = V):
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, vocab, (rows, seq), generator=g), torch.randint(0, vocab, (rows, seq), generator=g)


def _check(model: nn.Module, rows: int, m: int, vocab: int = V) -> None:
    whole = _batch(rows, vocab=vocab)
    micro = tuple(x[: rows // m] for x in whole)
    check_mergeable(model, capture(model, micro), micro, whole, None, m)


def test_per_sample_outputs_and_scalars_join():
    _check(Stats("dict"), rows=4, m=2)
    _check(ZooWithLogits(stat=False), rows=4, m=2, vocab=128)


@pytest.mark.parametrize("make, rows, what", [
    (lambda: Stats("feature_stat"), 4, "output[1], of shape [8]"),
    # hidden 2 == the micro-batch's rows: the shape alone would pass, the whole batch's does not
    (lambda: Stats("feature_stat", hidden=2), 4, "output[1], of shape [2]"),
    (lambda: Stats("flag"), 4, "output[1], a 0-dim bool"),
    (lambda: ZooWithLogits(stat=True), 4, "output[2], of shape [6]"),
])
def test_outputs_that_do_not_join_are_refused(make, rows, what):
    model = make()
    vocab = 128 if isinstance(model, ZooWithLogits) else V
    with pytest.raises(InputError, match="grad_accum=2") as err:
        _check(model, rows, m=2, vocab=vocab)
    assert what in str(err.value) and "fix:" in str(err.value)
    _check(model, rows, m=1, vocab=vocab)  # one micro-batch: returned as computed


def test_merge_keeps_dtypes():
    parts = [[torch.tensor(3, dtype=torch.int32), torch.tensor(1.5, dtype=torch.bfloat16), torch.ones(1, 2)],
             [torch.tensor(4, dtype=torch.int32), torch.tensor(2.5, dtype=torch.bfloat16), torch.zeros(1, 2)]]
    count, mean, rows = merge_micro_batches(parts)
    assert count.dtype == torch.int32 and int(count) == 7
    assert mean.dtype == torch.bfloat16 and float(mean) == 2.0
    assert rows.tolist() == [[1.0, 1.0], [0.0, 0.0]]
    with pytest.raises(ValueError, match="bool"):
        merge_micro_batches([[torch.tensor(True)], [torch.tensor(False)]])


def test_non_constant_leaves_come_back_as_none():
    class Cache:
        pass

    loss = torch.tensor(1.0)
    with pytest.warns(UserWarning, match=r"Cache at output\['cache'\].*use_cache=False"):
        tree = OutputTree.of({"loss": loss, "cache": Cache(), "n": 3, "name": "x", "none": None}, loss)
    built = tree.build(loss, [])
    assert built == {"loss": loss, "cache": None, "n": 3, "name": "x", "none": None}


def test_hf_dynamic_cache_is_not_returned():
    tf = pytest.importorskip("transformers")

    class Wrapped(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.m = tf.LlamaForCausalLM(tf.LlamaConfig(
                vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                num_attention_heads=2, num_key_value_heads=2))

        def forward(self, ids, labels):
            return self.m(input_ids=ids, labels=labels)  # use_cache=True: the config's default

    ids = torch.randint(0, 32, (2, 8))
    with pytest.warns(UserWarning, match="DynamicCache.*use_cache=False"):
        graph = capture(Wrapped(), (ids, ids.clone()))
    assert graph.output_tree.consts and all(v is None for v in graph.output_tree.consts.values())


def test_logits_before_the_loss_is_refused_naming_the_order():
    with pytest.raises(CaptureError, match=r"first value is a tensor of shape \[2, 6, 16\].*'loss' key"):
        capture(Stats("logits_first"), _batch(2))
