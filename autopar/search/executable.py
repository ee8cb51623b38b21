"""What `autopar.parallelize` cannot run of a layout on a given model, in words.

`vocab.layout.unsupported_decisions` names what no model runs (it reads the layout alone, so the
CLI refuses before any import); `refusals` adds what this model cannot run under the layout:

- under context parallelism in a pipeline, a weight read on several stages (tied input and
  output embeddings): its stages' gradient terms and CP's partial sums are not composed yet
  (`autopar.execution.rewrite` refuses it at run time with the same words).

The solver skips a layout with refusals when it plans for `parallelize`, and a plan's summary
says them, so that a plan runs as printed or says why not.
"""

from __future__ import annotations

import numpy as np

from autopar.search.choices import choose
from cost import Cluster, Layout
from cost.step import StepFacts
from cost.terms.compute import slot_stages
from vocab.layout import unsupported_decisions


def refusals(facts: StepFacts, cluster: Cluster, layout: Layout) -> list[str]:
    """`unsupported_decisions` of ``layout``, and what ``facts``' model cannot run under it."""
    out = unsupported_decisions(layout)
    if layout.cp > 1 and layout.pp > 1:
        tied = tied_across_stages(facts, cluster, layout)
        if tied:
            out.append(f"context parallelism (cp={layout.cp}) in a pipeline (pp={layout.pp}) with "
                       f"weights read on several stages ({', '.join(tied)}: tied weights; use cp=1 "
                       "or pp=1, or untie them)")
    return out


def tied_across_stages(facts: StepFacts, cluster: Cluster, layout: Layout) -> list[str]:
    """The parameters read in slots of more than one pipeline stage under ``layout``'s cut."""
    stage = slot_stages(facts, cluster, choose(facts, cluster, layout, through="chunks"))
    n = max(facts.n_layers, 0)
    out = []
    for name, layers in facts.params.stages_layer.items():
        slots = {int(np.clip(layer, -1, n)) + 1 for layer in layers}
        if len({int(stage[s]) for s in slots}) > 1:
            out.append(name)
    return sorted(out)
