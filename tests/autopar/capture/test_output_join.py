"""The forward's other outputs: which join over grad_accum micro-batches, what comes back.

In process (no ranks): `output_joins` refuses an output whose dim 0 is not the batch (a
feature statistic, also one whose length happens to equal the micro-batch), a 0-dim bool, and a
0-dim value that is no mean, sum or single ratio of sums over the batch (a max over the batch, a
mean beside a ratio); it concatenates per-sample tensors, averages means and values the batch
does not enter, sums sums, float or integer, and weights a ratio's micro-batches by their share
of its denominator (zoo tiny-llama and a plain model); the joins give the whole batch's value; `merge_micro_batches` keeps each value's dtype; a non-constant leaf
(transformers' DynamicCache) comes back as None with a warning; ``(logits, loss)`` is refused
naming the order.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from autopar import models
from autopar.capture.graph import OutputTree
from autopar.capture.joint import capture
from autopar.capture.outputs import output_joins
from autopar.errors import CaptureError, InputError
from autopar.execution.rewrite import captured_signature
from passes.loss_reduction import analyze_loss, for_layout
from runtime.executor import join_micro_batches, merge_micro_batches, ratio_shares
from vocab.plan_types import OutputJoin

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
        right = (z.argmax(-1) == labels).float()
        keep = (labels != 0).float()
        masked = (right * keep).sum() / keep.sum()  # accuracy over the labels that are not 0
        if self.kind == "mean_and_ratio":
            return loss, right.mean() + masked
        if self.kind == "max":
            return loss, z.amax()
        if self.kind == "max_rows":  # a max along dim 0: at one row per micro-batch a no-op
            return loss, z.amax(0).sum()
        count = (z > 0).sum().to(torch.int32)
        return {"loss": loss, "logits": z, "count": count, "acc": right.mean(), "correct": right.sum(),
                "norm": self.head.weight.norm(), "twice": loss.detach() * 2, "masked": masked}


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


def _joins(model: nn.Module, micro: tuple, whole: tuple, m: int) -> list[OutputJoin]:
    """`output_joins` as `parallelize` calls it: with the loss's normalisers that the runtime
    feeds step-wide (a cross-entropy's count of labels) and the step at two rows."""
    graph = capture(model, micro)
    signature = captured_signature(graph)
    reduction = for_layout(analyze_loss(graph.gm, signature), tp=1, pp=1)
    fed = frozenset(reduction.denominators) if reduction.mode == "global" else frozenset()

    def two_rows():
        wider = capture(model, tuple(x[:2] for x in whole))
        return wider, captured_signature(wider)

    return output_joins(model, graph, signature, micro, whole, None, m, two_rows, fed)


def _check(model: nn.Module, rows: int, m: int, vocab: int = V) -> list[str]:
    whole = _batch(rows, vocab=vocab)
    return _joins(model, tuple(x[: rows // m] for x in whole), whole, m)


def test_per_sample_outputs_and_scalars_join():
    # logits, count (an int sum), acc (a mean), correct (a float sum), norm (no batch in it),
    # twice the loss (over the cross-entropy's count, which the runtime feeds step-wide: a
    # mean), masked (a ratio over its own count)
    joins = _check(Stats("dict"), rows=4, m=2)
    assert [j.how for j in joins] == ["cat", "sum", "mean", "sum", "mean", "mean", "ratio"]
    assert joins[-1].counter is not None
    # only the copy of the loss reads its normaliser: the step's value once averaged over dp
    assert [j.step_wide for j in joins] == [False] * 5 + [True, False]
    assert [j.how for j in _check(ZooWithLogits(stat=False), rows=4, m=2, vocab=128)] == ["cat", "mean"]


def test_the_joins_give_the_whole_batch_values():
    """Each micro-batch's outputs joined as `output_joins` says equal the whole batch's (the
    masked accuracy's micro-batches keep 0-6 labels of 12: their plain mean is not the batch's)."""
    model, rows, m = Stats("dict"), 8, 4
    ids, labels = _batch(rows)
    labels[:2] = 0  # the first micro-batch keeps no label: 0 / 0 there, weighted by 0
    labels[2:4, :3] = 0
    whole = (ids, labels)
    micro = [tuple(x[k * rows // m:(k + 1) * rows // m] for x in whole) for k in range(m)]
    joins = _joins(model, micro[0], whole, m)
    names = ["logits", "count", "acc", "correct", "norm", "twice", "masked"]
    with torch.no_grad():
        parts = [[model(*x)[n] for n in names] for x in micro]
        expected = model(*whole)
    assert torch.isnan(parts[0][-1])
    mean_of_parts = torch.stack([p[-1] for p in parts[1:]]).mean()
    assert not torch.isclose(mean_of_parts, expected["masked"])
    shares = ratio_shares(joins, whole, {}, m)
    for name, joined in zip(names, merge_micro_batches(parts, joins, shares)):
        assert joined.dtype == expected[name].dtype
        torch.testing.assert_close(joined, expected[name], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("make, rows, what", [
    (lambda: Stats("feature_stat"), 4, "output[1], of shape [8]"),
    # hidden 2 == the micro-batch's rows: the shape alone would pass, the whole batch's does not
    (lambda: Stats("feature_stat", hidden=2), 4, "output[1], of shape [2]"),
    (lambda: Stats("flag"), 4, "output[1], a 0-dim bool"),
    (lambda: ZooWithLogits(stat=True), 4, "output[2], of shape [6]"),
    (lambda: Stats("mean_and_ratio"), 4, "output[1], a 0-dim value not proven a mean, a sum or "
                                         "a ratio of sums over the batch: a mean beside a ratio"),
    (lambda: Stats("max"), 4, "output[1], a 0-dim value not proven a mean, a sum or a ratio"),
    # one row per micro-batch: the step at two rows shows the max mixes the samples
    (lambda: Stats("max_rows"), 2, "output[1], a 0-dim value not proven a mean, a sum or a ratio"),
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
    count, mean, rows = merge_micro_batches(parts, [OutputJoin(h) for h in ("sum", "mean", "cat")])
    assert count.dtype == torch.int32 and int(count) == 7
    assert mean.dtype == torch.bfloat16 and float(mean) == 2.0
    assert rows.tolist() == [[1.0, 1.0], [0.0, 0.0]]
    total, alike = merge_micro_batches([[torch.tensor(1.5), torch.tensor(3)], [torch.tensor(2.0), torch.tensor(3)]],
                                       [OutputJoin("sum"), OutputJoin("mean")])
    assert float(total) == 3.5 and alike.dtype == torch.int64 and int(alike) == 3
    # 1/2 over 2 kept, 3/4 over 4: 4 of 6
    ratio = join_micro_batches([torch.tensor(0.5, dtype=torch.bfloat16), torch.tensor(0.75, dtype=torch.bfloat16)],
                               "ratio", torch.tensor([2.0, 4.0], dtype=torch.float64))
    assert ratio.dtype == torch.bfloat16 and float(ratio) == pytest.approx(4 / 6, rel=1e-2)
    with pytest.raises(ValueError, match="bool"):
        merge_micro_batches([[torch.tensor(True)], [torch.tensor(False)]], [OutputJoin("sum")])


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
