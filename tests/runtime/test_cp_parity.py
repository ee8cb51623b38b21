"""Context parallelism against one device: loss, every gradient and the parameters after 2
SGD steps (fp32, rtol 1e-5) on gloo ranks, for the zoo's tiny-llama (causal SDPA, RoPE), a
plain-PyTorch causal model with RoPE under two losses (a token mean over unevenly ignored
labels; that plus a mean square of hidden states) and transformers' Llama and GPT-2 (their
attention masks built from the ids: ring attention slices them per block). Each run checks that attention ran as ring
attention and that nothing gathered the sequence. The plain model also returns (loss, logits)
under a [b, V, s] cross-entropy plus a per-token loss: logits, loss and gradients as one
device's, under strict=True. The solver's own plan for one 8192-token sequence on 2 H100s picks
cp=2 and runs (slow)."""

from __future__ import annotations

import copy

import pytest
from cp_models import RopeLM, cp_parity_failures, rope_batch

from runtime.launch import spawn


def _cases():
    from autopar import models

    yield "tiny-llama", (lambda: models.build("tiny-llama", seed=3)), models.example_inputs("tiny-llama", batch=4, seq=16)
    for loss in ("mean", "mixed"):
        yield f"rope-lm/{loss}", (lambda loss=loss: RopeLM(loss=loss, seed=1)), rope_batch()
    try:
        import hf_tiny
    except Exception:  # transformers not installed (hf_tiny skips itself)
        return
    for family in ("llama", "gpt2"):  # their attention under an explicit (causal, padding) mask
        yield f"hf-{family}", (lambda family=family: hf_tiny.build(family, seed=2)), hf_tiny.batch(size=4, seq=16)


def _cp_worker(rank: int, world: int, layouts: list[dict], only: tuple[str, ...] = ()) -> list[tuple]:
    """Every case (``only``: those named) under every layout, against one device."""
    return cp_parity_failures(world, _cases, layouts, only)


DEFAULT = ("tiny-llama", "rope-lm/mean", "rope-lm/mixed", "hf-llama")


def _classes_and_logits(rank: int, world: int) -> list[tuple]:
    """The plain model's (loss, logits) under cp=2 with strict=True (returning logits is not a
    sequence gather): cross-entropy over [b, V, s] and a per-token loss's masked mean, exact
    over unevenly ignored labels; the logits, the loss and every gradient as one device's."""
    from parity_checks import close

    import autopar

    model, batch = RopeLM(loss="classes", seed=1), rope_batch()
    ref = copy.deepcopy(model)
    pm = autopar.parallelize(model, world, example_inputs=batch, layout=autopar.Layout(cp=2), strict=True)
    (loss, logits), (ref_loss, ref_logits) = pm(*batch), ref(*batch)
    loss.backward()
    ref_loss.backward()
    failures = [("classes", what) for what, a, b in (("loss", loss, ref_loss), ("logits", logits, ref_logits))
                if not close(a.detach(), b.detach())]
    named = dict(ref.named_parameters())
    return failures + [("classes", f"grad {n}") for n, p in pm.named_parameters()
                       if not close(p.grad.full_tensor(), named[n].grad)]


def _cp2_then_accumulated(rank: int, world: int) -> list[tuple]:
    """One spawn: the default cases at cp=2, then the plain model's mean with 2 micro-batches,
    then its (loss, logits) under cross-entropy over classes on dim 1."""
    return (_cp_worker(rank, world, [{"cp": 2}], DEFAULT)
            + _cp_worker(rank, world, [{"cp": 2, "grad_accum": 2}], ("rope-lm/mean",))
            + _classes_and_logits(rank, world))


def test_cp2():
    results = spawn(_cp2_then_accumulated, 2, timeout_s=600)
    assert all(r == [] for r in results), [r for r in results if r]


@pytest.mark.slow
def test_cp2_gpt2():
    results = spawn(_cp_worker, 2, args=([{"cp": 2}], ("hf-gpt2",)), timeout_s=600)
    assert all(r == [] for r in results), [r for r in results if r]


@pytest.mark.slow
def test_cp2_dp2():
    results = spawn(_cp_worker, 4, args=([{"cp": 2, "dp": 2}],), timeout_s=900)
    assert all(r == [] for r in results), [r for r in results if r]


@pytest.mark.slow
def test_cp4():
    results = spawn(_cp_worker, 4, args=([{"cp": 4}],), timeout_s=900)
    assert all(r == [] for r in results), [r for r in results if r]


@pytest.mark.slow
def test_cp2_recompute():
    results = spawn(_cp_worker, 2, args=([{"cp": 2, "recompute": "selective"}, {"cp": 2, "recompute": "full"}],),
                    timeout_s=900)
    assert all(r == [] for r in results), [r for r in results if r]


def _solver_plan(rank: int, world: int) -> list[tuple]:
    """The solver's own plan for a long sequence: tiny-llama, one 8192-token sequence on 2 H100s
    (no batch to split; at this length the ring beats TP's per-layer all-reduces): it picks
    cp=2, and that plan trains like one device."""
    import dataclasses

    from parity_checks import contract, sgd, train_and_compare

    import autopar
    from autopar import models

    cfg = dataclasses.replace(models.config("tiny-llama"), max_seq=8192)
    model, batch = models.build(cfg, seed=3), models.example_inputs(cfg, batch=1, seq=8192)
    ref = copy.deepcopy(model)
    plan = autopar.plan(model, batch, cluster=autopar.Cluster("h100", nodes=1, gpus_per_node=world),
                        precision="fp32", executable_only=True)
    label = ("tiny-llama seq 8192", plan.layout.short())
    if plan.layout.cp != world:
        return [(*label, "the solver did not pick cp")]
    pm = autopar.parallelize(model, world, example_inputs=batch, plan=plan)
    return contract(pm, label) + train_and_compare(pm, ref, batch, label, steps=2, optimizers=(sgd,))


@pytest.mark.slow
def test_solver_picks_cp_for_a_long_sequence():
    results = spawn(_solver_plan, 2, timeout_s=900)
    assert all(r == [] for r in results), [r for r in results if r]
