"""Command line: ``dtree stats FILE.jsonl``, ``dtree bench ...``, ``dtree calibrate ...`` (see ``dtree -h``)."""

from __future__ import annotations

import argparse
import sys

__all__ = ["main"]


def _stats(args: argparse.Namespace) -> int:
    from .forest.forest import Forest

    forest = Forest.from_jsonl(args.file)
    print(forest.stats().format())
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dtree", description="Exact tree training for causal LMs.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("stats", help="print the tree statistics of a JSONL batch")
    p.add_argument("file", help="JSON Lines: one {\"tokens\": [...], <field>: [...]} object per sequence")
    p.set_defaults(func=_stats)

    from .bench.calibrate import add_calibrate_parser
    from .bench.runner import add_bench_parser

    add_bench_parser(sub)
    add_calibrate_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one command; bad input (a malformed or unreadable file, a bad option value)
    prints one ``dtree <cmd>: error: ...`` line and returns 2, as argparse does for bad
    arguments."""
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, OSError) as e:  # dtree's input errors, and files that cannot be opened
        message = " ".join(str(e).split())  # one line, whatever the message held
        print(f"dtree {args.command}: error: {message}", file=sys.stderr)
        return 2
