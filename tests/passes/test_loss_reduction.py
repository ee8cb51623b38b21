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
from passes.loss_reduction import DENOMINATOR, analyze_loss, for_layout, rewrite_denominators
from runtime import executor
from runtime.executor import seed_weights
from vocab.plan_types import GraphSignature

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


def split_step(model: nn.Module, inputs: tuple, pieces: int, rows_proven: bool = False):
    """The step as ``pieces`` pieces of the batch weighted and fed as the runtime does:
    (loss, grads, the mode `analyze_loss` found); it runs the reduction `for_layout` settles."""
    micro = tuple(x.chunk(pieces)[0] for x in inputs)
    graph = capture(model, micro)
    sig = _signature(graph)
    found = analyze_loss(graph.gm, sig, rows_proven)
    assert found.mode != "unproven", found.why
    red = for_layout(found, tp=2, pp=2)
    gm = graph.gm
    if red.mode == "global":
        sig = rewrite_denominators(gm, sig, red)
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    chunks = [tuple(x.chunk(pieces)[k] for x in inputs) for k in range(pieces)]
    counts = [red.counter(c, buffers) for c in chunks] if red.counter else None
    total = sum(counts) if counts else None
    seeds = seed_weights(red, dp=1, m=pieces)
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
    return loss, grads, found.mode


def test_the_runtime_feeds_the_kind_the_pass_adds():
    assert executor.DENOMINATOR == DENOMINATOR


def _eager(model, inputs):
    model.zero_grad()
    loss = model(*inputs)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _check(model, inputs, pieces, rows_proven: bool = False):
    loss, grads, mode = split_step(model, inputs, pieces, rows_proven)
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


def _refusal(loss, b: int = 8, s: int = 5) -> str:
    LOSSES["_probe"] = loss
    graph = capture(Net("_probe"), _batch(1, b=b, s=s))
    red = analyze_loss(graph.gm, _signature(graph))
    assert red.mode == "unproven" and red.node is not None
    return red.why


def _kl_flat(z, y, m):
    return F.kl_div(z.flatten(0, 1).log_softmax(-1), (z.detach() * 0.5).flatten(0, 1).softmax(-1),
                    reduction="batchmean")


HAND_MEANS = {  # means over rows, tokens or elements written without a mean op
    "soft_labels": lambda z, y, m: F.cross_entropy(
        z.flatten(0, 1), F.one_hot(y.clamp(min=0).flatten(), V).float() * 0.9 + 0.1 / V),
    "kl_batchmean_tokens": _kl_flat,
    "sum_sum_numel": lambda z, y, m: z.square().sum(-1).sum() / z.numel(),
    "rows_flat": lambda z, y, m: z.flatten(0, 1).square().sum(-1).sum() / z.flatten(0, 1).shape[0],
    "tensor_rows": lambda z, y, m: z.square().sum() / torch.tensor(float(z.shape[0])),
    "scaled_sum": lambda z, y, m: z.square().sum() / 3,
}


@pytest.mark.parametrize("loss", sorted(HAND_MEANS))
def test_hand_written_means_over_flattened_rows_average_the_pieces(loss):
    """A sum divided (or multiplied) by a number proportional to the piece's rows averages the
    pieces, whatever sums came before it; a constant that is no multiple of the rows scales a sum."""
    LOSSES[loss] = HAND_MEANS[loss]
    torch.manual_seed(0)
    assert _check(Net(loss), _batch(1), pieces=2) == ("sum" if loss == "scaled_sum" else "mean")


def test_divisors_that_could_be_a_mean_or_a_constant_are_refused():
    # batch == seq: dividing by z.shape[1] is a constant, not a mean over the rows
    why = _refusal(lambda z, y, m: z.square().sum() / z.shape[1], b=5, s=5)
    assert "cannot tell" in why and "mean_per_rank" in why
    # one row per piece: dividing by 1 (or by the tokens of one row) is no proof of a mean
    assert "cannot tell" in _refusal(lambda z, y, m: z.square().sum() / z.shape[0], b=1)
    assert "cannot tell" in _refusal(lambda z, y, m: z.square().sum() / (z.shape[0] * z.shape[1]), b=1)
    # a multiple of the rows that counts no elements of the sum: refused, not guessed
    assert "multiple" in _refusal(lambda z, y, m: z.square().sum() / (2 * z.shape[0]), b=8, s=5)


