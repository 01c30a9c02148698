"""The ``flashwatch demo`` command: run the demo, then print its short report."""

from __future__ import annotations

from rich.console import Console

from .live import say
from .summary import report_lines
from .training import DemoError, run

__all__ = ["main"]


def main(args) -> int:
    """The ``flashwatch demo`` command (arguments from ``flashwatch.cli``)."""
    console = Console(highlight=False)
    try:
        result = run(steps=args.steps, seed=args.seed, device=args.device, port=args.port, run_dir=args.run_dir,
                     provoke=args.provoke, console=console)
    except DemoError as exc:
        say(Console(stderr=True, highlight=False), f"flashwatch demo: {exc}", style="bold red")
        return 2
    console.print()
    for i, line in enumerate(report_lines(result)):
        say(console, line, style="bold" if i == 0 else None)
    return 0
