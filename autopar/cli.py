"""The `autopar` command line (also `python -m autopar`).

Every mistake a user can make on the command line ends in one paragraph on stderr,
``autopar: error: <problem>; fix: <what to type instead>``, and exit code 2, without a
traceback. Cheap arguments (numbers, names, the layout's syntax, values and degrees) are
checked before any model is built or captured. An unexpected exception is a bug and keeps its
traceback. ``--verbose`` (or ``AUTOPAR_VERBOSE=1``) adds the full text behind a short message,
e.g. the failing rank's traceback of ``autopar dump``.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import functools
import importlib
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from autopar.errors import AutoparError, InputError
from autopar.models.configs import ModelConfig, UnknownModelError
from vocab.layout import (
    FP8_CHOICES,
    FP8_RECIPES,
    PRECISIONS,
    RECOMPUTE,
    SCHEDULES,
    Layout,
    LayoutError,
    unsupported_decisions,
)

# The longest --seq used when none is given; a model with a shorter limit gets its own.
DEFAULT_SEQ = 4096
_VERBOSE_ENV = "AUTOPAR_VERBOSE"


class UsageError(InputError):
    """An argument that cannot work: the message names the flag, the problem and the fix."""


class CommandError(AutoparError):
    """A command that failed for a reason the user can act on; ``details`` is the long text."""

    def __init__(self, message: str, details: str | None = None) -> None:
        super().__init__(message)
        self.details = details


class _Parser(argparse.ArgumentParser):
    """argparse that raises `UsageError` instead of printing usage and exiting."""

    def error(self, message: str):  # type: ignore[override]
        fix = "" if "fix:" in message else f"; fix: see `{self.prog} --help`"
        raise UsageError(f"{message}{fix}")


# ---------------------------------------------------------------------------------- checks


def _parse_tokens(text: str) -> int:
    """'1M' -> 1048576, '4k' -> 4096, '1000' -> 1000 (binary prefixes, as the playbook's 1M)."""
    text = text.strip().upper()
    mult = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
    number = text[:-1] if mult > 1 else text
    try:
        tokens = int(float(number) * mult)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a token count; fix: write e.g. 1M, 512K or 4096") from None
    if tokens < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a step needs at least 1 token; fix: write "
                                         "e.g. 1M")
    return tokens


def _positive(flag: str, value: int, what: str) -> int:
    """``value`` if it is >= 1, else a `UsageError` naming ``flag``."""
    if value < 1:
        raise UsageError(f"{flag} {value}: {what} must be at least 1; fix: pass {flag} 1 or more")
    return value


def _model_config(name: str) -> ModelConfig:
    """The zoo config of ``--model name``, or a `UsageError` listing the known names."""
    from autopar import models

    try:
        return models.config(name)
    except UnknownModelError as exc:
        raise UsageError(f"--model {name!r}: {exc.message}; fix: pass one of these names, "
                         "e.g. --model gpt2") from None


def _note(text: str) -> None:
    print(f"autopar: note: {text}", file=sys.stderr, flush=True)


def _seq(seq: int | None, cfg: ModelConfig) -> int:
    """``--seq``, checked against the model's limit; by default min(4096, that limit)."""
    if seq is None:
        seq = min(DEFAULT_SEQ, cfg.max_seq)
        if seq < DEFAULT_SEQ:
            _note(f"{cfg.name} takes at most {cfg.max_seq} tokens per sequence, so --seq "
                  f"defaults to {seq} (not {DEFAULT_SEQ})")
        return seq
    if not 0 < seq <= cfg.max_seq:
        raise UsageError(f"--seq {seq}: {cfg.name} takes sequences of 1 to {cfg.max_seq} tokens; "
                         f"fix: pass --seq between 1 and {cfg.max_seq}, or leave it out for "
                         f"{min(DEFAULT_SEQ, cfg.max_seq)}")
    return seq


def _batch_of(tokens: int, seq: int) -> int:
    """Sequences per step of ``--global-batch-tokens``: it must hold whole sequences."""
    if tokens % seq:
        suggestion = max(seq, round(tokens / seq) * seq)
        raise UsageError(f"--global-batch-tokens {tokens:,} is not a whole number of sequences of "
                         f"{seq} tokens; fix: use a multiple of {seq}, e.g. {suggestion:,}, or "
                         "another --seq")
    return tokens // seq


