"""`passes.loss_reduction`: which losses split exactly over the batch, which are refused, and
that the pieces' rewritten graphs add up to the one-device loss and gradients (one process:
the P pieces run one after another, as the runtime would weight and feed them)."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from autopar import models
from autopar.capture.joint import capture
from cost.plan_types import GraphSignature
from passes.loss_reduction import DENOMINATOR, analyze_loss, rewrite_denominators
from runtime import executor
from runtime.executor import seed_weights

V = 7


class Net(nn.Module):
    """A small model of our own: tokens -> embedding -> MLP -> logits, with named losses."""

    def __init__(self, loss: str) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, 8)
        self.proj = nn.Linear(8, V)
        self.loss = loss
        self.register_buffer("class_w", torch.linspace(0.5, 2.0, V))

    def forward(self, ids, labels):
        z = self.proj(torch.tanh(self.emb(ids)))
        return LOSSES[self.loss](z, labels, self)


def _masked(z, y, m):
    nll = F.cross_entropy(z.flatten(0, 1), y.flatten(), reduction="none")
    keep = y.flatten() != -100
    return torch.where(keep, nll, 0).sum() / keep.sum()


def _two(z, y, m):  # two normalisers: tokens, and rows with any token
    tok = _masked(z, y, m)
    rows = (y != -100).any(dim=1)
    per_row = (z.logsumexp(-1) * (y != -100)).sum(1)
    return tok + 0.5 * torch.where(rows, per_row, 0).sum() / rows.sum()


LOSSES = {
    "ce": lambda z, y, m: F.cross_entropy(z.flatten(0, 1), y.flatten()),
    "masked": _masked,
    "weighted": lambda z, y, m: F.cross_entropy(z.flatten(0, 1), y.flatten(), weight=m.class_w),
    "smooth": lambda z, y, m: F.cross_entropy(z.flatten(0, 1), y.flatten(), label_smoothing=0.1),
    "two": _two,
    "ce_plus_mean": lambda z, y, m: F.cross_entropy(z.flatten(0, 1), y.flatten()) + 0.1 * z.square().mean(),
    "ce_plus_decay": lambda z, y, m: F.cross_entropy(z.flatten(0, 1), y.flatten()) + 1e-2 * m.proj.weight.square().sum(),
    "sum": lambda z, y, m: F.cross_entropy(z.flatten(0, 1), y.flatten(), reduction="sum"),
    "sum_by_param": lambda z, y, m: z.square().sum() / m.proj.weight.abs().sum(),
    "mean": lambda z, y, m: z.square().mean(),
    "mse": lambda z, y, m: F.mse_loss(z, torch.ones_like(z)) + F.l1_loss(z, z.detach() * 0.5),
    "hand_mean": lambda z, y, m: z.logsumexp(-1).sum() / z.shape[0] + z.square().sum() / z.numel(),
    "bce_sum": lambda z, y, m: F.binary_cross_entropy_with_logits(z, (y.unsqueeze(-1) > 2).float().expand_as(z),
                                                                  reduction="sum"),
    # refused: not linear in the batch
    "squared": lambda z, y, m: F.cross_entropy(z.flatten(0, 1), y.flatten()) ** 2,
    "log_mean": lambda z, y, m: torch.log(z.square().mean()),
    "max": lambda z, y, m: F.cross_entropy(z.flatten(0, 1), y.flatten(), reduction="none").max(),
    "median": lambda z, y, m: F.cross_entropy(z.flatten(0, 1), y.flatten(), reduction="none").median(),
    "sum_plus_mean": lambda z, y, m: F.cross_entropy(z.flatten(0, 1), y.flatten(), reduction="sum") + z.mean(),
    "ratio_plus_scaled_sum": lambda z, y, m: _masked(z, y, m) + z.square().sum() / 10,
    "batch_gram": lambda z, y, m: (z.sum(0).square()).sum(),
    "by_model_sum": lambda z, y, m: z.square().sum() / z.abs().sum(),
}
MODES = {"ce": "ratio", "masked": "ratio", "weighted": "ratio", "smooth": "global", "two": "global",
         "ce_plus_mean": "global", "ce_plus_decay": "ratio", "sum": "sum", "sum_by_param": "sum", "mean": "mean",
         "mse": "mean", "hand_mean": "mean", "bce_sum": "sum"}
REFUSED = ["ratio_plus_scaled_sum", "squared", "log_mean", "max", "median", "sum_plus_mean", "batch_gram", "by_model_sum"]


def _signature(graph) -> GraphSignature:
    holders = [n.name for n in graph.gm.graph.nodes if n.op == "placeholder"]
    kinds = {i.node: (i.kind, i.name) for i in graph.inputs}
    return GraphSignature(inputs=[kinds[h] for h in holders], placeholders=holders,
                          grad_index={o.name: o.index for o in graph.outputs if o.kind == "grad"},
                          loss_index=next(o.index for o in graph.outputs if o.kind == "loss"))


def _batch(seed: int, b: int = 8, s: int = 5):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (b, s), generator=g)
    labels = torch.randint(0, V, (b, s), generator=g)
    for row in range(b):  # uneven padding: more in the first half
        pad = int(torch.randint(0, s + 1 if row < b // 2 else 2, (), generator=g))
        labels[row, s - pad:] = -100
    labels[0, :] = labels[0].clamp(min=0)  # at least one token per half
    labels[b - 1, :] = labels[b - 1].clamp(min=0)
    return ids, labels


def split_step(model: nn.Module, inputs: tuple, pieces: int):
    """The step as ``pieces`` pieces of the batch weighted and fed as the runtime does:
    (loss, grads, mode)."""
    micro = tuple(x.chunk(pieces)[0] for x in inputs)
    graph = capture(model, micro)
    sig = _signature(graph)
    red = analyze_loss(graph.gm, sig)
    assert red.mode != "unproven", red.why
    gm = graph.gm
    if red.mode == "global":
        sig = rewrite_denominators(gm, sig, red)
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    chunks = [tuple(x.chunk(pieces)[k] for x in inputs) for k in range(pieces)]
    counts = [red.counter(c, buffers) for c in chunks] if red.counter else None
    total = sum(counts) if counts else None
    seeds = seed_weights(red, counts, total, dp=1, m=pieces)
    loss, grads = 0.0, {}
    for k, chunk in enumerate(chunks):
        args = []
        for kind, name in sig.inputs:
            if kind == "param":
                args.append(params[name].detach())
            elif kind == "buffer":
                args.append(buffers[name])
            elif kind == "input":
                args.append(chunk[int(name[5:])])
            elif kind == "tangent":
                args.append(torch.tensor(seeds[k]))
            elif kind == DENOMINATOR:
                args.append((total[int(name)] / pieces).to(torch.float32))
        out = gm(*args)
        loss = loss + out[sig.loss_index] * seeds[k]
        for name, i in sig.grad_index.items():
            if out[i] is not None:
                grads[name] = grads.get(name, 0) + out[i]
    return loss, grads, red.mode


def test_the_runtime_feeds_the_kind_the_pass_adds():
    assert executor.DENOMINATOR == DENOMINATOR


def _eager(model, inputs):
    model.zero_grad()
    loss = model(*inputs)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _check(model, inputs, pieces):
    loss, grads, mode = split_step(model, inputs, pieces)
    ref_loss, ref_grads = _eager(model, inputs)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    assert grads.keys() == ref_grads.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-5, atol=1e-6)
    return mode


@pytest.mark.parametrize("loss", sorted(MODES))
def test_recognised_losses_split_exactly(loss):
    torch.manual_seed(0)
    assert _check(Net(loss), _batch(1), pieces=2) == MODES[loss]


@pytest.mark.parametrize("loss", REFUSED)
def test_unprovable_losses_are_refused_naming_the_op(loss):
    torch.manual_seed(0)
    graph = capture(Net(loss), _batch(1, b=4))
    red = analyze_loss(graph.gm, _signature(graph))
    assert red.mode == "unproven" and red.node is not None and red.why
    assert red.where().startswith("in the forward of")


def test_zoo_llama_weighted_and_masked_losses_split_exactly():
    torch.manual_seed(0)
    model = models.build("tiny-llama")
    ids, labels = models.example_inputs("tiny-llama", batch=4, seq=8)
    labels[0, 2:] = -100
    labels[1, 5:] = -100
    plain = _check(model, (ids, labels), pieces=2)
    assert plain == "ratio"

    class Smoothed(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = model

        def forward(self, ids, labels):
            logits = self.inner(ids)
            logits = logits if isinstance(logits, torch.Tensor) else logits[0]
            return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), label_smoothing=0.1)

    assert _check(Smoothed(), (ids, labels), pieces=2) == "global"


@settings(derandomize=True, max_examples=5, deadline=None)
@given(coefs=st.lists(st.sampled_from([0.0, 0.5, 1.0, -2.0]), min_size=4, max_size=4),
       pieces=st.sampled_from([2, 4]), seed=st.integers(0, 50))
def test_linear_combinations_of_ratios_split_exactly(coefs, pieces, seed):
    """Any linear combination of a token mean, a class-weighted mean, a smoothed mean and a
    plain mean over the batch is recognised and its pieces add up to one device's step."""
    terms = ["masked", "weighted", "smooth", "mean"]

    class Mix(Net):
        def forward(self, ids, labels):
            z = self.proj(torch.tanh(self.emb(ids)))
            return sum(c * LOSSES[name](z, labels, self) for c, name in zip(coefs, terms) if c)

    torch.manual_seed(seed)
    if not any(coefs):
        coefs = [1.0, 0.0, 0.0, 0.0]
    _check(Mix("ce"), _batch(seed), pieces)


@pytest.mark.parametrize("loss", ["masked", "smooth", "mse", "sum", "two"])
def test_one_row_per_piece_splits_exactly(loss):
    """A piece of one row: sizes cannot tell its dims apart, the split is exact all the same."""
    torch.manual_seed(0)
    assert _check(Net(loss), _batch(2), pieces=8) == MODES[loss]


@pytest.mark.parametrize("loss", ["squared", "max", "log_mean", "ratio_plus_scaled_sum"])
def test_one_row_per_piece_still_refuses(loss):
    graph = capture(Net(loss), _batch(1, b=1))
    assert analyze_loss(graph.gm, _signature(graph)).mode == "unproven"
