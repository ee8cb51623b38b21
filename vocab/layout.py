"""A parallel layout: the degrees and recipes a person would write by hand.

`Layout` is plain data shared by the cost model, the solver and the runtime. Degrees multiply to
the world size as ``dp * cp * pp * tp``; expert parallelism (``ep``) reuses the data-parallel
ranks for the experts (as torchtitan and Megatron do), so it must divide ``dp * cp``.

Rank order in the process grid follows the playbook: TP innermost (contiguous ranks on one
node), then CP, then PP, then DP outermost.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

from vocab.choices import Choices

SCHEDULES = ("afab", "1f1b", "interleaved-1f1b", "zero-bubble")
# activation recomputation (passes/recompute.py): none, element-wise values, every value of a
# block but its output, or the cost model's choice per heavy group (cost/terms/recompute.py);
# or a tuple of heavy groups ("layers.*.mlp.up_proj.weight"): selective plus those matmul outputs
RECOMPUTE = ("none", "selective", "full", "auto")
PRECISIONS = ("fp32", "bf16", "fp8")
# which weight matmuls run in FP8: none, the cost model's choice, every candidate (or a tuple of
# weight names / block-tied patterns such as "layers.*.mlp.up.weight")
FP8_CHOICES = ("none", "auto", "all")
# how FP8 matmuls scale and cast (torchao's names; passes/fp8.py RECIPES holds their rules)
FP8_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")


class LayoutError(ValueError):
    """A layout that cannot be run: the message names the problem and the fix."""


@dataclass(frozen=True)
class Layout:
    """Degrees and recipes of one parallel training step.

    dp, tp, pp, cp, ep: data, tensor, pipeline, context and expert parallel degrees.
    zero: ZeRO stage 0-3 over the data-parallel ranks (optimizer state, +grads, +weights).
    sp: sequence parallelism inside the TP group (norms and residuals sharded on sequence).
    microbatch: sequences per micro-batch on one data-parallel rank.
    grad_accum: micro-batches per step on one data-parallel rank (pipeline micro-batches too).
        Either may be omitted (None) and is derived from the batch by `resolve`: grad_accum 1
        when neither is given, microbatch = batch / dp / grad_accum, grad_accum = batch / dp /
        microbatch.
    schedule: pipeline schedule, one of SCHEDULES; virtual_stages: chunks per rank (interleaved).
    recompute: activation recomputation, one of RECOMPUTE: "none", "selective" (element-wise
        values), "full" (every value of a block but its output), "auto" (the fastest choice
        that fits: none, selective, full, or selective plus some matmul outputs, tied across
        blocks, by their bytes against their recompute seconds at the local shape), or a tuple
        of those outputs' groups: selective plus them (``"layers.*.mlp.up_proj.weight"``, named
        by the weight; one block's name stands for its group; `Plan.recompute_groups` lists
        them).
    precision: compute precision, one of PRECISIONS; None: derived by `resolve` (the model's own
        dtype; see `autopar.plan`). "fp8" is shorthand: `resolve` turns it into the model's
        precision with ``fp8="all"`` (when fp8 is "none"): every weight matmul in FP8.
    fp8: the weight matmuls run in FP8 (forward, input and weight gradients; passes/fp8.py):
        "none", "auto" (each matmul, tied across blocks, where the cost model predicts a gain
        at its local shape), "all" (every candidate: matmuls that read a 2-D weight), or a
        tuple of weight names or block-tied patterns (``"layers.*.attn.q_proj.weight"``).
    fp8_recipe: how FP8 matmuls scale and cast, one of FP8_RECIPES (tensorwise: one amax per
        tensor, e5m2 gradients; rowwise: one per row, e4m3; rowwise_with_gw_hp: rowwise with the
        weight gradient in high precision).
    fp32_grad_accum: keep an fp32 gradient buffer (nanotron's default; +4 bytes per parameter).
    reshard: under ZeRO-3, gather each block's weights again for the backward (FSDP's
        reshard_after_forward, the default); False keeps the forward's gathered weights to the
        backward: one all-gather fewer per block and micro-batch, the whole weights held from the
        forward to the backward (ZeRO-1/2 keep them anyway; ignored there).
    regather: under TP+SP, a block whose values the backward recomputes gathers its sequence
        again for the backward's matmuls (Megatron-SP's choice, the default); False keeps the
        forward's gathered full-sequence matmul inputs to the backward instead: one all-gather
        fewer per gathered input and micro-batch, those inputs held whole (tp times their
        sequence shard). Ignored without SP or without recomputation.
    cp_balance: under context parallelism, cut the sequence in 2 cp chunks and give CP rank r
        chunks r and 2cp-1-r, so causal attention costs every rank the same (the default);
        False: rank r holds the r-th contiguous block (the last rank then attends 2cp/(cp+1)
        times the average, which the cost model prices). Ignored at cp 1.
    choices: the decisions this layout leaves open (FP8 "auto", the pipeline cuts, recompute
        "auto" per stage), made by the search (`autopar.search.choices.choose`) for the cost
        model to price; None on a layout as a person writes it. Not part of `to_dict` or
        `short`: a plan carries them as its decisions.
    """

    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    zero: int = 0
    sp: bool = False
    microbatch: int | None = None
    grad_accum: int | None = None
    schedule: str = "1f1b"
    virtual_stages: int = 1
    recompute: str | tuple[str, ...] = "none"
    precision: str | None = None
    fp32_grad_accum: bool = True
    fp8: str | tuple[str, ...] = "none"
    fp8_recipe: str = "tensorwise"
    reshard: bool = True
    regather: bool = True
    cp_balance: bool = True
    choices: Choices | None = None

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "pp", "cp", "ep", "microbatch", "grad_accum", "virtual_stages"):
            value = getattr(self, name)
            if value is None and name in ("microbatch", "grad_accum"):
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise LayoutError(f"Layout.{name}={value!r}: must be a positive integer")
        if self.zero not in (0, 1, 2, 3):
            raise LayoutError(f"Layout.zero={self.zero!r}: ZeRO stage must be 0, 1, 2 or 3")
        if self.schedule not in SCHEDULES:
            raise LayoutError(f"Layout.schedule={self.schedule!r}: choose one of {SCHEDULES}")
        if isinstance(self.recompute, list):  # from JSON
            object.__setattr__(self, "recompute", tuple(self.recompute))
        if isinstance(self.recompute, tuple):
            if not all(isinstance(g, str) for g in self.recompute):
                raise LayoutError(f"Layout.recompute={self.recompute!r}: a tuple of heavy groups (strings)")
        elif self.recompute not in RECOMPUTE:
            raise LayoutError(f"Layout.recompute={self.recompute!r}: choose one of {RECOMPUTE}, or "
                              "a tuple of matmul groups such as 'layers.*.mlp.up_proj.weight'")
        if self.precision is not None and self.precision not in PRECISIONS:
            raise LayoutError(f"Layout.precision={self.precision!r}: choose one of {PRECISIONS}")
        if isinstance(self.fp8, list):  # from JSON
            object.__setattr__(self, "fp8", tuple(self.fp8))
        if isinstance(self.fp8, str) and self.fp8 not in FP8_CHOICES:
            raise LayoutError(f"Layout.fp8={self.fp8!r}: choose one of {FP8_CHOICES}, or a tuple of "
                              "weight names / patterns such as 'layers.*.mlp.up_proj.weight'")
        if isinstance(self.fp8, tuple) and not all(isinstance(p, str) for p in self.fp8):
            raise LayoutError(f"Layout.fp8={self.fp8!r}: a tuple of weight names (strings)")
        if self.fp8_recipe not in FP8_RECIPES:
            raise LayoutError(f"Layout.fp8_recipe={self.fp8_recipe!r}: choose one of {FP8_RECIPES}")
        if (self.dp * self.cp) % self.ep:
            raise LayoutError(
                f"Layout.ep={self.ep} must divide dp*cp={self.dp * self.cp}: expert parallelism "
                "reuses the data-parallel ranks; lower ep or raise dp"
            )
        if self.sp and self.tp == 1:
            # SP without TP is meaningless; normalise rather than fail (a sweep sets sp=True).
            object.__setattr__(self, "sp", False)
        if not isinstance(self.reshard, bool):
            raise LayoutError(f"Layout.reshard={self.reshard!r}: True or False")
        if self.zero < 3 and not self.reshard:
            object.__setattr__(self, "reshard", True)  # only ZeRO-3 drops the gathered weights
        if not isinstance(self.regather, bool):
            raise LayoutError(f"Layout.regather={self.regather!r}: True or False")
        if not self.sp or self.recompute == "none":
            object.__setattr__(self, "regather", True)  # no SP gather is recomputed then
        if not isinstance(self.cp_balance, bool):
            raise LayoutError(f"Layout.cp_balance={self.cp_balance!r}: True or False")
        if self.cp == 1:
            object.__setattr__(self, "cp_balance", True)  # no sequence split to balance
        if self.virtual_stages > 1 and self.schedule != "interleaved-1f1b":
            raise LayoutError(
                f"Layout.virtual_stages={self.virtual_stages} needs schedule='interleaved-1f1b'"
            )
        # fewer micro-batches than stages is allowed: the pipeline never fills and the bubble
        # is large, which the cost model prices (the playbook ran such layouts; some trained)

    @property
    def world_size(self) -> int:
        """Number of ranks the layout occupies: dp * cp * pp * tp."""
        return self.dp * self.cp * self.pp * self.tp

    @property
    def resolved(self) -> bool:
        """Every derived field (microbatch, grad_accum, precision) is set."""
        return None not in (self.microbatch, self.grad_accum, self.precision) and self.precision != "fp8"

    @property
    def uses_fp8(self) -> bool:
        """Some matmuls may run in FP8 (``fp8`` other than "none" or empty, or precision "fp8")."""
        return self.precision == "fp8" or self.fp8 not in ("none", ())

    @property
    def global_batch(self) -> int:
        """Sequences per optimizer step: microbatch * grad_accum * dp."""
        if self.microbatch is None or self.grad_accum is None:
            raise LayoutError(f"layout {self.short()}: microbatch and grad_accum are derived from "
                              "the batch; call resolve(batch) first")
        return self.microbatch * self.grad_accum * self.dp

    def resolve(self, batch: int, precision: str = "bf16") -> Layout:
        """This layout with its omitted fields derived for a global batch of ``batch``
        sequences: grad_accum 1 when neither it nor microbatch is given, the other from
        ``batch = dp * microbatch * grad_accum``; ``precision`` where none is set."""
        mb, ga = self.microbatch, self.grad_accum
        if mb is None or ga is None:
            if batch % self.dp:
                raise LayoutError(f"layout {self.short()}: dp={self.dp} does not divide the batch of "
                                  f"{batch} sequences; use a dp that divides it, or another batch")
            per_rank = batch // self.dp
            if mb is None and ga is None:
                ga = 1
            if mb is None:
                if per_rank % ga:
                    raise LayoutError(f"layout {self.short()}: each of the dp={self.dp} ranks gets "
                                      f"{per_rank} sequences, which do not split into grad_accum={ga} "
                                      "micro-batches; choose a grad_accum that divides it")
                mb = per_rank // ga
            else:
                if per_rank % mb:
                    raise LayoutError(f"layout {self.short()}: each of the dp={self.dp} ranks gets "
                                      f"{per_rank} sequences, not a multiple of microbatch={mb}; "
                                      "choose a microbatch that divides it")
                ga = per_rank // mb
        fp8 = self.fp8
        own = self.precision or precision
        if own == "fp8":  # shorthand: the base precision, every weight matmul in FP8
            own = precision if precision != "fp8" else "bf16"
            fp8 = "all" if fp8 == "none" else fp8
        return dataclasses.replace(self, microbatch=mb, grad_accum=ga, precision=own, fp8=fp8)

    def replace(self, **changes) -> Layout:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    def with_choices(self, choices: Choices | None) -> Layout:
        """A copy carrying ``choices`` (nothing else changes, so nothing is validated again:
        the search attaches choices to every layout it prices)."""
        out = object.__new__(Layout)
        out.__dict__.update(self.__dict__)
        object.__setattr__(out, "choices", choices)
        return out

    def short(self) -> str:
        """Compact one-line description, e.g. ``dp8 tp8 pp2 zero1 sp mb2 ga16 1f1b``."""
        parts = [f"dp{self.dp}"]
        for name in ("tp", "pp", "cp", "ep"):
            if getattr(self, name) > 1:
                parts.append(f"{name}{getattr(self, name)}")
        if not self.cp_balance:
            parts.append("cp-contiguous")
        if self.zero:
            parts.append(f"zero{self.zero}" + ("" if self.reshard else " no-reshard"))
        if self.sp:
            parts.append("sp" + ("" if self.regather else " keep-gathers"))
        if self.microbatch is not None:
            parts.append(f"mb{self.microbatch}")
        if self.grad_accum is not None:
            parts.append(f"ga{self.grad_accum}")
        if self.pp > 1:
            parts.append(self.schedule + (f"x{self.virtual_stages}" if self.virtual_stages > 1 else ""))
        if isinstance(self.recompute, tuple):
            parts.append(f"rc-selective+{len(self.recompute)}" if self.recompute else "rc-selective")
        elif self.recompute != "none":
            parts.append(f"rc-{self.recompute}")
        if self.precision not in ("bf16", None):
            parts.append(self.precision)
        if isinstance(self.fp8, tuple):
            if self.fp8:
                parts.append(f"fp8x{len(self.fp8)}")
        elif self.fp8 != "none":
            parts.append(f"fp8-{self.fp8}")
        if self.uses_fp8 and self.fp8_recipe != "tensorwise":
            parts.append(self.fp8_recipe)
        return " ".join(parts)

    def to_dict(self) -> dict:
        """Plain dict of every field as a person writes it (JSON-safe; ``choices`` left out)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "choices"}

    @classmethod
    def from_dict(cls, data: dict) -> Layout:
        """Inverse of `to_dict`; unknown keys are an error that names them."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise LayoutError(f"unknown Layout fields {sorted(unknown)}; known: {sorted(known)}")
        return cls(**data)

    def to_json(self) -> str:
        """JSON text of `to_dict`."""
        return json.dumps(self.to_dict(), sort_keys=True)


# the pipeline schedules `autopar.parallelize` executes (runtime/pipeline.py)
PIPELINE_SCHEDULES_RUN = ("afab", "1f1b", "interleaved-1f1b", "zero-bubble")


def unsupported_decisions(layout: Layout) -> list[str]:
    """The decisions of ``layout`` that `autopar.parallelize` cannot execute yet, in words.

    Here, beside the layout, rather than with the solver: the CLI refuses such a layout before
    it imports anything heavy, and the solver's search skips them (``executable_only``).
    """
    out = []
    if layout.pp > 1:
        # the pipeline runs torch.distributed.pipelining's GPipe, 1F1B, interleaved 1F1B and
        # zero-bubble (ZB1P) schedules over the plan's cuts
        # (passes/pipeline_split.py, runtime/pipeline.py); DP / ZeRO-1 reduce after the schedule
        if layout.schedule not in PIPELINE_SCHEDULES_RUN:
            out.append(f"the pipeline schedule {layout.schedule!r} (pp={layout.pp}; runs: "
                       f"{', '.join(PIPELINE_SCHEDULES_RUN)})")
        if layout.zero >= 2:
            out.append(f"ZeRO-{layout.zero} inside a pipeline (pp={layout.pp}; runs: ZeRO-0 and 1, "
                       "the gradients reduced once after the schedule)")
    # cp > 1: the sequence split over cp with ring attention (passes/context_parallel.py), with
    # DP, ZeRO 1-3 (sharded over the dp x cp ranks, as the cost model prices it), TP (ring
    # attention on the rank's heads), TP+SP (SP splits the CP rank's sequence over tp:
    # passes/cp_sequence_parallel.py), pipelines (gradients all-reduced over cp in the graph;
    # ZeRO-1's rows over the dp x cp ranks), recompute and FP8 matmuls (the FP8 matmuls run on
    # the rank's tokens, a weight gradient as a partial sum over cp; an amax over tokens is
    # all-reduced (max) over cp, then over dp: global scales, as on one device)
    if layout.ep > 1:
        # the experts over ep consecutive dp ranks (passes/expert_parallel.py: all-to-alls;
        # passes/expert_parallel_stacked.py: all-gather and reduce-scatter), with DP, ZeRO 0-3,
        # TP (inside each expert, with or without SP), pipelines (the ep ranks of one stage
        # exchange tokens inside its forward and backward; the experts' gradients summed over
        # their owners after the schedule) and FP8 (the experts' grouped matmuls in high
        # precision, named in the plan); not yet composed with these
        with_ep = [what for what, on in (
            (f"context parallelism (cp={layout.cp})", layout.cp > 1),) if on]
        if with_ep:
            out.append(f"expert parallelism (ep={layout.ep}) with " + ", ".join(with_ep)
                       + " (ep runs with data parallelism, ZeRO, tensor parallelism, pipelines and FP8 only)")
    # recompute "selective" and "full" run (passes/recompute.py), FP8 matmuls too (passes/fp8.py)
    return out
