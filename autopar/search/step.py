"""The captured and analysed training step that planning prices, memoised per model and shape.

`captured_step` captures a model's step once per `step_key` (class, module attributes, mode,
dtypes, inputs, loss); `CapturedStep.facts` gives its cost facts under a TP recipe and
`facts_for` the facts a given layout is priced with, the same for every caller (the solver, the
manual grid, `--layout`, `parallelize`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.fx._lazy_graph_module import _use_lazy_graph_module

from autopar.analysis.graph import GraphAnalysis, analyze
from autopar.capture.fingerprint import StepCache, model_fingerprint, step_key
from autopar.capture.joint import TrainingGraph, capture
from autopar.search.facts import GraphParts, build_step_facts, graph_parts
from autopar.strategies.tp_ilp import ILPResult, solve_tp_roles
from autopar.strategies.tp_recipe import TPRecipe, find_tp_recipe
from cost import Cluster, Layout
from cost.step import StepFacts

_STEPS = StepCache(size=4)


@dataclass
class CapturedStep:
    """A captured and analysed training step, and its cost facts per TP recipe (memoised)."""

    graph: TrainingGraph
    analysis: GraphAnalysis
    config: object = None
    fused: bool = True
    _facts: dict = field(default_factory=dict, repr=False)
    _ilp: dict = field(default_factory=dict, repr=False)
    _recipe: TPRecipe | None = field(default=None, repr=False)
    _parts: GraphParts | None = field(default=None, repr=False)
    _admits: dict = field(default_factory=dict, repr=False)  # `find_tp_recipe`'s, per node
    _ilp_shared: dict = field(default_factory=dict, repr=False)  # `solve_tp_roles`' ``shared``

    def facts(self, roles: dict[str, str] | None = None) -> StepFacts:
        """Cost facts with Megatron's TP roles, or with ``roles`` where given."""
        key = tuple(sorted((roles or {}).items()))
        if key not in self._facts:
            if self._parts is None:  # what every recipe's facts share
                self._parts = graph_parts(self.graph, self.analysis, self.fused)
            recipe = find_tp_recipe(self.graph, self.analysis, roles, self._admits) if roles \
                else self.recipe
            self._facts[key] = build_step_facts(self.graph, self.analysis, self.config,
                                                fused=self.fused, roles=roles, parts=self._parts,
                                                recipe=recipe)
        return self._facts[key]

    @property
    def recipe(self) -> TPRecipe:
        """Megatron's TP recipe of this step (the ILP's starting point)."""
        if self._recipe is None:
            self._recipe = find_tp_recipe(self.graph, self.analysis, admits=self._admits)
        return self._recipe

    def ilp(self, cluster: Cluster, tp: int) -> ILPResult:
        """The TP ILP's weight roles at degree ``tp`` on ``cluster`` (memoised)."""
        key = (cluster.describe(), tp)
        if key not in self._ilp:
            head_dim = getattr(self.config, "head_dim", None)
            self._ilp[key] = solve_tp_roles(self.graph, self.analysis, cluster, tp, sp=True,
                                            head_dim=head_dim, base=self.recipe, fused=self.fused,
                                            shared=self._ilp_shared)
        return self._ilp[key]

    def tp_variants(self, cluster: Cluster, tp: int) -> list[tuple[str, StepFacts]]:
        """The TP recipes worth pricing at degree ``tp``: the ILP's choice and, where its
        heads and dimensions divide, Megatron's (when the two differ)."""
        ilp = self.ilp(cluster, tp)
        base = self.facts()
        variants = []
        megatron_ok = megatron_divides(base, self.graph, tp, self.config)
        if megatron_ok:
            variants.append(("megatron", base))
        if not megatron_ok or any(base.tp_roles.get(p) != r for p, r in ilp.roles.items()):
            variants.append(("ilp", self.facts(ilp.roles)))
        return variants

    def facts_for(self, cluster: Cluster, layout: Layout) -> StepFacts:
        """The facts ``layout`` is priced with: Megatron's recipe where it divides, else the ILP's.

        One rule for every caller, so that a layout has one price whether the solver, the
        manual grid or `--layout` asks for it.
        """
        base = self.facts()
        if layout.tp == 1 or megatron_divides(base, self.graph, layout.tp, self.config):
            return base
        return dict(self.tp_variants(cluster, layout.tp))["ilp"]

    def ilp_stats(self) -> list[dict]:
        """Size and time of every TP ILP solved so far."""
        return [{"tp": k[1], "variables": r.variables, "constraints": r.constraints,
                 "solve_s": r.solve_time_s, "status": r.status} for k, r in self._ilp.items()]


def megatron_divides(facts: StepFacts, graph: TrainingGraph, tp: int, config) -> bool:
    """Megatron's roles are valid at ``tp``: sharded dims and (KV) heads divide by it."""
    if config is not None and getattr(config, "n_kv_heads", None):
        if config.n_heads % tp or config.n_kv_heads % tp:
            return False
    for name, dim in facts.param_tp_dim.items():
        if dim is not None and graph.param_shapes[name][dim] % tp:
            return False
    return True


def captured_step(model: nn.Module, example_inputs: Sequence, loss_fn: Callable | None,
                  dtype: torch.dtype | None, fused: bool = True) -> CapturedStep:
    """Capture and analyse the step once per `step_key` (and dtype, fusion); cached."""
    key = step_key(model, example_inputs, loss_fn, dtype, fused)

    def make() -> CapturedStep:
        # planning never runs the graph: its Python code is generated when first read or run
        with _use_lazy_graph_module(True):
            graph = capture(model, example_inputs, loss_fn=loss_fn, dtype=dtype)
        return CapturedStep(graph, analyze(graph), getattr(model, "config", None), fused)

    return _STEPS.get(key, make)


def step_facts(model: nn.Module, example_inputs: Sequence, loss_fn: Callable | None,
               dtype: torch.dtype | None, fused: bool = True) -> tuple[CapturedStep, str]:
    """The cached `CapturedStep` of ``model`` and the model's fingerprint."""
    return captured_step(model, example_inputs, loss_fn, dtype, fused), model_fingerprint(model)
