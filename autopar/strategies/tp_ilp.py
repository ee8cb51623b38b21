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

from autopar.analysis.graph import GraphAnalysis
from autopar.capture.joint import TrainingGraph
from autopar.strategies.tp_recipe import COL, REPLICATED, ROW, VOCAB, TPRecipe, find_tp_recipe
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

    # Tie the L blocks: a segment is known by the weight groups that produce and consume it,
    # so the same segment of every block shares one state variable, and every cost below is
    # summed over the blocks under one key. The problem's size does not grow with depth.
    producers: dict[str, set[str]] = defaultdict(set)
    consumers: dict[str, set[str]] = defaultdict(set)
    for mm, (param, x) in matmuls.items():
        for user in nodes[mm].users:
            if user.name in segment:
                producers[segment[user.name]].add(group_of(param))
        if x.name in segment:
            consumers[segment[x.name]].add(group_of(param))
    seg_key = {seg: (frozenset(producers[seg]), frozenset(consumers[seg])) for seg in set(segment.values())}
    seg_work: dict[tuple, float] = defaultdict(float)
    for name, seg in segment.items():
        seg_work[seg_key[seg]] += work(name)
    key_param = {}
    for param in {p for p, _ in matmuls.values()}:
        key_param.setdefault(group_of(param), param)
    seg_state = {key: solver.BoolVar(f"y[{i}]") for i, key in enumerate(seg_work)}
    for key, y in seg_state.items():
        # sharded exactly when some producing weight is column-parallel
        cols = [role_vars(key_param[g]).get(COL, zero) for g in key[0]]
        for c in cols:
            solver.Add(y >= c)
        solver.Add(y <= sum(cols) if cols else y <= 0)
        w = seg_work[key]
        objective.append(w / tp if sp else w - w * (1 - 1 / tp) * y)

    counter = iter(range(10**9))

    def fresh(label: str):
        """A new binary; OR-tools aborts on duplicate variable names."""
        return solver.BoolVar(f"{label}#{next(counter)}")

    def both(a, b, label: str):
        """A binary equal to a AND b (objective coefficients are positive: lower bounds do)."""
        z = fresh(label)
        solver.Add(z >= a + b - 1)
        return z

    compute: dict[str, float] = defaultdict(float)
    reduce_cost: dict[str, float] = defaultdict(float)
    sliced_out: dict[tuple, float] = defaultdict(float)  # (group, segment key) -> all-gather s
    gathered_in: dict[tuple, float] = defaultdict(float)  # (group, segment key) -> AG + RS s
    sliced_in: dict[tuple, float] = defaultdict(float)
    shared: dict[tuple, float] = defaultdict(float)  # (consumer groups, segment key) -> s
    roots: dict[str, tuple[set, tuple, float]] = {}
    for mm, (param, x) in matmuls.items():
        g = group_of(param)
        compute[g] += work(mm)
        out_bytes = info[mm].nbytes
        # partial output reduced: all-reduce, or reduce-scatter under SP; an attention input
        # must be whole on its heads' ranks: all-reduce either way
        kind = "reduce_scatter" if sp and param not in attention_heads_in else "all_reduce"
        reduce_cost[g] += comm(kind, out_bytes)
        for user in nodes[mm].users:
            if user.name in segment:  # a replicated output entering a sharded segment: sliced
                sliced_out[(g, seg_key[segment[user.name]])] += comm("all_gather", out_bytes)
                break
        in_bytes = info[x.name].nbytes
        key = seg_key.get(segment.get(x.name, ""))
        gathered_in[(g, key)] += comm("all_gather", in_bytes) + comm("reduce_scatter", in_bytes)
        sliced_in[(g, key)] += comm("all_gather", in_bytes)
        root = info[x.name].storage
        groups_of_root, _, _ = roots.setdefault(root, (set(), key, in_bytes))
        groups_of_root.add(g)
    for groups_of_root, key, in_bytes in roots.values():
        # column consumers of one value: one backward all-reduce (SP: forward all-gather and
        # backward reduce-scatter) of its gradient, however many consumers share it (q, k, v)
        cost = comm("all_gather", in_bytes) + comm("reduce_scatter", in_bytes) if sp else comm("all_reduce", in_bytes)
        shared[(frozenset(groups_of_root), key)] += cost
    for g, w in compute.items():
        roles = role_vars(key_param[g])
        sharded = sum(v for r, v in roles.items() if r != REPLICATED)
        objective.append(w * roles[REPLICATED] + (w / tp) * sharded)
        if ROW in roles:
            objective.append(reduce_cost[g] * roles[ROW])
    for (g, key), cost in sliced_out.items():
        roles = role_vars(key_param[g])
        objective.append(cost * both(roles[REPLICATED], seg_state[key], f"rs[{g}]"))
    for (g, key), cost in gathered_in.items():
        roles = role_vars(key_param[g])
        needs_r = [v for r, v in roles.items() if r in (COL, REPLICATED)]
        y = seg_state.get(key, zero)
        if needs_r:  # a sharded input gathered for a column or replicated weight
            objective.append(cost * both(sum(needs_r), y, f"ag[{g}]"))
        if ROW in roles:  # a replicated input sliced for a row weight; gradient all-gathered
            w_ = fresh(f"sl[{g}]")
            solver.Add(w_ >= roles[ROW] - y)
            objective.append(sliced_in[(g, key)] * w_)
    for (groups_of_root, _key), cost in shared.items():
        a = fresh("a")
        for g in groups_of_root:
            roles = role_vars(key_param[g])
            solver.Add(a >= roles.get(COL, zero))
            if sp:
                solver.Add(a >= roles[REPLICATED])
        objective.append(cost * a)
    embed_comm: dict[str, float] = defaultdict(float)
    for emb, param in embeddings.items():
        embed_comm[param] += comm("reduce_scatter" if sp else "all_reduce", info[emb].nbytes)
    for param, cost in embed_comm.items():
        roles = role_vars(param, is_embedding=True)
        if VOCAB in roles:
            objective.append(cost * roles[VOCAB])
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
