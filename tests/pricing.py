"""Price a layout as the search does: its open choices (FP8 "auto", pipeline cuts, recompute
"auto") made by `autopar.search.choices.choose`, then `cost.step`'s price of it."""

from autopar.search.choices import choose
from cost.step import predict, predict_memory, stage_memory


def priced(facts, cluster, layout, **kw):
    """`cost.step.predict` of ``layout`` with its choices made."""
    return predict(facts, cluster, choose(facts, cluster, layout), **kw)


def priced_memory(facts, cluster, layout, **kw):
    """`cost.step.predict_memory` of ``layout`` with its choices made."""
    return predict_memory(facts, cluster, choose(facts, cluster, layout), **kw)


def priced_stages(facts, cluster, layout):
    """`cost.step.stage_memory` of ``layout`` with its choices made."""
    return stage_memory(facts, cluster, choose(facts, cluster, layout))
