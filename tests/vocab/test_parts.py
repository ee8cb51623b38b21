"""The passes' typed parts of a plan (`vocab.plan_types.Fp8Part`, `RecomputePart`,
`PipelinePart`), as `PlanDecisions` hands them out; they survive the plan's JSON round trip."""

from vocab.layout import Layout
from vocab.plan_types import (
    AxisPlacement,
    Fp8Part,
    ParamPlan,
    PipelinePart,
    PlanDecisions,
    RecomputeChoice,
    RecomputePart,
)


def _param(sharded: bool) -> ParamPlan:
    dp = AxisPlacement.shard(0) if sharded else AxisPlacement.replicate()
    return ParamPlan(shape=(8, 4), placements={"dp": dp}, zero_sharded=sharded)


def _decisions(**layout) -> PlanDecisions:
    lay = Layout(**layout)
    selective = RecomputeChoice("selective", ("layers.*.mlp.up_proj.weight",))
    return PlanDecisions(
        layout=lay,
        params={"embed.weight": _param(True), "layers.0.w": _param(False), "layers.1.w": _param(True)},
        stages=[(0, 1), (2, 2), (3, 4), (5, 5)],  # four chunks: interleaved over pp=2
        recompute_choice=RecomputeChoice("none"),
        recompute_per_stage=(RecomputeChoice("none"), selective) if lay.pp == 2 else (),
        fp8=["layers.0.w", "layers.1.w"],
    )


def test_parts_of_an_interleaved_pipeline():
    d = _decisions(dp=2, pp=2, zero=1, schedule="interleaved-1f1b", virtual_stages=2,
                   fp8="auto", fp8_recipe="rowwise")
    assert d.fp8_part() == Fp8Part(("layers.0.w", "layers.1.w"), "rowwise")
    part = d.recompute_part()
    assert isinstance(part, RecomputePart)
    assert part.choices == d.stage_choices() == (RecomputeChoice("none"), d.recompute_per_stage[1])
    # chunk c runs on rank c mod pp: blocks 0-1 and 3-4 on rank 0, 2 and 5 on rank 1
    assert part.block_rank == {0: 0, 1: 0, 2: 1, 3: 0, 4: 0, 5: 1}
    assert part.regather is True
    pipe = d.pipeline_part()
    assert isinstance(pipe, PipelinePart)
    assert pipe.stages == ((0, 1), (2, 2), (3, 4), (5, 5))
    assert pipe.zero_sharded == ("embed.weight", "layers.1.w")
    assert pipe.layout is d.layout


def test_one_choice_without_a_pipeline_and_after_json():
    d = _decisions(dp=2, tp=2, sp=True, zero=0, recompute="auto", regather=False)
    again = PlanDecisions.from_dict(d.to_dict())
    for plan in (d, again):
        assert plan.stage_choices() == (RecomputeChoice("none"),)
        assert plan.recompute_part().regather is False
        assert plan.fp8_part().weights == ("layers.0.w", "layers.1.w")
        assert plan.pipeline_part().zero_sharded == ("embed.weight", "layers.1.w")