def test_a_data_tensor_divisor_of_unknown_value_is_refused():
    why = _refusal(lambda z, y, m: z.square().sum() / m.class_w.sum())
    assert "cannot read" in why


@pytest.mark.parametrize("loss", ["softmax_rows", "amax_rows"])
def test_one_row_per_piece_still_refuses_ops_along_the_rows(loss):
    LOSSES["softmax_rows"] = lambda z, y, m: (z.softmax(0) * z).sum()
    LOSSES["amax_rows"] = lambda z, y, m: (z - z.amax(0, keepdim=True)).square().mean()
    graph = capture(Net(loss), _batch(1, b=1))
    red = analyze_loss(graph.gm, _signature(graph))
    assert red.mode == "unproven" and "dim 0" in red.why


@pytest.mark.parametrize("loss", ["ce", "masked", "two", "ce_2d"])
def test_a_piece_without_valid_labels_splits_exactly(loss):
    """All labels of the second half are padding: its own token mean is 0/0, the step's is not
    (a "ratio" runs as "global" under every layout)."""
    LOSSES["ce_2d"] = lambda z, y, m: F.cross_entropy(z.transpose(1, 2), y)
    torch.manual_seed(0)
    ids, labels = _batch(4)
    labels[4:] = -100
    assert _check(Net(loss), (ids, labels), pieces=2) == ("global" if loss == "two" else "ratio")


def test_zoo_llama_with_an_all_padding_micro_batch_splits_exactly():
    torch.manual_seed(0)
    model = models.build("tiny-llama")
    ids, labels = models.example_inputs("tiny-llama", batch=4, seq=8)
    labels[2:] = -100
    assert _check(model, (ids, labels), pieces=2) == "ratio"


def test_seed_weights_refuse_a_ratio_that_did_not_go_through_for_layout():
    class Ratio:
        mode = "ratio"

    with pytest.raises(ValueError, match="for_layout"):
        seed_weights(Ratio(), dp=2, m=2)
    assert seed_weights(None, dp=2, m=4) == [0.25] * 4


def test_a_step_without_any_valid_label_is_nan_as_on_one_device():
    torch.manual_seed(0)
    ids, labels = _batch(4)
    labels[:] = -100
    loss, _, mode = split_step(Net("masked"), (ids, labels), pieces=2)
    assert mode == "ratio" and torch.isnan(loss) and torch.isnan(Net("masked")(ids, labels))


def _ce_per_token_bct(z, y, m):
    nll = F.cross_entropy(z.transpose(1, 2), y, reduction="none")
    keep = y != -100
    return torch.where(keep, nll, 0).sum() / keep.sum()


def test_cross_entropy_with_classes_on_dim_1_splits_exactly():
    """(B, C, T) logits lower to nll_loss2d: per token, class dim 1, batch dim 0."""
    LOSSES["ce_bct"] = _ce_per_token_bct
    LOSSES["ce_bct_mean"] = lambda z, y, m: F.cross_entropy(z.transpose(1, 2), y, label_smoothing=0.1)
    torch.manual_seed(0)
    assert _check(Net("ce_bct"), _batch(5), pieces=2) == "ratio"
    assert _check(Net("ce_bct_mean"), _batch(5), pieces=2) == "global"


def test_a_product_of_batch_means_says_what_to_do():
    def aux(z, y, m):  # a load-balancing loss: fraction routed x mean router probability
        p = z.flatten(0, 1).softmax(-1)
        f = F.one_hot(p.argmax(-1), V).float().mean(0)
        return F.cross_entropy(z.flatten(0, 1), y.flatten()) + 0.01 * V * (f * p.mean(0)).sum()

    why = _refusal(aux)
    assert "product of batch means" in why and "mean_per_rank" in why


