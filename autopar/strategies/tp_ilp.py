"""Tensor-parallel placement of every weight by integer linear programming (OR-tools).

Decision: each weight group (a weight with its block index folded, so the L blocks share one
choice) takes one role on the TP axis of degree t:

    col   Y = X W, W = [W1 .. Wt] sharded on its outputs: input replicated, output sharded (S)
    row   W = [W1; ..; Wt] sharded on its inputs: input sharded, output partial (P)
    rep   W replicated: input replicated, output replicated (R), full compute on every rank
    vocab (embedding tables) rows sharded: output partial

The forward graph between weight matmuls falls into segments (connected element-wise, norm and
attention nodes); a segment is sharded (S) exactly when one of its producing matmuls is
column-parallel, and replicated (R) otherwise. The objective is the step's time on one rank
for the captured batch, priced by the step model itself (`cost.step.predict`'s terms): every
node and its backward at the roofline of `cost.terms.compute.roofline_times`, whole or split t
ways (sharded nodes; R ones too under sequence parallelism), slowed by the framework efficiency;
and the collectives each role and segment state implies, priced by `cost.comm.collective_time`
on the TP group with `cost.terms.tensor_parallel.event_collective` (SP: reduce-scatter and
all-gather; without: all-reduce, and the gathers a replicated use needs): a row layer's
partial output reduced (where Megatron's recipe reduces it) and, under SP, its gradient
gathered; the SP gather of a column layer's replicated input and the reduction of its input
gradient, once per value however many layers share it (q, k, v); a sharded value gathered for
a column or replicated layer; a replicated output's gradient gathered into a sharded segment;
under SP a replicated weight's gradient all-reduced; a vocabulary-parallel table's output
reduced. As in `predict`, the SP gathers hide behind the column matmuls and the input-gradient
reductions behind the sharded layers' weight-gradient matmuls (`comm_overlap`), with the
exposed rest linearised per pool (the tied blocks together; the rest); products of binaries
are linearised as usual. Feasibility: a sharded dimension must divide by t, and heads must not
be split (an attention input's head count divides by t).

Not priced (constant across roles, or small): nodes outside the segments and matmuls (weight
casts), the parallel loss's three small all-reduces, and where other roles move the recipe's
reduction points (the ILP keeps Megatron's).

The Megatron recipe is one feasible point; where heads do not divide (grouped-query K/V with
fewer heads than t) the ILP replicates instead of failing.
"""

from __future__ import annotations

import itertools
import time
from collections import defaultdict
from dataclasses import dataclass

import numpy as np
import torch
from ortools.linear_solver import pywraplp

from autopar.analysis.fusion import external_bytes, fusion_groups
from autopar.analysis.graph import GraphAnalysis, attention_head_dim, attention_keys
from autopar.capture.joint import TrainingGraph
from autopar.strategies.tp_recipe import COL, REPLICATED, ROW, VOCAB, TPRecipe, find_tp_recipe
from cost import Cluster, collective_time
from cost.step_facts import StepFacts
from cost.terms.common import comm_overlap, default_precision
from cost.terms.compute import attention_floor, compute_dtype, roofline_times
from cost.terms.tensor_parallel import event_collective, tp_group
from passes.grouped_matmul import is_grouped_forward
from vocab.plan_types import block_pattern

aten = torch.ops.aten
_MATMULS = {aten.mm.default, aten.addmm.default}


def _weight_mm(n: torch.fx.Node) -> bool:
    """A matmul that may read a weight: mm / addmm, or MoE experts' grouped matmul."""
    return n.target in _MATMULS or is_grouped_forward(n)

_ATTENTION = ("scaled_dot_product", "flash_attention", "efficient_attention")
SOLVE_TIME_LIMIT_S = 20.0  # a hard limit on every solve (shared notes: never an unbounded solve)


@dataclass
class ILPResult:
    """Roles chosen per parameter, the objective, and the problem's size."""

    roles: dict[str, str]
    objective_s: float
    variables: int
    constraints: int
    solve_time_s: float
    status: str
    compute_s: float = 0.0  # the objective's compute part (matmuls, segments, their backward)
    comm_s: float = 0.0  # its TP collectives (exposed after overlap)