def _cluster(args: argparse.Namespace):
    """The `Cluster` of --cluster/--nodes/--gpus-per-node, each checked first."""
    from cost import PROFILES, Cluster

    if getattr(args, "profile", None):
        nodes = _positive("--nodes", args.nodes, "the number of nodes")
        gpus = _positive("--gpus-per-node", args.gpus_per_node, "the number of GPUs per node")
        try:
            return Cluster.from_profile(args.profile, nodes=nodes, gpus_per_node=gpus)
        except (FileNotFoundError, ValueError) as exc:
            raise UsageError(f"--profile {args.profile}: {exc}") from None
    name = args.cluster.strip().lower()
    if name == "local":
        return Cluster.local()
    if name not in PROFILES:
        close = difflib.get_close_matches(name, [*PROFILES, "local"], n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise UsageError(f"--cluster {args.cluster!r} is not a known cluster profile{hint}; fix: "
                         f"choose one of {', '.join(PROFILES)}, or local (this machine, measured by "
                         "`autopar calibrate`)")
    nodes = _positive("--nodes", args.nodes, "the number of nodes")
    gpus = _positive("--gpus-per-node", args.gpus_per_node, "the number of GPUs per node")
    return Cluster(name, nodes=nodes, gpus_per_node=gpus)


# ---------------------------------------------------------------------------------- layouts

_BOOL_FIELDS = ("sp", "fp32_grad_accum", "reshard", "regather", "cp_balance")
_CHOICE_FIELDS = {"schedule": SCHEDULES, "recompute": RECOMPUTE, "precision": PRECISIONS,
                  "fp8_recipe": FP8_RECIPES}
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")
_LAYOUT_FIELDS = [f.name for f in dataclasses.fields(Layout)]
_LAYOUT_EXAMPLE = "--layout dp=8,tp=2,zero=1,sp=1,microbatch=2"


def _layout_value(key: str, value: str):
    """The typed value of one ``key=value`` of --layout, or a `UsageError` with the fix."""
    if key in _BOOL_FIELDS:
        if value.lower() in _TRUE + _FALSE:
            return value.lower() in _TRUE
        raise UsageError(f"--layout {key}={value}: {key} is on or off; fix: write {key}=1 or {key}=0")
    if key == "fp8":  # none | auto | all, or weight names / patterns joined by "+"
        return value if value in FP8_CHOICES else tuple(v for v in value.split("+") if v)
    if key == "recompute" and value not in RECOMPUTE and ("." in value or ":" in value):
        # matmul / attention groups joined by "+": selective plus their outputs
        return tuple(v for v in value.split("+") if v)
    if key in _CHOICE_FIELDS:
        choices = _CHOICE_FIELDS[key]
        if value in choices:
            return value
        raise UsageError(f"--layout {key}={value}: not a known {key}; fix: choose one of "
                         f"{', '.join(choices)}")
    try:
        number = int(value)
    except ValueError:
        number = None
    if key == "zero":
        if number not in (0, 1, 2, 3):
            raise UsageError(f"--layout zero={value}: the ZeRO stage must be 0, 1, 2 or 3; fix: "
                             "write zero=1 (optimizer states sharded), zero=2 (+ gradients) or "
                             "zero=3 (+ weights)")
        return number
    if number is None or number < 1:
        raise UsageError(f"--layout {key}={value}: {key} takes a whole number of at least 1; "
                         f"fix: write e.g. {key}=2")
    return number


def parse_layout(text: str) -> Layout:
    """A manual `Layout` from --layout text such as ``dp=8,tp=8,zero=1,sp=1``."""
    fields: dict[str, object] = {}
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        key, eq, value = (part.strip() for part in item.partition("="))
        if not eq or not key or not value:
            raise UsageError(f"--layout {text!r}: {item!r} is not key=value; fix: write e.g. "
                             f"{_LAYOUT_EXAMPLE}")
        if key not in _LAYOUT_FIELDS:
            close = difflib.get_close_matches(key, _LAYOUT_FIELDS, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise UsageError(f"--layout: {key!r} is not a layout field{hint}; fix: use only "
                             f"{', '.join(_LAYOUT_FIELDS)}")
        if key in fields:
            raise UsageError(f"--layout {text!r} sets {key} twice; fix: give each field once")
        fields[key] = _layout_value(key, value)
    if not fields:
        raise UsageError(f"--layout {text!r} sets nothing; fix: write e.g. {_LAYOUT_EXAMPLE}, "
                         "or leave --layout out to let the solver choose")
    try:
        return Layout.from_dict(fields)
    except LayoutError as exc:
        raise UsageError(f"--layout {text!r}: {exc}") from None


def _layout_from_args(args: argparse.Namespace) -> Layout | None:
    """A manual Layout from --layout 'dp=8,tp=8,zero=1,sp=1,...' (None if not given)."""
    return parse_layout(args.layout) if args.layout else None


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def _check_layout_fits(layout: Layout, ranks: int, where: str, cfg: ModelConfig, seq: int) -> None:
    """Degrees that cannot run ``cfg`` on ``ranks`` ranks (``where`` says whose), caught before
    any capture."""
    degrees = f"dp*cp*pp*tp = {layout.dp}*{layout.cp}*{layout.pp}*{layout.tp} = {layout.world_size}"
    if layout.world_size != ranks:
        raise UsageError(f"--layout {layout.short()} uses {degrees} ranks but {where}; fix: choose "
                         f"degrees that multiply to {ranks}")
    if cfg.n_heads % layout.tp:
        raise UsageError(f"--layout tp={layout.tp}: {cfg.name} has {cfg.n_heads} attention heads "
                         f"and tensor parallelism splits them, so tp must divide {cfg.n_heads}; "
                         f"fix: use tp = one of {_divisors(cfg.n_heads)}")
    if layout.pp > cfg.n_layers:
        raise UsageError(f"--layout pp={layout.pp}: {cfg.name} has only {cfg.n_layers} layers to "
                         f"cut into pipeline stages; fix: use pp <= {cfg.n_layers}")
    if layout.ep > 1 and (not cfg.n_experts or cfg.n_experts % layout.ep):
        raise UsageError(f"--layout ep={layout.ep}: {cfg.name} has {cfg.n_experts} experts; fix: "
                         "use ep=1, or an ep that divides the expert count of an MoE model")
    if seq % layout.cp:
        raise UsageError(f"--layout cp={layout.cp}: context parallelism splits the sequence of "
                         f"{seq} tokens, which cp must divide; fix: use a cp that divides {seq}")


# ---------------------------------------------------------------------------------- commands


def _check_batch_splits(layout: Layout, batch: int, what: str) -> None:
    """``batch`` sequences split into the layout's dp ranks x microbatch x grad_accum, or a
    `UsageError` naming the fix."""
    head = f"--layout {layout.short()} with {what}"
    dp, mb, ga = layout.dp, layout.microbatch, layout.grad_accum
    if batch % dp:
        raise UsageError(f"{head}: dp={dp} does not divide the batch of {batch} sequences; fix: a dp "
                         f"that divides it, or a --global-batch-tokens of a multiple of {dp} sequences")
    per_rank = batch // dp
    for name, value in (("microbatch", mb), ("grad_accum", ga)):
        if value is not None and per_rank % value:
            raise UsageError(f"{head}: each of the dp={dp} ranks gets {per_rank} sequences, which do "
                             f"not split by {name}={value}; fix: a {name} that divides {per_rank} "
                             f"(one of {_divisors(per_rank)}), or leave {name} out")
    if mb is not None and ga is not None and mb * ga != per_rank:
        raise UsageError(f"{head}: dp={dp} x microbatch={mb} x grad_accum={ga} = {dp * mb * ga} "
                         f"sequences, not {batch}; fix: microbatch x grad_accum = {per_rank}, or give "
                         "only one of them")


def _does_not_fit(result) -> str:
    """One line for a manual layout whose predicted memory exceeds a device's: by how much,
    the largest part, and the knobs that shrink that part."""
    from autopar.report import fmt_bytes

    p, lay = result.predicted, result.layout
    mem = p.memory_breakdown
    state = mem["params"] + mem["grads"] + mem["optimizer"]
    knobs = []
    if state >= mem["activations"]:
        largest = f"weights, gradients and optimizer state {fmt_bytes(state)}"
        if lay.zero < 3 and lay.dp > 1:
            knobs.append("zero=3")
        knobs.append("a larger tp or pp")
    else:
        largest = f"activations {fmt_bytes(mem['activations'])}"
        if lay.recompute != "full":
            knobs.append("recompute=full")
        if lay.microbatch and lay.microbatch > 1:
            knobs.append(f"microbatch={lay.microbatch // 2},grad_accum={lay.grad_accum * 2}")
        if lay.tp > 1 and not lay.sp:
            knobs.append("sp=1")
        knobs.append("a larger tp, pp or cp")
    return (f"--layout {lay.short()} does not fit: {fmt_bytes(p.memory_per_device_bytes)} per device "
            f"of {fmt_bytes(p.memory_capacity_bytes)}, "
            f"{fmt_bytes(p.memory_per_device_bytes - p.memory_capacity_bytes)} short (largest: {largest}); "
            f"fix: {', or '.join(knobs)}, or leave --layout out for the solver's plan")


def _write_json(path: str | None, data) -> None:
    if path:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "w") as f:
            json.dump(data, f, indent=2, default=str)
        print(f"wrote {path}")


def cmd_inspect(args: argparse.Namespace) -> int:
    """Capture a zoo model's step on fake tensors and print its costs."""
    cfg = _model_config(args.model)
    seq = _seq(args.seq, cfg)
    batch = _positive("--batch", args.batch, "the number of sequences")
    from autopar.analysis.inspect_model import format_report, inspect_model

    print(f"capturing {args.model} (batch {batch}, seq {seq}, {args.dtype}) on fake tensors ...",
          flush=True)
    report, _, _ = inspect_model(args.model, batch=batch, seq=seq, dtype=args.dtype)
    print(format_report(report))
    _write_json(args.json, report.to_dict())
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    """Plan (or evaluate --layout on) a zoo model on a cluster; nothing runs."""
    cfg = _model_config(args.model)
    layout = _layout_from_args(args)
    cluster = _cluster(args)
    seq = _seq(args.seq, cfg)
    batch = _batch_of(args.global_batch_tokens, seq)
    if layout is not None:
        nodes = f"{cluster.nodes} node{'s' if cluster.nodes > 1 else ''}"
        where = f"the cluster has {cluster.world_size} ({nodes} x {cluster.gpus_per_node} GPUs)"
        _check_layout_fits(layout, cluster.world_size, where, cfg, seq)
        _check_batch_splits(layout, batch, f"--global-batch-tokens {args.global_batch_tokens:,} "
                            f"(= {batch} sequences of {seq})")
    # only now the heavy imports (torch alone takes seconds): a bad argument answers at once
    import torch

    from autopar import models
    from autopar.planning.planner import plan

    # a GPU model is planned in bf16; CPU ranks train the zoo's fp32 models
    dtype = torch.float32 if cluster.gpu.is_cpu else torch.bfloat16
    model = models.build(args.model, device="meta", dtype=dtype)
    inputs = models.example_inputs(args.model, batch=batch, seq=seq, device="meta")
    progress = (lambda line: print(line, file=sys.stderr, flush=True)) if not args.quiet else None
    result = plan(model, inputs, cluster=cluster, layout=layout, progress=progress,
                  **({"allow_fp8": True} if args.fp8 else {}))
    if layout is not None and not result.predicted.fits:
        print(result.summary())  # how memory splits, then the error with the fix
        raise CommandError(_does_not_fit(result))
    print(result.summary())
    if args.layout is None:
        print()
        print(result.compare_manual())
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as f:
            f.write(result.to_json())
        print(f"wrote {args.json}")
    if args.trace or args.report:
        from autopar.planning.report_html import write_plan_outputs

        for path in (args.trace, args.report):
            if path:
                os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        for path in write_plan_outputs(result, trace=args.trace, report=args.report):
            print(f"wrote {path}")
    return 0


def _benches() -> dict | None:
    """The benchmarks' registry (`bench.BENCHES`), or None where there is none.

    Benchmarks are not part of the installed package: they live in the repository's top-level
    ``bench/`` folder, found beside the ``autopar`` package of a clone (an editable install, or
    ``python -m autopar`` run in its root)."""
    root = Path(__file__).resolve().parents[1]
    if not (root / "bench" / "__init__.py").is_file():
        return None
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    return importlib.import_module("bench").BENCHES


# the options only some benchmarks read: any other would ignore them
_BENCH_OPTIONS = {"runs": ("playbook", "published"), "measured": ("block-check",),
                  "calibration": ("runtime",)}


def cmd_bench(args: argparse.Namespace) -> int:
    benches = _benches()
    if benches is None:
        raise InputError("the benchmarks are not installed with the package: they live in the "
                         "repository's bench/ folder; fix: clone the repository, `pip install -e .` "
                         "there and run `autopar bench ...` (or `python -m autopar bench ...`)")
    if args.what not in benches:
        raise InputError(f"no benchmark {args.what!r}; fix: one of {', '.join(sorted(benches))}")
    for option, takers in _BENCH_OPTIONS.items():
        if getattr(args, option, None) and args.what not in takers:
            raise InputError(f"bench {args.what} takes no --{option}; fix: drop it (it is for "
                             f"bench {' and '.join(takers)})")
    from autopar.calibrate.runs import RunsError

    try:
        result, table = benches[args.what](args)
    except RunsError as exc:  # a runs file it cannot use: the message names the row and fix
        raise InputError(f"{exc}") from None
    print(table)
    _write_json(args.json or f"results/bench-{args.what}.json", result)
    return 0


def _dump_worker(rank: int, world: int, name: str, batch: int, seq: int,
                 layout_text: str | None) -> str:
    import torch.distributed

    import autopar
    from autopar import models

    layout = parse_layout(layout_text) if layout_text else None
    model = models.build(name, seed=0)
    inputs = models.example_inputs(name, batch=batch, seq=seq)
    pm = autopar.parallelize(model, world, example_inputs=inputs, layout=layout)
    text = pm.dump_graph(rank=rank)
    # Nothing above needs a collective after the meshes are built, so without this a fast rank
    # 0 exits and takes the rendezvous store with it while a slower rank is still building its
    # groups (a "Broken pipe" in that rank).
    torch.distributed.barrier()
    return text


_DUMP_TIMEOUT_S = 600


def _check_dump_args(args: argparse.Namespace) -> None:
    """Everything `autopar dump` can check before it starts a single rank."""
    cfg = _model_config(args.model)
    world = _positive("--world", args.world, "the number of ranks")
    if not 0 <= args.rank < world:
        raise UsageError(f"--rank {args.rank} is outside a world of {world} ranks; fix: pass "
                         f"--rank between 0 and {world - 1}, or a larger --world")
    _positive("--batch", args.batch, "the number of sequences")
    _seq(args.seq, cfg)
    layout = _layout_from_args(args)
    if layout is not None:
        _check_layout_fits(layout, world, f"--world {world} starts {world}", cfg, args.seq)
        try:
            layout.resolve(args.batch)
        except LayoutError as exc:
            raise UsageError(f"--layout with --batch {args.batch}: {exc}") from None
        _check_executable(layout)


def _check_executable(layout: Layout) -> None:
    """`autopar dump` runs the layout: refuse what the runtime cannot execute, before spawning."""
    missing = unsupported_decisions(layout)
    if layout.precision not in (None, "fp32", "fp8"):
        missing.append(f"precision={layout.precision} on the zoo's fp32 weights")
    if missing:
        raise UsageError(f"--layout {layout.short()}: the ranks cannot execute "
                         f"{'; '.join(missing)} yet; fix: dump a DP / ZeRO / TP / TP+SP layout "
                         "(any recompute), a pipeline with ZeRO 0 or 1, cp with DP, ZeRO, TP+SP or pipelines, ep with DP, "
                         "precision=fp32, or see its predictions with `autopar plan --layout ...`")


def _rank_failure(exc) -> CommandError:
    """One paragraph for a failed rank: who failed and the root cause, not the traceback."""
    summary = " ".join(line.strip() for line in exc.summary.splitlines() if line.strip())
    return CommandError(f"rank {exc.rank} failed: {summary} (for the rank's full traceback, "
                        f"rerun with --verbose or {_VERBOSE_ENV}=1)", details=str(exc))


def cmd_dump(args: argparse.Namespace) -> int:
    """Run the plan on local gloo ranks and print one rank's graph."""
    _check_dump_args(args)
    from runtime.launch import RankFailedError, spawn

    try:
        texts = spawn(_dump_worker, args.world,
                      args=(args.model, args.batch, args.seq, args.layout),
                      timeout_s=_DUMP_TIMEOUT_S)
    except RankFailedError as exc:
        raise _rank_failure(exc) from None
    except TimeoutError as exc:
        raise CommandError(f"{exc}; fix: dump a smaller --model (e.g. tiny-llama), --batch or "
                           "--seq, or fewer --world ranks") from None
    print(texts[args.rank])
    return 0


def cmd_calibrate(args: argparse.Namespace) -> int:
    if args.runs:
        return _calibrate_runs(args)
    from autopar.calibrate.local import calibrate, format_calibration

    data = calibrate(world_sizes=tuple(args.ranks), path=args.out, quick=args.quick)
    print(format_calibration(data))
    return 0


def _calibrate_runs(args: argparse.Namespace) -> int:
    """`autopar calibrate --runs FILE --cluster NAME -o PROFILE`: fit the cost parameters."""
    from autopar.calibrate.fit import fit_profile, format_fit
    from autopar.calibrate.runs import RunsError
    from cost import PROFILES

    name = args.cluster.strip().lower()
    if name not in PROFILES:
        raise UsageError(f"--cluster {args.cluster!r} is not a known cluster profile; fix: choose "
                         f"the profile whose links the runs ran on, one of {', '.join(PROFILES)}")
    out = args.out or "profile.json"
    gpus = _positive("--gpus-per-node", args.gpus_per_node, "the number of GPUs per node")
    try:
        result = fit_profile(args.runs, name, out, gpus_per_node=gpus,
                             progress=None if args.quiet else print)
    except RunsError as exc:
        raise UsageError(f"{exc}") from None
    print(format_fit(result))
    print(f"wrote {out}; plan with it: autopar plan --profile {out} --nodes N ... or "
          f"autopar.Cluster.from_profile({out!r}, nodes=N)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """All sub-commands and their options."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--verbose", action="store_true",
                        help=f"on an error, also print the full text (or set {_VERBOSE_ENV}=1)")
    parser = _Parser(prog="autopar", description="Automatic parallelisation of PyTorch training.",
                     parents=[common])
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    add = functools.partial(sub.add_parser, parents=[common])  # every command takes --verbose

    p = add("inspect", help="capture a zoo model's training step and report its costs")
    p.add_argument("--model", required=True, help="zoo name, e.g. llama3-8b (see autopar.models.names())")
    p.add_argument("--seq", type=int, default=None,
                   help="sequence length (default: 4096, or the model's maximum if shorter)")
    p.add_argument("--batch", type=int, default=1, help="sequences in the step (default 1)")
    p.add_argument("--dtype", default="bf16", choices=["fp32", "bf16", "fp16"], help="parameter dtype")
    p.add_argument("--json", help="also write the report as JSON to this path")
    p.set_defaults(func=cmd_inspect)

    p = add("calibrate", help="measure this machine for Cluster.local(), or (--runs) fit the "
            "cost model to a cluster's measured runs")
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4], help="gloo world sizes to time")
    p.add_argument("--out", "-o", help="calibration file (default ~/.cache/autopar/calibration.json)"
                   "; with --runs the profile to write (default profile.json)")
    p.add_argument("--quick", action="store_true", help="fewer sizes and repeats (~20 s)")
    p.add_argument("--runs", help="a CSV of measured runs (model,nodes,dp,tp,pp,zero,mbs,grad_acc,"
                   "tok_s_gpu[,gpu_mem_gb,seq,cp]; see autopar/calibrate/runs.py): fit the cost "
                   "model's parameters to them")
    p.add_argument("--cluster", default="h100-efa", help="--runs: the profile of the cluster "
                   "they ran on (default h100-efa)")
    p.add_argument("--gpus-per-node", type=int, default=8, help="--runs: GPUs per node (default 8)")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    p.set_defaults(func=cmd_calibrate)

    p = add("plan", help="choose (or evaluate) the parallel layout of a zoo model on a cluster")
    p.add_argument("--model", required=True, help="zoo name, e.g. llama3-8b")
    p.add_argument("--cluster", default="h100", help="profile: h100, h100-efa, h200, a100, or local")
    p.add_argument("--nodes", type=int, default=1, help="nodes in the cluster (default 1)")
    p.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node (default 8)")
    p.add_argument("--profile", help="a fitted cost profile (`autopar calibrate --runs ... -o "
                   "FILE`): its cluster and parameters instead of --cluster's")
    p.add_argument("--seq", type=int, default=None,
                   help="sequence length (default: 4096, or the model's maximum if shorter)")
    p.add_argument("--global-batch-tokens", type=_parse_tokens, default=2**20,
                   help="tokens per optimizer step, e.g. 1M (default 1M = 1,048,576)")
    p.add_argument("--layout", help="evaluate a manual layout instead, e.g. dp=8,tp=8,zero=1,sp=1,microbatch=2,grad_accum=16")
    p.add_argument("--fp8", action="store_true", help="let the solver run matmuls in FP8")
    p.add_argument("--json", help="write the plan as JSON to this path")
    p.add_argument("--trace", help="write the predicted step as Chrome trace-event JSON (Perfetto)")
    p.add_argument("--report", help="write a self-contained HTML report of the plan")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    p.set_defaults(func=cmd_plan)

    p = add("dump", help="run the plan on local gloo ranks and print one rank's graph")
    p.add_argument("--model", required=True, help="zoo name (weights are initialised: keep it small)")
    p.add_argument("--world", type=int, default=2, help="gloo ranks to start (default 2)")
    p.add_argument("--rank", type=int, default=0, help="whose graph to print")
    p.add_argument("--batch", type=int, default=4, help="global batch (sequences)")
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--layout", help="e.g. dp=2,zero=3,microbatch=2,precision=fp32 (default: the solver's)")
    p.set_defaults(func=cmd_dump)

    p = add("bench", help="benchmarks: tables plus JSON in results/")
    p.add_argument("what", choices=sorted(_benches() or {}) or None)
    p.add_argument("--quick", action="store_true", help="fewer points")
    p.add_argument("--measured", help="block-check: JSON written by examples/gpu_block_check.py")
    p.add_argument("--calibration", help="runtime: predict with this `autopar calibrate` file "
                   "(default: calibrate now, with the bench's ranks)")
    p.add_argument("--runs", help="playbook: a runs CSV (default: the playbook's 1B/8B runs); "
                   "published: a published-runs CSV (default: the calibration file, "
                   "bench/data/published-runs-calibration.csv)")
    p.add_argument("--json", help="where to write the results (default results/bench-WHAT.json)")
    p.set_defaults(func=cmd_bench)
    return parser


def _verbose(argv: Sequence[str] | None) -> bool:
    words = sys.argv[1:] if argv is None else list(argv)
    return "--verbose" in words or os.environ.get(_VERBOSE_ENV, "").strip() not in ("", "0")


_USER_ERRORS = (AutoparError, LayoutError, UnknownModelError)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `autopar` console script: 0 on success, 2 on a user's error."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        return args.func(args)
    except _USER_ERRORS as exc:
        details = getattr(exc, "details", None)
        if details and _verbose(argv):
            print(details, file=sys.stderr)
        message = exc.message if isinstance(exc, UnknownModelError) else str(exc)
        print(f"autopar: error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("autopar: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