class _Attention(nn.Module):
    """Hand-written attention: a fused qkv permuted heads-first and unbound along dim 0."""

    def __init__(self, d: int = 8, heads: int = 2) -> None:
        super().__init__()
        self.heads, self.emb, self.qkv, self.out = heads, nn.Embedding(V, d), nn.Linear(d, 3 * d), nn.Linear(d, V)

    def forward(self, ids, labels):
        x = self.emb(ids)
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4).unbind(0)
        a = ((q @ k.transpose(-2, -1)) / (d // self.heads) ** 0.5).softmax(-1)
        x = (a @ v).transpose(1, 2).reshape(b, t, d)
        return F.cross_entropy(self.out(x).flatten(0, 1), labels.flatten())


def test_one_row_per_piece_lets_views_along_dim_0_through():
    """At one row the checks along dim 0 refuse what combines values, not a permute or unbind."""
    torch.manual_seed(0)
    ids, labels = _batch(6, b=4)
    assert _check(_Attention(), (ids, labels.clamp(min=0)), pieces=4) == "ratio"


def test_a_coefficient_on_a_sum_is_a_constant_scale_or_refused_as_ambiguous():
    """At two rows per piece (70 elements summed): 0.125 * S, 1/0.125 = 8 counting no elements,
    is a coefficient; 0.1 * S (10 divides 70) and S * (1 / rows) could be means: refused."""
    LOSSES["coefficient"] = lambda z, y, m: 0.125 * z.square().sum()
    torch.manual_seed(0)
    assert _check(Net("coefficient"), _batch(1), pieces=4) == "sum"
    for loss in (lambda z, y, m: 0.1 * z.square().sum(), lambda z, y, m: z.square().sum() * (1.0 / z.shape[0])):
        assert "cannot tell" in _refusal(loss, b=2)


class _BatchMeanBias(torch.nn.Module):
    """baddbmm adding the batch's mean to every sample's product: the samples meet (refused)."""

    def __init__(self, experts: int = 3, d: int = 4) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(experts, d, d))

    def forward(self, x):  # x [B, d]
        h = x.unsqueeze(0).expand(self.w.shape[0], *x.shape)  # per sample on dim 1
        out = torch.baddbmm(x.mean(0).view(1, 1, -1), h, self.w)
        return out.pow(2).mean()


def test_a_batch_statistic_added_to_a_per_sample_product_is_refused():
    graph = capture(_BatchMeanBias(), (torch.randn(6, 4),))
    red = analyze_loss(graph.gm, _signature(graph))
    assert red.mode == "unproven" and "baddbmm" in red.why, red.why


def test_one_row_per_piece_of_a_transformers_moe_is_proven_at_two_rows():
    """transformers' MoE counts its experts' tokens with a cumsum along dim 0: at one row per
    piece that is unproven (the dims are not told apart), at two rows it is proven, and with
    that proof the one-row pieces split exactly (masked labels: a token ratio). Ops that do
    mix the rows stay unproven at two rows, so the proof at two rows cannot excuse them."""
    import hf_tiny

    from passes.loss_reduction import ONE_ROW

    model = hf_tiny.build("mixtral", layers=1)
    ids, labels = hf_tiny.batch(size=2, seq=8)
    labels[1, 3:] = -100
    one = capture(model, (ids[:1], labels[:1]))
    assert ONE_ROW in analyze_loss(one.gm, _signature(one)).why
    two = capture(model, (ids, labels))
    assert analyze_loss(two.gm, _signature(two)).mode == "ratio"
    assert _check(model, (ids, labels), pieces=2, rows_proven=True) == "ratio"
    for loss in ("softmax_rows", "amax_rows"):  # defined by the test above
        LOSSES.setdefault("softmax_rows", lambda z, y, m: (z.softmax(0) * z).sum())
        LOSSES.setdefault("amax_rows", lambda z, y, m: (z - z.amax(0, keepdim=True)).square().mean())
        graph = capture(Net(loss), _batch(1, b=2))
        assert analyze_loss(graph.gm, _signature(graph)).mode == "unproven"
