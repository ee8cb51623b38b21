"""Checkpoints move between any two plans with every value equal (max difference 0.0).

Parameters and AdamW's moments are saved under one plan and loaded under the next, two ways:
torch.distributed.checkpoint (``pm.state_dict()`` and torch's ``get_optimizer_state_dict``)
and whole tensors (`autopar.execution.state_dict`). The plans chain ZeRO-3, TP with fused
projections (qkv and gate|up run as ``_StridedShard``), TP+SP, a pipeline (each rank holds its
stage's parameters), ZeRO-1 and FP8, on a model of our own and the zoo's GPT-2; a world-size
change (4 -> 2 -> 1 -> 4 ranks, separate launches reading one checkpoint directory) is a
slow test. A model built on the meta device and filled from a checkpoint under TP trains like
the model built whole. The placement arithmetic behind DCP's boxes is checked in-process on
random plan pairs (hypothesis).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from runtime.launch import spawn


class FusedBlock(nn.Module):
    """Pre-norm block with one fused qkv projection and one fused gate|up projection."""

    def __init__(self, hidden: int, heads: int, ffn: int) -> None:
        super().__init__()
        self.heads = heads
        self.attn_norm = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.out = nn.Linear(hidden, hidden, bias=False)
        self.mlp_norm = nn.LayerNorm(hidden)
        self.gate_up = nn.Linear(hidden, 2 * ffn, bias=False)
        self.down = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = (t.view(b, s, self.heads, h // self.heads).transpose(1, 2)
                   for t in self.qkv(self.attn_norm(x)).chunk(3, dim=-1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(y.transpose(1, 2).reshape(b, s, h))
        gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class FusedLM(nn.Module):
    """A small causal LM in plain PyTorch: (ids, labels) -> mean cross-entropy."""

    def __init__(self, vocab: int = 64, hidden: int = 32, heads: int = 4, ffn: int = 48,
                 layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(FusedBlock(hidden, heads, ffn) for _ in range(layers))
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return F.cross_entropy(self.head(self.norm(x)).flatten(0, 1), labels.flatten())


def fused_lm(seed: int = 0, device: str | None = None) -> FusedLM:
    torch.manual_seed(seed)
    with torch.device(device or "cpu"):
        return FusedLM()


def fused_batch(size: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, 64, (size, 16), generator=torch.Generator().manual_seed(1))
    return ids, ids.roll(-1, dims=1)


# ---------------------------------------------------------------- in-process: the arithmetic


def _plans(shape: tuple[int, int]):
    """A (dp, tp) plan for a weight of ``shape``: degrees, and the plan's placements the way
    `autopar.search.decisions` draws them (TP: a dim, fused parts; ZeRO: rows of the TP shard)."""
    from vocab.plan_types import AxisPlacement

    @st.composite
    def draw(d):
        dp, tp = d(st.sampled_from([1, 2, 4])), d(st.sampled_from([1, 2, 4]))
        tp_place = AxisPlacement.replicate()
        if tp > 1:
            dim = d(st.sampled_from([0, 1]))
            parts = d(st.sampled_from([k for k in (1, 2, 3) if shape[dim] % (k * tp) == 0] or [1]))
            if shape[dim] % (parts * tp) == 0:
                tp_place = AxisPlacement.shard(dim, parts)
        rows = shape[0] // tp if tp_place.is_shard and tp_place.dim == 0 else shape[0]
        zero = dp > 1 and rows % dp == 0 and tp_place.split_factor == 1 and d(st.booleans())
        dp_place = (AxisPlacement.shard(0, tp) if zero and tp_place.is_shard and tp_place.dim == 0 and tp > 1
                    else AxisPlacement.shard(0) if zero else AxisPlacement.replicate())
        return dp, tp, dp_place, tp_place

    return draw()


@settings(derandomize=True, max_examples=60, deadline=None)
@given(st.tuples(st.sampled_from([12, 24, 48]), st.sampled_from([8, 12])).flatmap(
    lambda shape: st.tuples(st.just(shape), _plans(shape), _plans(shape))))
def test_boxes_move_any_plan_pair_exactly(case):
    """Save under plan A as DCP would (each rank's boxes, `placement.boxes`), load under plan B
    (each rank reads its boxes from what was saved): every rank's shard equals the shard
    `_to_dtensors` places (`placed_shard`), and A's boxes cover the whole tensor."""
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    from autopar.execution.placement import boxes, placed_shard
    from passes.tensor_parallel import to_dtensor_placement

    shape, before, after = case
    full = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape)
    stored = torch.full(shape, float("nan"))
    for (dp, tp, dp_place, tp_place), role in ((before, "save"), (after, "load")):
        placements = [to_dtensor_placement(dp_place), to_dtensor_placement(tp_place)]
        for r in range(dp * tp):
            coord = [r // tp, r % tp]
            local = placed_shard(full, dp_place, tp_place, (dp, tp), tuple(coord))
            pieces = boxes(shape, (dp, tp), coord, placements)
            if pieces is None:  # one box: torch's own offset and size, as DCP keeps them
                size, offset = _compute_local_shape_and_global_offset(shape, (dp, tp), coord, placements)
                pieces = [(offset, size, (0, 0))]
            mine = torch.full(local.shape, float("nan"))
            for g, s, loc in pieces:
                whole = tuple(slice(a, a + n) for a, n in zip(g, s))
                part = tuple(slice(a, a + n) for a, n in zip(loc, s))
                if role == "save":
                    stored[whole] = local[part]
                else:
                    mine[part] = stored[whole]
            if role == "load":
                assert torch.equal(mine, local), (case, r)
    assert torch.equal(stored, full), case


# ---------------------------------------------------------------- multi-process: real moves


def _full(pm, opt) -> tuple[dict, dict]:
    from autopar.execution.state_dict import full_optim_state_dict, full_state_dict

    return full_state_dict(pm), full_optim_state_dict(pm, opt)


def _differences(label, saved: tuple[dict, dict], now: tuple[dict, dict]) -> list[tuple]:
    """Every parameter and optimizer-state value of ``now`` that is not bit-equal to ``saved``."""
    (params, optim), (new_params, new_optim) = saved, now
    out = []
    if set(params) != set(new_params):
        out.append((*label, "parameter names", sorted(set(params) ^ set(new_params))))
    for name in set(params) & set(new_params):
        if not torch.equal(params[name], new_params[name]):
            out.append((*label, name, (params[name] - new_params[name]).abs().max().item()))
    state, new_state = optim["state"], new_optim["state"]
    if set(state) != set(new_state) or not state:
        out.append((*label, "optimizer state names", sorted(set(state) ^ set(new_state))))
    for name in set(state) & set(new_state):
        for key, value in state[name].items():
            other = new_state[name].get(key)
            if not (isinstance(other, torch.Tensor) and torch.equal(value, other)):
                out.append((*label, f"optimizer {name}.{key}"))
    return out


def _step(pm, opt, batch) -> None:
    pm(*batch).backward()
    opt.step()
    opt.zero_grad()


def _save(pm, opt, path: str) -> None:
    """DCP: the parameters (``pm.state_dict()``) and the optimizer (torch's FQN-keyed form)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    dcp.save({"model": pm.state_dict(), "optim": get_optimizer_state_dict(pm, opt)}, checkpoint_id=path)


def _load(pm, opt, path: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    state = {"model": pm.state_dict(), "optim": get_optimizer_state_dict(pm, opt)}
    dcp.load(state, checkpoint_id=path)
    pm.load_state_dict(state["model"])
    set_optimizer_state_dict(pm, opt, state["optim"])


def _wipe(pm) -> None:
    """Every local value NaN: a later load must write each one."""
    with torch.no_grad():
        for p in pm.parameters():
            p._local_tensor.fill_(float("nan"))


def _move(build, batch, world, before_full, layout, path_in, path_out, label) -> tuple[list, tuple, nn.Module]:
    """Parallelise ``build`` under ``layout``, load the checkpoint at ``path_in`` both ways
    (DCP, then whole tensors into wiped shards and a new optimizer), check each against
    ``before_full``, train a step and save to ``path_out``: (failures, the full state saved,
    the parallelised model)."""
    from parity_checks import adamw

    import autopar
    from autopar.execution.state_dict import load_full_optim_state_dict, load_full_state_dict

    pm = autopar.parallelize(build(7), world, example_inputs=batch, layout=layout)
    opt = adamw(pm.parameters())
    failures = []
    if before_full is None:
        _step(pm, opt, batch)
    else:
        _load(pm, opt, path_in)
        failures += _differences((*label, "dcp"), before_full, _full(pm, opt))
        _wipe(pm)
        opt = adamw(pm.parameters())
        load_full_state_dict(pm, before_full[0])
        load_full_optim_state_dict(pm, opt, before_full[1])
        failures += _differences((*label, "whole"), before_full, _full(pm, opt))
        _step(pm, opt, batch)  # the moved state trains on under the new plan
    _save(pm, opt, path_out)
    whole = _full(pm, opt)
    if layout.pp > 1:  # only rank 0 gets the whole dict; the other stages send it theirs
        failures += _rank0_only_check(pm, whole[0], label)
    return failures, whole, pm


def _rank0_only_check(pm, whole: dict, label) -> list:
    import torch.distributed as dist

    from autopar.execution.state_dict import full_state_dict

    to_rank0 = full_state_dict(pm, rank0_only=True)
    if dist.get_rank() != 0:
        return [(*label, "rank0_only: a dict on another rank")] if to_rank0 else []
    if to_rank0.keys() != whole.keys() or not all(torch.equal(to_rank0[k], whole[k]) for k in whole):
        return [(*label, "rank0_only differs")]
    return []


def _chain(build, batch, world: int, layouts, path: str, name: str) -> tuple[list, nn.Module]:
    failures, saved, pm = [], None, None
    for k, layout in enumerate(layouts):
        label = (name, layouts[k - 1].short() if k else "-", layout.short())
        more, saved, pm = _move(build, batch, world, saved, layout, f"{path}/{k - 1}", f"{path}/{k}", label)
        failures += more
    return failures, pm


def _meta_worker_part(world: int, path: str, layout) -> list:
    """A meta-built model filled under ``layout`` from a one-device checkpoint trains like the
    model built whole (loss, gradients and parameters, 2 SGD steps): through DCP where
    ``path`` is a DCP directory, else through `load_full_state_dict` of the one-device
    ``state_dict()`` (which must mark the model loaded)."""
    import torch.distributed.checkpoint as dcp
    from parity_checks import sgd, train_and_compare

    import autopar
    from autopar.execution.state_dict import load_full_state_dict

    batch = fused_batch()
    pm = autopar.parallelize(fused_lm(device="meta"), world, example_inputs=batch, layout=layout)
    if path:
        state = pm.state_dict()
        dcp.load(state, checkpoint_id=path)
        pm.load_state_dict(state)
    else:
        load_full_state_dict(pm, fused_lm(seed=3).state_dict())
    return train_and_compare(pm, fused_lm(seed=3), batch, ("meta", layout.short(), path or "whole"),
                             steps=2, optimizers=(sgd,))


def _error_checks(pm) -> list:
    """A one-device state dict with a key missing, an extra key, another shape or another
    prefix is an InputError naming the key and the fix."""
    import autopar
    from autopar.execution.state_dict import full_state_dict, load_full_state_dict

    whole = full_state_dict(pm)
    first = sorted(whole)[0]
    cases = {"missing": ({k: v for k, v in whole.items() if k != first}, [first, "fix"]),
             "extra": ({**whole, "stray.weight": torch.zeros(2)}, ["stray.weight", "fix"]),
             "shape": ({**whole, first: torch.zeros(3, 5)}, [first, "(3, 5)", "fix"]),
             "prefix": ({"model." + k: v for k, v in whole.items()}, ["model." + first, "prefix"])}
    failures = []
    for case, (sd, words) in cases.items():
        try:
            load_full_state_dict(pm, sd)
            failures.append((case, "accepted"))
        except autopar.InputError as exc:
            if not all(w in str(exc) for w in words):
                failures.append((case, "unhelpful error", str(exc)))
    return failures


def _two_rank_worker(rank: int, world: int, path: str) -> list:
    import autopar

    L = autopar.Layout
    layouts = [L(dp=2, zero=3), L(tp=2), L(pp=2, grad_accum=2), L(dp=2, zero=1, fp8="all"), L(tp=2, sp=True)]
    failures, last = _chain(fused_lm, fused_batch(), world, layouts, f"{path}/fused", "fused-lm")
    failures += _error_checks(last)
    failures += _meta_worker_part(world, "", L(tp=2))
    return failures


def test_checkpoints_move_between_plans(tmp_path):
    """2 ranks, 4 moves of the model of our own (ZeRO-3 -> TP (fused parts) -> pp=2 ->
    ZeRO-1 + FP8 -> TP+SP), parameters and AdamW state, both ways; a meta model filled under
    TP from the one-device state dict; bad state dicts refused with the key named."""
    assert spawn(_two_rank_worker, 2, args=(str(tmp_path),), timeout_s=600) == [[], []]


def _models():
    from autopar import models

    return [("fused-lm", fused_lm, fused_batch(8)),
            ("tiny-gpt2", lambda seed: models.build("tiny-gpt2", seed=seed),
             models.example_inputs("tiny-gpt2", batch=8, seq=16))]


def _world_worker(rank: int, world: int, path: str, start: int, layouts: list[dict], one_device: str) -> list:
    """Moves ``start``, ``start + 1``, ... of the world-size chain on ``world`` ranks: the state
    before comes from the previous launch's files (DCP directory and the whole state)."""
    import torch.distributed as dist

    import autopar

    failures = []
    for name, build, batch in _models():
        saved = torch.load(f"{path}/{name}/full{start - 1}.pt") if start else None
        for j, degrees in enumerate(layouts):
            k, layout = start + j, autopar.Layout(**degrees)
            label = (name, f"{world} ranks", layout.short())
            more, saved, _ = _move(build, batch, world, saved, layout, f"{path}/{name}/{k - 1}",
                                f"{path}/{name}/{k}", label)
            failures += more
        if rank == 0:
            torch.save(saved, f"{path}/{name}/full{start + len(layouts) - 1}.pt")
        dist.barrier()
    if one_device:
        failures += _meta_worker_part(world, one_device, autopar.Layout(dp=2, tp=2))
    return failures


@pytest.mark.slow
def test_checkpoints_move_across_world_sizes(tmp_path):
    """4 ranks (ZeRO-3, then dp2 x tp2 with fused parts: the move that lost the fused weights)
    -> 2 ranks (pp=2) -> 1 rank -> 2 ranks (TP+SP) -> 4 ranks (dp2 x tp2, ZeRO-1), each launch
    reading the last one's checkpoint: the model of our own and the zoo's GPT-2 (fused qkv,
    tied embedding and head), parameters and AdamW state bit-equal after every move; and a
    meta model filled under dp2 x tp2 trains like the model built whole."""
    import torch.distributed.checkpoint as dcp

    dcp.save(fused_lm(seed=3).state_dict(), checkpoint_id=tmp_path / "one", no_dist=True)
    for name in ("fused-lm", "tiny-gpt2"):
        (tmp_path / name).mkdir()
    launches = [(4, [{"dp": 4, "zero": 3}, {"dp": 2, "tp": 2}]), (2, [{"pp": 2, "grad_accum": 2}]),
                (1, [{}]), (2, [{"tp": 2, "sp": True}]), (4, [{"dp": 2, "tp": 2, "zero": 1}])]
    start = 0
    for world, layouts in launches:
        one = str(tmp_path / "one") if start + len(layouts) == 7 else ""
        results = spawn(_world_worker, world, args=(str(tmp_path), start, layouts, one), timeout_s=900)
        assert results == [[]] * world, (world, layouts)
        start += len(layouts)


_FOUR_RANK_PLANS = [{"dp": 4}, {"dp": 4, "zero": 1}, {"dp": 4, "zero": 2}, {"dp": 4, "zero": 3},
                    {"dp": 2, "tp": 2}, {"dp": 2, "tp": 2, "zero": 3}, {"dp": 2, "tp": 2, "sp": True},
                    {"tp": 4}, {"dp": 2, "pp": 2, "grad_accum": 2}, {"tp": 2, "pp": 2, "grad_accum": 2},
                    {"dp": 4, "fp8": "all"}]


def _random_chain_worker(rank: int, world: int, path: str, plans: list[dict]) -> list:
    import autopar

    layouts = [autopar.Layout(**degrees) for degrees in plans]
    return _chain(fused_lm, fused_batch(8), world, layouts, path, "fused-lm")[0]


@pytest.mark.slow
@settings(derandomize=True, max_examples=1, deadline=None)
@given(st.lists(st.sampled_from(range(len(_FOUR_RANK_PLANS))), min_size=7, max_size=7).filter(
    lambda seq: all(a != b for a, b in zip(seq, seq[1:]))))
def test_checkpoints_move_between_random_plan_pairs(seq):
    """Random plan pairs on 4 ranks, drawn up front (one launch): a chain of 7 plans from
    DP, ZeRO-1/2/3, dp x tp (fused parts, with ZeRO-3, with SP), tp=4, pipelines with dp or
    tp, FP8: each of its 6 moves keeps parameters and AdamW state bit-equal."""
    import tempfile

    plans = [_FOUR_RANK_PLANS[i] for i in seq]
    with tempfile.TemporaryDirectory() as path:
        assert spawn(_random_chain_worker, 4, args=(path, plans), timeout_s=1500) == [[]] * 4, plans