group_of = block_pattern  # the TP ILP's weight groups: the plan's one block-name rule


class TPRoleILP:
    """The TP placement ILP of degree ``tp`` (the model is the module docstring's).

    Variables: one binary ``x[g, r]`` per weight group g and feasible role r, with
    ``sum_r x[g, r] = 1``; one binary ``y[s]`` per tied segment s (1 = sharded), with
    ``y[s] >= x[g, col]`` for every producer g of s and ``y[s] <= sum_g x[g, col]``.
    Objective: ``sum compute(x, y) + sum comm(x, y)``, each term linear in the binaries;
    products ``x * y`` become ``z >= x + y - 1`` (their coefficients are positive), and the
    overlappable collectives of a pool enter as ``e >= sum(comm) - overlap * sum(hiding)``.
    Memory: the weights' footprint ``sum_g numel_g * (x[g, rep] + (1 - x[g, rep]) / t)`` stays
    within 1 % of the least possible (dropped when roles are fixed).

    One method per concern: the graph's facts (backward owners, weight matmuls, embeddings,
    segments), the role variables, the segment states, the terms of each matmul, the tied
    block terms, the shared inputs, the overlap pools, the embeddings, the memory bound, and
    `solve` which reads the solution.
    """

    def __init__(self, graph: TrainingGraph, analysis: GraphAnalysis, cluster: Cluster, tp: int,
                 sp: bool = True, head_dim: int | None = None, base: TPRecipe | None = None,
                 fused: bool = True, fixed: dict[str, str] | None = None,
                 shared: dict | None = None) -> None:
        self.t0 = time.perf_counter()
        # what the ILPs of one graph and base recipe share across degrees (`solve_tp_roles`)
        shared = shared if shared is not None else {}
        self.graph, self.cluster, self.tp, self.sp, self.fixed = graph, cluster, tp, sp, fixed
        self.base = base or find_tp_recipe(graph, analysis)
        self.nodes = {n.name: n for n in graph.gm.graph.nodes}
        self.info = analysis.nodes
        self.weight_of, self.bd = self.base.weight_of, self.base.batch_dependent
        self.group = tp_group(cluster, tp)
        if ("kernels", fused) not in shared:
            shared[("kernels", fused)] = _kernels(graph, analysis, fused)
        self.full_s, self.shard_s = _node_seconds(shared[("kernels", fused)], cluster, tp)
        self.overlap = comm_overlap(cluster)
        self.backward_of, self.owner = self._backward_owners()
        self.matmuls = self._weight_matmuls()
        self.embeddings = self._embeddings()
        self.segment = self._segments()
        self.solver = pywraplp.Solver.CreateSolver("CBC")
        self.solver.SetTimeLimit(int(SOLVE_TIME_LIMIT_S * 1000))
        self.shapes = graph.param_shapes
        if ("attention_inputs", head_dim) not in shared:
            shared[("attention_inputs", head_dim)] = _attention_inputs(graph, analysis, self.matmuls,
                                                                       head_dim)
        self.attention_heads_in = shared[("attention_inputs", head_dim)]
        self.groups: dict[str, dict[str, pywraplp.Variable]] = {}
        self.zero = self.solver.NumVar(0, 0, "zero")
        self.compute: list = []  # seconds of compute
        self.comm_terms: list = []  # seconds of TP communication
        # collectives Megatron overlaps, per pool (the blocks together: they are tied; the
        # rest), and the matmul seconds that hide them, as `cost.terms.tensor_parallel` has it
        self.overlappable = {k: {"gather": [], "reduce": [], "hide_gather": [], "hide_reduce": []}
                             for k in ("blocks", "outside")}
        self._counter = itertools.count()

    # -- pricing helpers ---------------------------------------------------------------

    def comm(self, kind: str | None, nbytes: float) -> float:
        """Seconds of one collective of ``kind`` on the TP group (0 for none)."""
        return collective_time(kind, float(nbytes), self.group, self.cluster) if (kind and nbytes) else 0.0

    def reduce_s(self, nbytes: float) -> float:
        """A partial value reduced: reduce-scatter under SP, else all-reduce."""
        return self.comm(event_collective(True, False, self.sp), nbytes)

    def gather_s(self, nbytes: float, always: bool) -> float:
        """An all-gather under SP; without SP only if ``always``."""
        return self.comm(event_collective(False, always, self.sp), nbytes)

    def bwd(self, name: str) -> list[str]:
        """The backward nodes charged to forward node ``name``."""
        seq = self.nodes[name].meta.get("seq_nr")
        return self.backward_of.get(seq, []) if self.owner.get(seq) == name else []

    def work(self, name: str) -> tuple[float, float]:
        """(replicated, sharded) seconds of a forward node and its backward."""
        names = [name, *self.bwd(name)]
        return sum(self.full_s.get(k, 0.0) for k in names), sum(self.shard_s.get(k, 0.0) for k in names)

    def pool_of(self, name: str) -> str:
        """The overlap pool of a node: the tied blocks, or outside them."""
        return "blocks" if self.info[name].layer is not None else "outside"

    def fresh(self, label: str) -> pywraplp.Variable:
        """A new binary; OR-tools aborts on duplicate variable names."""
        return self.solver.BoolVar(f"{label}#{next(self._counter)}")

    def both(self, a, b, label: str) -> pywraplp.Variable:
        """A binary equal to a AND b (objective coefficients are positive: lower bounds do)."""
        z = self.fresh(label)
        self.solver.Add(z >= a + b - 1)
        return z

    # -- the graph's facts -------------------------------------------------------------

    def _backward_owners(self) -> tuple[dict[int, list[str]], dict[int, str]]:
        """Backward nodes of each forward node: those with its autograd sequence number,
        counted once: for the matmul of a sequence number if it has one (a linear's views
        share it), else for its first non-view forward node."""
        backward_of: dict[int, list[str]] = defaultdict(list)
        owner: dict[int, str] = {}
        for n in self.graph.gm.graph.nodes:
            if n.op != "call_function" or "seq_nr" not in n.meta:
                continue
            if self.info[n.name].phase == "backward":
                backward_of[n.meta["seq_nr"]].append(n.name)
            elif not self.info[n.name].is_view:
                seq = n.meta["seq_nr"]
                if seq not in owner or (_weight_mm(n) and not _weight_mm(self.nodes[owner[seq]])):
                    owner[seq] = n.name
        return backward_of, owner

    def _weight_matmuls(self) -> dict[str, tuple[str, torch.fx.Node]]:
        """Forward matmuls that read exactly one weight: node -> (param, activation input)."""
        matmuls: dict[str, tuple[str, torch.fx.Node]] = {}
        for n in self.graph.gm.graph.nodes:
            if n.op != "call_function" or self.info[n.name].phase != "forward" or not _weight_mm(n):
                continue
            operands = list(n.args[1:3]) if n.target == aten.addmm.default else list(n.args[:2])
            ws = [a for a in operands if isinstance(a, torch.fx.Node) and a.name in self.weight_of]
            if len(ws) == 1:
                x = operands[1] if operands[0] is ws[0] else operands[0]
                matmuls[n.name] = (self.weight_of[ws[0].name], x)
        return matmuls

    def _embeddings(self) -> dict[str, str]:
        """Embedding lookups of a weight table by batch-dependent indices: node -> param."""
        return {n.name: self.weight_of[n.args[0].name] for n in self.graph.gm.graph.nodes
                if n.op == "call_function" and n.target == aten.embedding.default
                and n.args[0].name in self.weight_of and self.bd.get(n.args[1].name)}

    def _segments(self) -> dict[str, str]:
        """Segments (union-find): connected batch-dependent forward compute between weight
        matmuls; node -> its segment's root."""
        parent: dict[str, str] = {}

        def find(a: str) -> str:
            while parent[a] != a:
                parent[a] = parent[parent[a]]
                a = parent[a]
            return a

        for n in self.graph.gm.graph.nodes:
            if (n.op == "call_function" and self.info[n.name].phase == "forward" and self.bd.get(n.name)
                    and n.name not in self.matmuls and n.name not in self.embeddings
                    and n.name not in self.weight_of):
                parent[n.name] = n.name
                for a in n.all_input_nodes:
                    if a.name in parent:
                        parent[find(a.name)] = find(n.name)
        return {name: find(name) for name in parent}

    # -- variables ---------------------------------------------------------------------

    def options(self, param: str, is_embedding: bool) -> list[str]:
        """The feasible roles of ``param``: a sharded dimension divides by t, heads are not
        split; a role in ``fixed`` is the only option."""
        shape, tp, base = self.shapes[param], self.tp, self.base
        if is_embedding:
            opts = [VOCAB, REPLICATED] if shape[0] % tp == 0 else [REPLICATED]
        else:
            opts = [REPLICATED]
            heads = self.attention_heads_in.get(param)
            if len(shape) == 2 and shape[0] % tp == 0 and (heads is None or heads % tp == 0):
                opts.append(COL)
            if len(shape) == 2 and shape[1] % tp == 0:
                opts.append(ROW)
            if len(shape) == 3 and param in base.grouped:  # experts [E, out, in] (or [E, in, out])
                out_dim, in_dim = (2, 1) if param in base.in_out else (1, 2)
                if shape[out_dim] % (tp * base.fused_parts.get(param, 1)) == 0:
                    opts.append(COL)
                if shape[in_dim] % tp == 0:
                    opts.append(ROW)
        forced = (self.fixed or {}).get(group_of(param))
        if forced is not None:
            if forced not in opts:
                raise ValueError(f"role {forced!r} is not feasible for {group_of(param)} at tp={tp}")
            opts = [forced]
        return opts

    def role_vars(self, param: str, is_embedding: bool = False) -> dict[str, pywraplp.Variable]:
        """The role binaries of ``param``'s group (created on first use, exactly one set)."""
        key = group_of(param)
        if key not in self.groups:
            opts = self.options(param, is_embedding)
            self.groups[key] = {r: self.solver.BoolVar(f"x[{key},{r}]") for r in opts}
            self.solver.Add(sum(self.groups[key].values()) == 1)
        return self.groups[key]

    # -- constraint families and objective terms ---------------------------------------

    def build(self) -> TPRoleILP:
        """Add every variable, constraint and objective term; then minimise."""
        self._segment_states()
        self.param_bytes = self._param_allreduce_seconds()
        rs_cost, ag_cost, roots = self._matmul_terms()
        self._tied_block_terms(rs_cost, ag_cost)
        self._shared_input_terms(roots)
        self._exposed_overlap()
        self._embedding_terms()
        self._memory_bound()
        self.solver.Minimize(sum(self.compute) + sum(self.comm_terms))
        return self

    def _segment_states(self) -> None:
        """Tie the L blocks: a segment is known by the weight groups that produce and consume
        it, so the same segment of every block shares one state ``y`` (sharded exactly when
        some producer is column-parallel), and its work is summed over the blocks under one
        key: the problem's size does not grow with depth."""
        producers: dict[str, set[str]] = defaultdict(set)
        consumers: dict[str, set[str]] = defaultdict(set)
        for mm, (param, x) in self.matmuls.items():
            for user in self.nodes[mm].users:
                if user.name in self.segment:
                    producers[self.segment[user.name]].add(group_of(param))
            if x.name in self.segment:
                consumers[self.segment[x.name]].add(group_of(param))
        self.seg_key = {seg: (frozenset(producers[seg]), frozenset(consumers[seg]))
                        for seg in set(self.segment.values())}
        seg_work: dict[tuple, list[float]] = defaultdict(lambda: [0.0, 0.0])
        for name, seg in self.segment.items():
            full, shard = self.work(name)
            seg_work[self.seg_key[seg]][0] += full
            seg_work[self.seg_key[seg]][1] += shard
        self.key_param: dict[str, str] = {}
        for param in {p for p, _ in self.matmuls.values()}:
            self.key_param.setdefault(group_of(param), param)
        self.seg_state = {key: self.solver.BoolVar(f"y[{i}]") for i, key in enumerate(seg_work)}
        for key, y in self.seg_state.items():
            cols = [self.role_vars(self.key_param[g]).get(COL, self.zero) for g in key[0]]
            for c in cols:
                self.solver.Add(y >= c)
            self.solver.Add(y <= sum(cols) if cols else y <= 0)
            full, shard = seg_work[key]
            # a sharded segment runs 1/t of its work; under SP a replicated one too (on its
            # sequence shard), without SP it runs whole
            self.compute.append(shard if self.sp else full - (full - shard) * y)

    def _param_allreduce_seconds(self) -> dict[str, float]:
        """Per weight group: one all-reduce of each of its parameters' gradients."""
        param_bytes: dict[str, float] = defaultdict(float)
        for p, shape in self.shapes.items():
            size = torch.empty((), dtype=self.graph.param_dtypes[p]).element_size()
            param_bytes[group_of(p)] += self.comm("all_reduce", float(torch.Size(shape).numel()) * size)
        return param_bytes

    def _matmul_terms(self) -> tuple[dict, dict, dict]:
        """Each weight matmul's compute and collectives; returns the tied costs (replicated
        output into a sharded segment; sharded input gathered) and the inputs' roots."""
        roots: dict[str, tuple[set, tuple, float, str]] = {}
        rs_cost: dict[tuple, float] = defaultdict(float)  # (group, segment key) -> seconds
        ag_cost: dict[tuple, float] = defaultdict(float)
        reduced_at = {e.node: e.nbytes for e in self.base.events if e.kind == "reduce" and e.forward}
        counts = defaultdict(int)
        for p, _ in self.matmuls.values():
            counts[group_of(p)] += 1
        for mm, (param, x) in self.matmuls.items():
            g = group_of(param)
            roles = self.role_vars(self.key_param[g])
            self._matmul_compute(mm, g, roles, counts[g])
            self._matmul_output(mm, roles, reduced_at)
            for user in self.nodes[mm].users:
                if user.name in self.segment and REPLICATED in roles:
                    # a replicated output entering a sharded segment: its gradient is gathered
                    rs_cost[(g, self.seg_key[self.segment[user.name]])] += self.gather_s(self.info[mm].nbytes, True)
                    break
            in_bytes = self.info[x.name].nbytes
            key = self.seg_key.get(self.segment.get(x.name, ""))
            if key is not None:
                # a sharded input gathered for a column or replicated weight (per consumer; not
                # an SP gather: nothing hides it, as `cost.terms.tensor_parallel` has it)
                ag_cost[(g, key)] += self.gather_s(in_bytes, True)
            roots.setdefault(self.info[x.name].storage, (set(), key, in_bytes, x.name))[0].add(g)
        return rs_cost, ag_cost, roots

    def _matmul_compute(self, mm: str, g: str, roles: dict, count: int) -> None:
        """A matmul's compute by role, its replicated gradient's all-reduce under SP, and
        the matmul seconds that hide Megatron's overlapped collectives."""
        zero, pool = self.zero, self.overlappable[self.pool_of(mm)]
        sharded = sum(v for r, v in roles.items() if r != REPLICATED)
        full, shard = self.work(mm)
        # a replicated weight's matmul runs whole, or under SP on the sequence shard (its
        # gradient is then partial: all-reduced over TP, as the norms' are)
        self.compute.append((shard if self.sp else full) * roles.get(REPLICATED, zero) + shard * sharded)
        if self.sp:
            self.comm_terms.append(self.param_bytes[g] / max(1, count) * roles.get(REPLICATED, zero))
        # column matmuls hide the SP gather of their input, the sharded layers' weight-gradient
        # matmuls the backward reduction of their input's gradient
        if COL in roles:
            pool["hide_gather"].append(self.shard_s.get(mm, 0.0) * roles[COL])
        wgrad = sum(self.shard_s.get(b, 0.0) for b in self.bwd(mm) if b in self.base.weight_grad_matmul)
        if wgrad:
            pool["hide_reduce"].append(wgrad * sharded)

    def _matmul_output(self, mm: str, roles: dict, reduced_at: dict[str, int]) -> None:
        """A row layer's partial output reduced (forward; where the recipe reduces it, after
        a cast to fp32 for the residual, say) and its gradient gathered (backward, SP)."""
        if ROW in roles:
            reduced = _reduced_bytes(self.nodes[mm], reduced_at, self.info)
            self.comm_terms.append((self.reduce_s(reduced) + self.gather_s(reduced, False)) * roles[ROW])

    def _tied_block_terms(self, rs_cost: dict, ag_cost: dict) -> None:
        """The same costs of every block under one product variable each (size independent
        of depth): x[g, rep] AND y[s] for a replicated output into a sharded segment, and
        (x[g, col] + x[g, rep]) AND y[s] for a sharded input gathered."""
        for (g, key), cost in rs_cost.items():
            z = self.both(self.role_vars(self.key_param[g])[REPLICATED], self.seg_state[key], f"rs[{g}]")
            self.comm_terms.append(cost * z)
        for (g, key), cost in ag_cost.items():
            needs_r = [v for r, v in self.role_vars(self.key_param[g]).items() if r in (COL, REPLICATED)]
            if needs_r:
                self.comm_terms.append(cost * self.both(sum(needs_r), self.seg_state[key], f"ag[{g}]"))

    def _shared_input_terms(self, roots: dict) -> None:
        """Column consumers of one value (q, k, v): one SP gather of the value if it is
        replicated, one backward reduction of its gradient, however many consumers share it:
        ``a >= x[g, col]`` for each consumer g, the gather ``z >= a - y[s]``."""
        shared: dict[tuple, list[float]] = defaultdict(lambda: [0.0, 0.0])
        for groups_of_root, key, in_bytes, x_name in roots.values():
            costs = shared[(frozenset(groups_of_root), key, self.pool_of(x_name))]
            costs[0] += self.reduce_s(in_bytes)
            costs[1] += self.gather_s(in_bytes, False) if (self.sp and self.bd.get(x_name)) else 0.0
        for (groups_of_root, key, where), (reduce_cost, gather_cost) in shared.items():
            a = self.fresh("a")
            for g in groups_of_root:
                self.solver.Add(a >= self.role_vars(self.key_param[g]).get(COL, self.zero))
            self.overlappable[where]["reduce"].append(reduce_cost * a)
            if gather_cost:
                z = self.fresh("g")
                self.solver.Add(z >= a - self.seg_state.get(key, self.zero))
                self.overlappable[where]["gather"].append(gather_cost * z)

    def _exposed_overlap(self) -> None:
        """Per pool and kind, the exposed rest: ``e >= sum(comm) - overlap * sum(hiding)``."""
        for terms in self.overlappable.values():
            for kind in ("gather", "reduce"):
                if terms[kind]:
                    exposed = self.solver.NumVar(0, self.solver.infinity(), f"exposed[{kind}#{next(self._counter)}]")
                    self.solver.Add(exposed >= sum(terms[kind]) - self.overlap * sum(terms[f"hide_{kind}"]))
                    self.comm_terms.append(exposed)

    def _embedding_terms(self) -> None:
        """A vocabulary-parallel table's partial output reduced; under SP a replicated
        table's gradient all-reduced."""
        reduced_at = {e.node: e.nbytes for e in self.base.events if e.kind == "reduce" and e.forward}
        embed_comm: dict[str, float] = defaultdict(float)
        for emb, param in self.embeddings.items():
            embed_comm[param] += self.reduce_s(_reduced_bytes(self.nodes[emb], reduced_at, self.info))
        for param, cost in embed_comm.items():
            roles = self.role_vars(param, is_embedding=True)
            if VOCAB in roles:
                self.comm_terms.append(cost * roles[VOCAB])
            if self.sp and REPLICATED in roles:
                self.comm_terms.append(self.param_bytes[group_of(param)] * roles[REPLICATED])

    def _memory_bound(self) -> None:
        """The ILP sees time, not the optimizer state a replicated weight costs on every rank
        (16-20 bytes per parameter): keep the weights' footprint within 1 % of the least
        possible, so a time gain is never bought with a memory cost the outer search cannot
        see. Dropped when roles are fixed (the objective then prices a given assignment)."""
        numel: dict[str, float] = defaultdict(float)
        for p, shape in self.shapes.items():
            numel[group_of(p)] += float(torch.Size(shape).numel())
        footprint, least = [], 0.0
        for key, vars_ in self.groups.items():
            full = numel[key]
            footprint.extend((full if r == REPLICATED else full / self.tp) * v for r, v in vars_.items())
            least += min(full if r == REPLICATED else full / self.tp for r in vars_)
        if self.fixed is None:
            self.solver.Add(sum(footprint) <= least * 1.01)

    # -- solve and read ----------------------------------------------------------------

    def solve(self) -> ILPResult:
        """Solve (within `SOLVE_TIME_LIMIT_S`) and read each group's role onto its weights."""
        solver = self.solver
        status = solver.Solve()
        names = {pywraplp.Solver.OPTIMAL: "optimal", pywraplp.Solver.FEASIBLE: "feasible (time limit)"}
        if status not in names:
            raise RuntimeError(f"the TP placement ILP found no solution (status {status})")
        chosen = {key: max(vars_, key=lambda r: vars_[r].solution_value()) for key, vars_ in self.groups.items()}
        return ILPResult(
            roles={p: chosen[group_of(p)] for p in self.shapes if group_of(p) in chosen},
            objective_s=solver.Objective().Value(),
            variables=solver.NumVariables(),
            constraints=solver.NumConstraints(),
            solve_time_s=time.perf_counter() - self.t0,
            status=names[status],
            compute_s=sum(_value(e) for e in self.compute),
            comm_s=sum(_value(e) for e in self.comm_terms),
        )


