"""The `autopar` command line (also `python -m autopar`)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from autopar.errors import AutoparError


def _parse_tokens(text: str) -> int:
    """'1M' -> 1048576, '4k' -> 4096, '1000' -> 1000 (binary prefixes, as the playbook's 1M)."""
    text = text.strip().upper()
    mult = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
    number = text[:-1] if mult > 1 else text
    try:
        return int(float(number) * mult)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a token count: {text!r} (use e.g. 1M, 512K, 4096)") from None


def _write_json(path: str | None, data) -> None:
    if path:
        import os

        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "w") as f:
            json.dump(data, f, indent=2, default=str)
        print(f"wrote {path}")


def cmd_inspect(args: argparse.Namespace) -> int:
    from autopar.analysis.inspect_model import format_report, inspect_model

    print(f"capturing {args.model} (batch {args.batch}, seq {args.seq}, {args.dtype}) on fake tensors ...",
          flush=True)
    report, _, _ = inspect_model(args.model, batch=args.batch, seq=args.seq, dtype=args.dtype)
    print(format_report(report))
    _write_json(args.json, report.to_dict())
    return 0


def _cluster(args: argparse.Namespace):
    from cost import Cluster

    if args.cluster == "local":
        return Cluster.local()
    return Cluster(args.cluster, nodes=args.nodes, gpus_per_node=args.gpus_per_node)


def _layout_from_args(args: argparse.Namespace):
    """A manual Layout from --layout 'dp=8,tp=8,zero=1,sp=1,...' (None if not given)."""
    if not args.layout:
        return None
    from cost import Layout

    fields = {}
    for item in args.layout.split(","):
        key, _, value = item.partition("=")
        key = key.strip()
        if key in ("sp", "fp32_grad_accum"):
            fields[key] = value.strip().lower() in ("1", "true", "yes", "on")
        elif key in ("schedule", "recompute", "precision"):
            fields[key] = value.strip()
        else:
            try:
                fields[key] = int(value)
            except ValueError:
                raise argparse.ArgumentTypeError(f"--layout {item!r}: {key} takes an integer") from None
    return Layout.from_dict(fields)


def cmd_plan(args: argparse.Namespace) -> int:
    import torch

    from autopar import models
    from autopar.planning.planner import plan

    cluster = _cluster(args)
    seq = args.seq
    if args.global_batch_tokens % seq:
        raise ValueError(
            f"--global-batch-tokens {args.global_batch_tokens:,} is not a whole number of "
            f"sequences of {seq}: use a multiple of {seq}"
        )
    batch = args.global_batch_tokens // seq
    # a GPU model is planned in bf16; CPU ranks train the zoo's fp32 models
    dtype = torch.float32 if cluster.gpu.is_cpu else torch.bfloat16
    model = models.build(args.model, device="meta", dtype=dtype)
    inputs = models.example_inputs(args.model, batch=batch, seq=seq, device="meta")
    progress = (lambda line: print(line, file=sys.stderr, flush=True)) if not args.quiet else None
    result = plan(model, inputs, cluster=cluster, layout=_layout_from_args(args), progress=progress,
                  **({"allow_fp8": True} if args.fp8 else {}))
    print(result.summary())
    if args.layout is None:
        print()
        print(result.compare_manual())
    if args.json:
        with open(args.json, "w") as f:
            f.write(result.to_json())
        print(f"wrote {args.json}")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    if args.what == "cost-model":
        from autopar.bench.cost_model import format_cost_model_bench, run_cost_model_bench

        result = run_cost_model_bench(quick=args.quick)
        print(format_cost_model_bench(result))
    elif args.what == "block-check":
        from autopar.bench.block import block_check, format_block_check

        result = block_check(args.measured) if args.measured else block_check()
        print(format_block_check(result))
    elif args.what == "runtime":
        from autopar.bench.runtime import format_runtime_bench, run_runtime_bench

        result = run_runtime_bench(quick=args.quick, calibration=args.calibration)
        print(format_runtime_bench(result))
    elif args.what == "solver":
        from autopar.bench.solver import format_solver_bench, run_solver_bench

        result = run_solver_bench(quick=args.quick)
        print(format_solver_bench(result))
    else:  # argparse restricts the choices
        raise ValueError(args.what)
    _write_json(args.json or f"results/bench-{args.what}.json", result)
    return 0


