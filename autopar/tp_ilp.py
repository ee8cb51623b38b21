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
for one micro-batch: matmul and segment compute (divided by t where sharded; R segments too
under sequence parallelism) plus the collectives each role and segment state implies on the
edges between them (partial -> reduce; sharded -> replicated: all-gather; backward
conjugates), products of binaries linearised as usual. Feasibility: a sharded dimension must
divide by t, and heads must not be split (an attention input's head count divides by t).

The Megatron recipe is one feasible point; where heads do not divide (grouped-query K/V with
fewer heads than t) the ILP replicates instead of failing.
"""

from __future__ import annotations

import re
import time
from collections import defaultdict
from dataclasses import dataclass

import torch
from ortools.linear_solver import pywraplp

from autopar.analysis import GraphAnalysis
from autopar.capture import TrainingGraph
from autopar.tp_recipe import COL, REPLICATED, ROW, VOCAB, TPRecipe, find_tp_recipe
from cost import Cluster, axis_group, collective_time

aten = torch.ops.aten
_MATMULS = {aten.mm.default, aten.addmm.default}
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


def group_of(name: str) -> str:
    """Weights of repeated blocks share one decision: 'layers.3.attn.q_proj.weight' ->
    'layers.*.attn.q_proj.weight' (inner indices, e.g. experts, fold too)."""
    return re.sub(r"\.\d+\.", ".*.", name)


def solve_tp_roles(
    graph: TrainingGraph,
    analysis: GraphAnalysis,
    cluster: Cluster,
    tp: int,
    sp: bool = True,
    head_dim: int | None = None,
    base: TPRecipe | None = None,
) -> ILPResult:
    """Choose every weight's TP role for degree ``tp`` by an ILP; see the module docstring."""
    t0 = time.perf_counter()
    base = base or find_tp_recipe(graph, analysis)
    nodes = {n.name: n for n in graph.gm.graph.nodes}
    info = analysis.nodes
    weight_of, bd = base.weight_of, base.batch_dependent
    gpu = cluster.gpu
    group = axis_group(cluster, tp, 1)

    def op_time(name: str) -> float:
        i = info[name]
        if i.is_view:
            return 0.0
        rate = gpu.peak("bf16") * gpu.efficiency("bf16") if (i.flops and "bf16" in gpu.peak_flops) else gpu.peak("fp32")
        return max(i.flops / rate, (i.bytes_read + i.bytes_written) / (gpu.memory_bw * gpu.memory_efficiency))

    def comm(kind: str, nbytes: float) -> float:
        return collective_time(kind, float(nbytes), group, cluster) if nbytes else 0.0

    # backward work of each forward node: backward nodes with its autograd sequence number
    backward_of: dict[int, float] = defaultdict(float)
    for n in graph.gm.graph.nodes:
        if n.op == "call_function" and info[n.name].phase == "backward" and "seq_nr" in n.meta:
            backward_of[n.meta["seq_nr"]] += op_time(n.name)

    def work(name: str) -> float:
        return op_time(name) + backward_of.get(nodes[name].meta.get("seq_nr"), 0.0)

    # forward weight matmuls and their weights
    matmuls: dict[str, tuple[str, torch.fx.Node]] = {}  # node -> (param, activation input)
    for n in graph.gm.graph.nodes:
        if n.op != "call_function" or info[n.name].phase != "forward" or n.target not in _MATMULS:
            continue
        operands = list(n.args[1:3]) if n.target == aten.addmm.default else list(n.args[:2])
        ws = [a for a in operands if isinstance(a, torch.fx.Node) and a.name in weight_of]
        if len(ws) == 1:
            x = operands[1] if operands[0] is ws[0] else operands[0]
            matmuls[n.name] = (weight_of[ws[0].name], x)
    embeddings = {n.name: weight_of[n.args[0].name] for n in graph.gm.graph.nodes
                  if n.op == "call_function" and n.target == aten.embedding.default
                  and n.args[0].name in weight_of and bd.get(n.args[1].name)}

    # segments: connected forward compute between weight matmuls
    parent: dict[str, str] = {}

    def find(a: str) -> str:
        while parent[a] != a:
            parent[a] = parent[parent[a]]
            a = parent[a]
        return a

    for n in graph.gm.graph.nodes:
        if (n.op == "call_function" and info[n.name].phase == "forward" and bd.get(n.name)
                and n.name not in matmuls and n.name not in embeddings and n.name not in weight_of):
            parent[n.name] = n.name
            for a in n.all_input_nodes:
                if a.name in parent:
                    parent[find(a.name)] = find(n.name)
    segment = {name: find(name) for name in parent}

    # decision variables
    solver = pywraplp.Solver.CreateSolver("CBC")
    solver.SetTimeLimit(int(SOLVE_TIME_LIMIT_S * 1000))
    shapes = graph.param_shapes
    attention_heads_in = _attention_inputs(graph, analysis, matmuls, head_dim)
    groups: dict[str, dict[str, pywraplp.Variable]] = {}

    def options(param: str, is_embedding: bool) -> list[str]:
        shape = shapes[param]
        if is_embedding:
            return [VOCAB, REPLICATED] if shape[0] % tp == 0 else [REPLICATED]
        opts = [REPLICATED]
        heads = attention_heads_in.get(param)
        if len(shape) == 2 and shape[0] % tp == 0 and (heads is None or heads % tp == 0):
            opts.append(COL)
        if len(shape) == 2 and shape[1] % tp == 0:
            opts.append(ROW)
        return opts

    def role_vars(param: str, is_embedding: bool = False) -> dict[str, pywraplp.Variable]:
        key = group_of(param)
        if key not in groups:
            opts = options(param, is_embedding)
            groups[key] = {r: solver.BoolVar(f"x[{key},{r}]") for r in opts}
            solver.Add(sum(groups[key].values()) == 1)
        return groups[key]

    zero = solver.NumVar(0, 0, "zero")
    objective = []
    seg_producers: dict[str, list[str]] = defaultdict(list)
    for mm in matmuls:
        for user in nodes[mm].users:
            if user.name in segment:
                seg_producers[segment[user.name]].append(mm)
    seg_state = {seg: solver.BoolVar(f"y[{seg}]") for seg in set(segment.values())}
    for seg, y in seg_state.items():
        cols = [role_vars(matmuls[m][0]).get(COL, zero) for m in seg_producers.get(seg, [])]
        for c in cols:
            solver.Add(y >= c)
        solver.Add(y <= sum(cols) if cols else y <= 0)
    # segment compute: /t when sharded, and under SP also when replicated (sequence-sharded)
    seg_work: dict[str, float] = defaultdict(float)
    for name, seg in segment.items():
        seg_work[seg] += work(name)
    for seg, y in seg_state.items():
        w = seg_work[seg]
        objective.append(w / tp if sp else w - w * (1 - 1 / tp) * y)

    def both(a, b, label: str):
        """A binary equal to a AND b (objective coefficients are positive: lower bounds do)."""
        z = solver.BoolVar(label)
        solver.Add(z >= a + b - 1)
        return z

    shared_input: dict[str, list] = defaultdict(list)  # value -> col (and SP rep) consumer vars
    for mm, (param, x) in matmuls.items():
        roles = role_vars(param)
        sharded = sum(v for r, v in roles.items() if r != REPLICATED)
        rep = roles[REPLICATED]
        w = work(mm)
        objective.append(w * rep + (w / tp) * sharded)
        out_bytes = info[mm].nbytes
        if ROW in roles:  # partial output reduced: all-reduce, or reduce-scatter under SP; an
            # attention input must be whole on its heads' ranks: all-reduce either way
            kind = "reduce_scatter" if sp and param not in attention_heads_in else "all_reduce"
            objective.append(comm(kind, out_bytes) * roles[ROW])
        # a replicated output entering a sharded segment is sliced; its gradient all-gathered
        for user in nodes[mm].users:
            if user.name in segment:
                z = both(rep, seg_state[segment[user.name]], f"rs[{mm}]")
                objective.append(comm("all_gather", out_bytes) * z)
                break
        in_bytes = info[x.name].nbytes
        y = seg_state.get(segment.get(x.name, ""), zero)
        needs_r = [v for r, v in roles.items() if r in (COL, REPLICATED)]
        if needs_r:  # a sharded input gathered for a column or replicated weight
            z = both(sum(needs_r), y, f"ag[{mm}]")
            objective.append((comm("all_gather", in_bytes) + comm("reduce_scatter", in_bytes)) * z)
        if ROW in roles:  # a replicated input sliced for a row weight; gradient all-gathered
            w_ = solver.BoolVar(f"sl[{mm}]")
            solver.Add(w_ >= roles[ROW] - y)
            objective.append(comm("all_gather", in_bytes) * w_)
        root = info[x.name].storage
        shared_input[root].append((roles.get(COL, zero), rep, in_bytes))
    for root, users in shared_input.items():
        # col consumers of one value: one backward all-reduce (SP: forward all-gather + backward
        # reduce-scatter) of its gradient, however many consumers share it (q, k, v)
        in_bytes = users[0][2]
        a = solver.BoolVar(f"a[{root}]")
        for col, rep, _ in users:
            solver.Add(a >= col)
            if sp:
                solver.Add(a >= rep)
        cost = comm("all_gather", in_bytes) + comm("reduce_scatter", in_bytes) if sp else comm("all_reduce", in_bytes)
        objective.append(cost * a)
    for emb, param in embeddings.items():
        roles = role_vars(param, is_embedding=True)
        if VOCAB in roles:
            objective.append(comm("reduce_scatter" if sp else "all_reduce", info[emb].nbytes) * roles[VOCAB])
    # Weights: the ILP sees time, not the optimizer state a replicated weight costs on every rank
    # (16-20 bytes per parameter). Keep the weights' footprint within 1 % of the least possible,
    # so a time gain is never bought with a memory cost the outer search cannot see.
    numel: dict[str, float] = defaultdict(float)
    for p in shapes:
        numel[group_of(p)] += float(torch.Size(shapes[p]).numel())
    footprint, least = [], 0.0
    for key, vars_ in groups.items():
        full = numel[key]
        footprint.extend((full if r == REPLICATED else full / tp) * v for r, v in vars_.items())
        least += min(full if r == REPLICATED else full / tp for r in vars_)
    solver.Add(sum(footprint) <= least * 1.01)
    solver.Minimize(sum(objective))
    status = solver.Solve()
    names = {pywraplp.Solver.OPTIMAL: "optimal", pywraplp.Solver.FEASIBLE: "feasible (time limit)"}
    if status not in names:
        raise RuntimeError(f"the TP placement ILP found no solution (status {status})")
    chosen = {key: max(vars_, key=lambda r: vars_[r].solution_value()) for key, vars_ in groups.items()}
    roles_by_param = {p: chosen[group_of(p)] for p in shapes if group_of(p) in chosen}
    return ILPResult(
        roles=roles_by_param,
        objective_s=solver.Objective().Value(),
        variables=solver.NumVariables(),
        constraints=solver.NumConstraints(),
        solve_time_s=time.perf_counter() - t0,
        status=names[status],
    )


def _attention_inputs(graph, analysis, matmuls, head_dim) -> dict[str, int]:
    """Weights whose outputs reach an attention op as Q, K or V: their head counts."""
    out: dict[str, int] = {}
    consumers: dict[str, list] = defaultdict(list)
    for n in graph.gm.graph.nodes:
        for a in n.all_input_nodes:
            consumers[a.name].append(n)
    for mm, (param, _) in matmuls.items():
        stack, seen, depth = [mm], set(), 0
        while stack and depth < 2000:
            depth += 1
            name = stack.pop()
            for user in consumers[name]:
                if user.name in seen or user.name in matmuls or analysis.nodes[user.name].phase != "forward":
                    continue
                seen.add(user.name)
                if any(k in str(user.target) for k in _ATTENTION):
                    q = user.args[0].meta["val"]
                    d = head_dim or int(q.shape[-1])
                    out[param] = graph.param_shapes[param][0] // d
                    stack = []
                    break
                stack.append(user.name)
    return out