def solve_tp_roles(
    graph: TrainingGraph,
    analysis: GraphAnalysis,
    cluster: Cluster,
    tp: int,
    sp: bool = True,
    head_dim: int | None = None,
    base: TPRecipe | None = None,
    fused: bool = True,
    fixed: dict[str, str] | None = None,
    shared: dict | None = None,
) -> ILPResult:
    """Choose every weight's TP role for degree ``tp`` by an ILP (`TPRoleILP`; the model is
    the module docstring's).

    fused: price nodes as fused kernels (as `build_step_facts` does by default). fixed: roles
    of some weight groups (`group_of` keys) to impose instead of choosing; with it the memory
    bound is dropped, so that the objective prices any given assignment (a check of the ILP
    against `cost.step.predict`). shared: a dict the caller keeps per graph and ``base``
    recipe, where the ILPs of every degree and cluster keep what depends on those alone (the
    kernels' sizes, the attention inputs).
    """
    return TPRoleILP(graph, analysis, cluster, tp, sp, head_dim, base, fused, fixed,
                     shared).build().solve()


def _value(term) -> float:
    """The solved value of an objective term (a number or a linear expression)."""
    return float(term) if isinstance(term, (int, float)) else term.solution_value()


def _reduced_bytes(mm: torch.fx.Node, reduced_at: dict[str, int], info) -> float:
    """Bytes of a row-parallel matmul's (or a vocabulary-parallel table's) partial output
    where Megatron's recipe reduces it: at the node itself or a few linear steps downstream (a
    view, a cast to fp32 for the residual), else the node's own output.

    The ILP takes these positions from the Megatron recipe: other roles upstream can move
    the recipe's reduction (e.g. to before the cast) and `predict` follows it; the ILP does not.
    """
    if mm.name in reduced_at:
        return float(reduced_at[mm.name])
    frontier = [mm]
    for _ in range(4):
        frontier = [u for n in frontier for u in n.users if info[u.name].phase == "forward"]
        hit = [reduced_at[u.name] for u in frontier if u.name in reduced_at]
        if hit:
            return float(hit[0])
    return float(info[mm.name].nbytes)


