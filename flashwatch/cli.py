"""The ``flashwatch`` command: ``flashwatch SUBCOMMAND --help`` describes each one."""

from __future__ import annotations

import argparse
import sys

from . import __version__


def _cmd_metrics(args: argparse.Namespace) -> int:
    from .metrics import markdown_table

    print(markdown_table())
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flashwatch", description=__doc__)
    parser.add_argument("--version", action="version", version=f"flashwatch {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    p = sub.add_parser("metrics", help="print the metric table (Markdown)")
    p.set_defaults(func=_cmd_metrics)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
