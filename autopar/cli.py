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
        with open(path, "w") as f:
            json.dump(data, f, indent=2, default=str)
        print(f"wrote {path}")


def cmd_inspect(args: argparse.Namespace) -> int:
    from autopar.inspect_model import format_report, inspect_model

    print(f"capturing {args.model} (batch {args.batch}, seq {args.seq}, {args.dtype}) on fake tensors ...",
          flush=True)
    report, _, _ = inspect_model(args.model, batch=args.batch, seq=args.seq, dtype=args.dtype)
    print(format_report(report))
    _write_json(args.json, report.to_dict())
    return 0


def cmd_calibrate(args: argparse.Namespace) -> int:
    from autopar.calibrate import calibrate, format_calibration

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