def _kernels(graph: TrainingGraph, analysis: GraphAnalysis, fused: bool) -> tuple:
    """(names, FLOPs, vector FLOPs, bytes, is-matmul, launches, attention keys, attention head
    dims) of every kernel-launching node
    at the captured batch, on the bytes `build_step_facts` counts (a fusion group's external
    inputs and outputs)."""
    groups = fusion_groups(graph, analysis) if fused else {}
    ext_inputs, leaves = external_bytes(graph, analysis, groups)
    names, flops, vflops, nbytes, is_matmul, launch, keys, dims = [], [], [], [], [], [], [], []
    for node in graph.gm.graph.nodes:
        if node.op != "call_function" or analysis.nodes[node.name].is_view:
            continue  # views launch no kernel and move no bytes
        i = analysis.nodes[node.name]
        names.append(node.name)
        keys.append(attention_keys(node))
        dims.append(attention_head_dim(node))
        flops.append(i.executed_flops)
        vflops.append(i.vector_flops)
        read = sum(analysis.nodes[a.name].nbytes for a in ext_inputs[node.name])
        nbytes.append(read + (i.bytes_written if leaves[node.name] else 0))
        is_matmul.append(i.is_matmul or i.flops > 0)
        launch.append(groups.get(node.name, node.name) == node.name)
    f, v, b = (np.array(a, dtype=float) for a in (flops, vflops, nbytes))
    return (names, f, v, b, np.array(is_matmul, dtype=bool), np.array(launch, dtype=bool),
            np.array(keys, dtype=float), np.array(dims, dtype=float))