def _dump_worker(rank: int, world: int, name: str, batch: int, seq: int, layout_text: str | None) -> str:
    import autopar
    from autopar import models

    ns = argparse.Namespace(layout=layout_text)
    layout = _layout_from_args(ns)
    model = models.build(name, seed=0)
    inputs = models.example_inputs(name, batch=batch, seq=seq)
    pm = autopar.parallelize(model, world, example_inputs=inputs, layout=layout)
    return pm.dump_graph(rank=rank)


def cmd_dump(args: argparse.Namespace) -> int:
    from runtime.launch import spawn

    if args.rank >= args.world:
        raise ValueError(f"--rank {args.rank} is outside a world of {args.world} ranks")
    texts = spawn(_dump_worker, args.world, args=(args.model, args.batch, args.seq, args.layout),
                  timeout_s=600)
    print(texts[args.rank])
    return 0


def cmd_calibrate(args: argparse.Namespace) -> int:
    from autopar.calibrate.local import calibrate, format_calibration

    data = calibrate(world_sizes=tuple(args.ranks), path=args.out, quick=args.quick)
    print(format_calibration(data))
    return 0


def build_parser() -> argparse.ArgumentParser:
    """All sub-commands and their options."""
    parser = argparse.ArgumentParser(prog="autopar", description="Automatic parallelisation of PyTorch training.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("inspect", help="capture a zoo model's training step and report its costs")
    p.add_argument("--model", required=True, help="zoo name, e.g. llama3-8b (see autopar.models.names())")
    p.add_argument("--seq", type=int, default=4096, help="sequence length (default 4096)")
    p.add_argument("--batch", type=int, default=1, help="sequences in the step (default 1)")
    p.add_argument("--dtype", default="bf16", choices=["fp32", "bf16", "fp16"], help="parameter dtype")
    p.add_argument("--json", help="also write the report as JSON to this path")
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser("calibrate", help="measure this machine for Cluster.local()")
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4], help="gloo world sizes to time")
    p.add_argument("--out", help="calibration file (default ~/.cache/autopar/calibration.json)")
    p.add_argument("--quick", action="store_true", help="fewer sizes and repeats (~20 s)")
    p.set_defaults(func=cmd_calibrate)

    p = sub.add_parser("plan", help="choose (or evaluate) the parallel layout of a zoo model on a cluster")
    p.add_argument("--model", required=True, help="zoo name, e.g. llama3-8b")
    p.add_argument("--cluster", default="h100", help="profile: h100, h100-efa, h200, a100, or local")
    p.add_argument("--nodes", type=int, default=1, help="nodes in the cluster (default 1)")
    p.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node (default 8)")
    p.add_argument("--seq", type=int, default=4096, help="sequence length (default 4096)")
    p.add_argument("--global-batch-tokens", type=_parse_tokens, default=2**20,
                   help="tokens per optimizer step, e.g. 1M (default 1M = 1,048,576)")
    p.add_argument("--layout", help="evaluate a manual layout instead, e.g. dp=8,tp=8,zero=1,sp=1,microbatch=2,grad_accum=16")
    p.add_argument("--fp8", action="store_true", help="let the solver run matmuls in FP8")
    p.add_argument("--json", help="write the plan as JSON to this path")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("dump", help="run the plan on local gloo ranks and print one rank's graph")
    p.add_argument("--model", required=True, help="zoo name (weights are initialised: keep it small)")
    p.add_argument("--world", type=int, default=2, help="gloo ranks to start (default 2)")
    p.add_argument("--rank", type=int, default=0, help="whose graph to print")
    p.add_argument("--batch", type=int, default=4, help="global batch (sequences)")
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--layout", help="e.g. dp=2,zero=3,microbatch=2,precision=fp32 (default: the solver's)")
    p.set_defaults(func=cmd_dump)

    p = sub.add_parser("bench", help="benchmarks: tables plus JSON in results/")
    p.add_argument("what", choices=["cost-model", "block-check", "solver", "runtime"])
    p.add_argument("--quick", action="store_true", help="fewer points")
    p.add_argument("--measured", help="block-check: JSON written by examples/gpu_block_check.py")
    p.add_argument("--calibration", help="runtime: predict with this `autopar calibrate` file "
                   "(default: calibrate now, with the bench's ranks)")
    p.add_argument("--json", help="where to write the results (default results/bench-WHAT.json)")
    p.set_defaults(func=cmd_bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `autopar` console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except AutoparError as exc:
        print(f"autopar {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except (KeyError, ValueError) as exc:
        message = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
        print(f"autopar {args.command}: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
