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

import re
import time
from collections import defaultdict
from dataclasses import dataclass

import numpy as np
import torch
from ortools.linear_solver import pywraplp

from autopar.analysis.fusion import external_bytes, fusion_groups
from autopar.analysis.graph import GraphAnalysis
from autopar.capture.joint import TrainingGraph
from autopar.strategies.tp_recipe import COL, REPLICATED, ROW, VOCAB, TPRecipe, find_tp_recipe
from cost import Cluster, collective_time
from cost.terms.common import comm_overlap, default_precision
from cost.terms.compute import compute_dtype, roofline_times
from cost.terms.tensor_parallel import event_collective, tp_group
from passes.grouped_matmul import is_grouped_forward

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
    fused: bool = True,
    fixed: dict[str, str] | None = None,
) -> ILPResult:
    """Choose every weight's TP role for degree ``tp`` by an ILP; see the module docstring.

    fused: price nodes as fused kernels (as `build_step_facts` does by default). fixed: roles
    of some weight groups (`group_of` keys) to impose instead of choosing; with it the memory
    bound is dropped, so that the objective prices any given assignment (a check of the ILP
    against `cost.step.predict`).
    """
    t0 = time.perf_counter()
    base = base or find_tp_recipe(graph, analysis)
    nodes = {n.name: n for n in graph.gm.graph.nodes}
    info = analysis.nodes
    weight_of, bd = base.weight_of, base.batch_dependent
    group = tp_group(cluster, tp)
    full_s, shard_s = _node_seconds(graph, analysis, cluster, tp, fused)
    overlap = comm_overlap(cluster)

    def comm(kind: str | None, nbytes: float) -> float:
        return collective_time(kind, float(nbytes), group, cluster) if (kind and nbytes) else 0.0

    def reduce_s(nbytes: float) -> float:  # a partial value reduced (RS under SP, else AR)
        return comm(event_collective(True, False, sp), nbytes)

    def gather_s(nbytes: float, always: bool) -> float:  # AG under SP; without, only if always
        return comm(event_collective(False, always, sp), nbytes)

    # backward nodes of each forward node: those with its autograd sequence number, counted
    # once: for the matmul of a sequence number if it has one (a linear's views share it),
    # else for its first non-view forward node
    backward_of: dict[int, list[str]] = defaultdict(list)
    owner: dict[int, str] = {}
    for n in graph.gm.graph.nodes:
        if n.op != "call_function" or "seq_nr" not in n.meta:
            continue
        if info[n.name].phase == "backward":
            backward_of[n.meta["seq_nr"]].append(n.name)
        elif not info[n.name].is_view:
            seq = n.meta["seq_nr"]
            if seq not in owner or (_weight_mm(n) and not _weight_mm(nodes[owner[seq]])):
                owner[seq] = n.name

    def bwd(name: str) -> list[str]:
        seq = nodes[name].meta.get("seq_nr")
        return backward_of.get(seq, []) if owner.get(seq) == name else []

    def work(name: str) -> tuple[float, float]:
        """(replicated, sharded) seconds of a forward node and its backward."""
        names = [name, *bwd(name)]
        return sum(full_s.get(k, 0.0) for k in names), sum(shard_s.get(k, 0.0) for k in names)

    # forward weight matmuls and their weights
    matmuls: dict[str, tuple[str, torch.fx.Node]] = {}  # node -> (param, activation input)
    for n in graph.gm.graph.nodes:
        if n.op != "call_function" or info[n.name].phase != "forward" or not _weight_mm(n):
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
            opts = [VOCAB, REPLICATED] if shape[0] % tp == 0 else [REPLICATED]
        else:
            opts = [REPLICATED]
            heads = attention_heads_in.get(param)
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
        forced = (fixed or {}).get(group_of(param))
        if forced is not None:
            if forced not in opts:
                raise ValueError(f"role {forced!r} is not feasible for {group_of(param)} at tp={tp}")
            opts = [forced]
        return opts

    def role_vars(param: str, is_embedding: bool = False) -> dict[str, pywraplp.Variable]:
        key = group_of(param)
        if key not in groups:
            opts = options(param, is_embedding)
            groups[key] = {r: solver.BoolVar(f"x[{key},{r}]") for r in opts}
            solver.Add(sum(groups[key].values()) == 1)
        return groups[key]

    zero = solver.NumVar(0, 0, "zero")
    compute, objective = [], []  # seconds of compute, and of TP communication
    # collectives Megatron overlaps, per pool (the blocks together: they are tied; the rest),
    # and the matmul seconds that hide them, as `cost.terms.tensor_parallel` prices them
    overlappable = {k: {"gather": [], "reduce": [], "hide_gather": [], "hide_reduce": []}
                    for k in ("blocks", "outside")}

    def pool_of(name: str) -> str:
        return "blocks" if info[name].layer is not None else "outside"

    def pool(name: str) -> dict[str, list]:
        return overlappable[pool_of(name)]

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
    seg_work: dict[tuple, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for name, seg in segment.items():
        full, shard = work(name)
        seg_work[seg_key[seg]][0] += full
        seg_work[seg_key[seg]][1] += shard
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
        full, shard = seg_work[key]
        # a sharded segment runs 1/t of its work; under SP a replicated one too (on its
        # sequence shard), without SP it runs whole
        compute.append(shard if sp else full - (full - shard) * y)

    counter = iter(range(10**9))

    def fresh(label: str):
        """A new binary; OR-tools aborts on duplicate variable names."""
        return solver.BoolVar(f"{label}#{next(counter)}")

    def both(a, b, label: str):
        """A binary equal to a AND b (objective coefficients are positive: lower bounds do)."""
        z = fresh(label)
        solver.Add(z >= a + b - 1)
        return z

    param_bytes: dict[str, float] = defaultdict(float)  # group -> one AR per parameter
    for p in shapes:
        nbytes = float(torch.Size(shapes[p]).numel()) * torch.empty((), dtype=graph.param_dtypes[p]).element_size()
        param_bytes[group_of(p)] += comm("all_reduce", nbytes)
    roots: dict[str, tuple[set, tuple, float, str]] = {}
    rs_cost: dict[tuple, float] = defaultdict(float)  # (group, segment key) -> seconds
    ag_cost: dict[tuple, float] = defaultdict(float)
    reduced_at = {e.node: e.nbytes for e in base.events if e.kind == "reduce" and e.forward}
    for mm, (param, x) in matmuls.items():
        g = group_of(param)
        roles = role_vars(key_param[g])
        sharded = sum(v for r, v in roles.items() if r != REPLICATED)
        full, shard = work(mm)
        # a replicated weight's matmul runs whole, or under SP on the sequence shard (its
        # gradient is then partial: all-reduced over TP, as the norms' are)
        compute.append((shard if sp else full) * roles.get(REPLICATED, zero) + shard * sharded)
        if sp:
            objective.append(param_bytes[g] / max(1, _count(matmuls, g)) * roles.get(REPLICATED, zero))
        # Megatron's overlaps: column matmuls hide the SP gather of their input, the sharded
        # layers' weight-gradient matmuls the backward reduction of their input's gradient
        if COL in roles:
            pool(mm)["hide_gather"].append(shard_s.get(mm, 0.0) * roles[COL])
        wgrad = sum(shard_s.get(b, 0.0) for b in bwd(mm) if b in base.weight_grad_matmul)
        if wgrad:
            pool(mm)["hide_reduce"].append(wgrad * sharded)
        out_bytes = info[mm].nbytes
        if ROW in roles:
            # partial output reduced (forward; where the recipe reduces it, after a cast to
            # fp32 for the residual, say) and its gradient gathered (backward, SP): fixed
            reduced = _reduced_bytes(nodes[mm], reduced_at, info)
            objective.append((reduce_s(reduced) + gather_s(reduced, False)) * roles[ROW])
        for user in nodes[mm].users:
            if user.name in segment and REPLICATED in roles:
                # a replicated output entering a sharded segment: its gradient is gathered
                rs_cost[(g, seg_key[segment[user.name]])] += gather_s(out_bytes, True)
                break
        in_bytes = info[x.name].nbytes
        key = seg_key.get(segment.get(x.name, ""))
        if key is not None:
            # a sharded input gathered for a column or replicated weight (per consumer; not an
            # SP gather: nothing hides it, as `cost.terms.tensor_parallel` has it)
            ag_cost[(g, key)] += gather_s(in_bytes, True)
        root = info[x.name].storage
        groups_of_root = roots.setdefault(root, (set(), key, in_bytes, x.name))[0]
        groups_of_root.add(g)
    # the same costs of every block under one variable each: the size does not grow with depth
    for (g, key), cost in rs_cost.items():
        objective.append(cost * both(role_vars(key_param[g])[REPLICATED], seg_state[key], f"rs[{g}]"))
    for (g, key), cost in ag_cost.items():
        needs_r = [v for r, v in role_vars(key_param[g]).items() if r in (COL, REPLICATED)]
        if needs_r:
            objective.append(cost * both(sum(needs_r), seg_state[key], f"ag[{g}]"))
    shared: dict[tuple, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for groups_of_root, key, in_bytes, x_name in roots.values():
        # column consumers of one value (q, k, v): one SP gather of the value if it is
        # replicated, one backward reduction of its gradient, however many consumers share it
        costs = shared[(frozenset(groups_of_root), key, pool_of(x_name))]
        costs[0] += reduce_s(in_bytes)
        costs[1] += gather_s(in_bytes, False) if (sp and bd.get(x_name)) else 0.0
    for (groups_of_root, key, where), (reduce_cost, gather_cost) in shared.items():
        a = fresh("a")
        for g in groups_of_root:
            solver.Add(a >= role_vars(key_param[g]).get(COL, zero))
        overlappable[where]["reduce"].append(reduce_cost * a)
        if gather_cost:
            z = fresh("g")
            solver.Add(z >= a - seg_state.get(key, zero))
            overlappable[where]["gather"].append(gather_cost * z)
    for terms in overlappable.values():
        for kind in ("gather", "reduce"):
            if terms[kind]:
                exposed = solver.NumVar(0, solver.infinity(), f"exposed[{kind}#{next(counter)}]")
                solver.Add(exposed >= sum(terms[kind]) - overlap * sum(terms[f"hide_{kind}"]))
                objective.append(exposed)
    embed_comm: dict[str, float] = defaultdict(float)
    for emb, param in embeddings.items():
        embed_comm[param] += reduce_s(_reduced_bytes(nodes[emb], reduced_at, info))
    for param, cost in embed_comm.items():
        roles = role_vars(param, is_embedding=True)
        if VOCAB in roles:
            objective.append(cost * roles[VOCAB])
        if sp and REPLICATED in roles:  # a replicated table's gradient, all-reduced under SP
            objective.append(param_bytes[group_of(param)] * roles[REPLICATED])
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
    if fixed is None:
        solver.Add(sum(footprint) <= least * 1.01)
    solver.Minimize(sum(compute) + sum(objective))
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
        compute_s=sum(_value(e) for e in compute),
        comm_s=sum(_value(e) for e in objective),
    )


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


def _count(matmuls: dict, g: str) -> int:
    """Forward matmuls of weight group ``g`` (its gradient AR is charged once over them)."""
    return sum(1 for p, _ in matmuls.values() if group_of(p) == g)


def _node_seconds(graph: TrainingGraph, analysis: GraphAnalysis, cluster: Cluster, tp: int,
                  fused: bool) -> tuple[dict[str, float], dict[str, float]]:
    """Step seconds of every node at the captured batch, whole and split ``tp`` ways: the
    roofline of `cost.terms.compute.roofline_times` (the step model's) on the bytes
    `build_step_facts` counts (a fusion group's external inputs and outputs), in the
    cluster's default precision, slowed by `CostParams.framework_efficiency` as `predict` does."""
    groups = fusion_groups(graph, analysis) if fused else {}
    ext_inputs, leaves = external_bytes(graph, analysis, groups)
    names, flops, vflops, nbytes, is_matmul, launch = [], [], [], [], [], []
    for node in graph.gm.graph.nodes:
        if node.op != "call_function" or analysis.nodes[node.name].is_view:
            continue  # views launch no kernel and move no bytes
        i = analysis.nodes[node.name]
        names.append(node.name)
        flops.append(i.executed_flops)
        vflops.append(i.vector_flops)
        read = sum(analysis.nodes[a.name].nbytes for a in ext_inputs[node.name])
        nbytes.append(read + (i.bytes_written if leaves[node.name] else 0))
        is_matmul.append(i.is_matmul or i.flops > 0)
        launch.append(groups.get(node.name, node.name) == node.name)
    gpu = cluster.gpu
    f, v, b = (np.array(a, dtype=float) for a in (flops, vflops, nbytes))
    mm, ln = np.array(is_matmul, dtype=bool), np.array(launch, dtype=bool)
    dtype = np.full(f.shape, compute_dtype(gpu, default_precision(cluster)))
    out = []
    for div in (1, tp):
        t = (roofline_times(gpu, f / div, v / div, b / div, mm, ln, dtype,
                            cluster.params.gemm_half_scale)
             / cluster.params.framework_efficiency)
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