def _node_seconds(kernels: tuple, cluster: Cluster, tp: int) -> tuple[dict[str, float], dict[str, float]]:
    """Step seconds of every node of ``kernels`` (`_kernels`), whole and split ``tp`` ways: the
    roofline of `cost.terms.compute.roofline_times` (the step model's), in the cluster's
    default precision, an attention (forward or backward) no faster than its rate at its keys
    (`cost.terms.compute.attention_floor`), slowed by `CostParams.framework_efficiency`
    as `predict` does."""
    names, f, v, b, mm, ln, keys, dims = kernels
    gpu = cluster.gpu
    precision = compute_dtype(gpu, default_precision(cluster))
    dtype = np.full(f.shape, precision)
    out = []
    for div in (1, tp):
        t = roofline_times(gpu, f / div, v / div, b / div, mm, ln, dtype, cluster.params.gemm_half_scale)
        # autopar's runtime's attention kernel (`StepFacts.native_attention`'s default)
        t = attention_floor(t, f / div, keys, cluster, precision, native=StepFacts.native_attention,
                            head_dim=dims)
        t = t / cluster.params.framework_efficiency
        out.append(dict(zip(names, t.tolist())))
    return out[0], out[1]


def _attention_inputs(graph, analysis, matmuls, head_dim) -> dict[str, int]:
    """Weights whose outputs reach an attention op as Q, K or V: their head counts."""
    out: dict[str, int] = {}
    consumers: dict[str, list] = defaultdict(list)
    attention = set()
    for n in graph.gm.graph.nodes:
        for a in n.all_input_nodes:
            consumers[a.name].append(n)
        if any(k in str(n.target) for k in _ATTENTION):
            attention.add(n.name)
    for mm, (param, _) in matmuls.items():
        stack, seen, depth = [mm], set(), 0
        while stack and depth < 2000:
            depth += 1
            name = stack.pop()
            for user in consumers[name]:
                if user.name in seen or user.name in matmuls or analysis.nodes[user.name].phase != "forward":
                    continue
                seen.add(user.name)
                if user.name in attention:
                    q = user.args[0].meta["val"]
                    d = head_dim or int(q.shape[-1])
                    out[param] = graph.param_shapes[param][0] // d
                    stack = []
                    break
                stack.append(user.name)
    return out
