"""The ``flashwatch`` command: ``flashwatch SUBCOMMAND --help`` describes each one."""

from __future__ import annotations

import argparse
import os
import sys

from . import __version__


def _cmd_metrics(args: argparse.Namespace) -> int:
    from .metrics import markdown_table

    print(markdown_table())
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    from .bench import main as bench_main

    return bench_main(args)


def _cmd_experiment(args: argparse.Namespace) -> int:
    from .replay.cli import main as experiment_main  # imports torch: only when the command runs

    return experiment_main(args.rest)


def _cmd_demo(args: argparse.Namespace) -> int:
    try:
        import pytorch_lightning  # noqa: F401 - the demo trains with it
    except ImportError:
        print('flashwatch demo needs pytorch-lightning: pip install pytorch-lightning (from a flashwatch checkout: '
              'pip install ".[lightning]")', file=sys.stderr)
        return 2
    from .demo import main as demo_main  # imports torch and Lightning: only when the command runs

    return demo_main(args)


def _cmd_report(args: argparse.Namespace) -> int:
    from .report import main as report_main

    return report_main(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flashwatch", description="flashwatch: a stability monitor for BF16 "
                                     "transformer training. `flashwatch COMMAND --help` describes each command.")
    parser.add_argument("--version", action="version", version=f"flashwatch {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    p = sub.add_parser("demo", help="train a small GPT with flashwatch watching (about a minute on a CPU)",
                       description="Train a small byte-level GPT on the Python standard library's source with "
                                   "flashwatch's Lightning callback: Prometheus metrics on 127.0.0.1, a run folder, "
                                   "a live summary, a short report at the end.")
    p.add_argument("--steps", type=int, default=400, help="optimizer steps (default 400)")
    p.add_argument("--seed", type=int, default=0, help="seed of the model and the batches (default 0)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="default auto: cuda (flashwatch's Triton kernel) if available, else cpu (observe mode)")
    p.add_argument("--port", type=int, default=9400, help="Prometheus port on 127.0.0.1 (default 9400; 0: any free port)")
    p.add_argument("--run-dir", metavar="DIR", help="run folder (default runs/demo-<timestamp>/)")
    p.add_argument("--provoke", action="store_true",
                   help="early-warning scenario with an INJECTED fault in flashwatch's kernel (labelled INJECTED)")
    p.set_defaults(func=_cmd_demo)
    from .report.charts import HEATMAPS  # the report's own list (light: no torch, no numpy)

    p = sub.add_parser("report", help="render a run's metrics.jsonl as HTML (default) or PNG",
                       description="Loss with alert markers and per-head heatmaps over steps ("
                                   + "; ".join(h.title for h in HEATMAPS) + ") from a run folder's metrics.jsonl.")
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run folder (or its metrics.jsonl)")
    p.add_argument("--out", metavar="PATH",
                   help="output file, .html (self-contained) or .png (needs matplotlib); default RUN_DIR/report.html")
    p.set_defaults(func=_cmd_report)
    p = sub.add_parser("metrics", help="print the metric table (Markdown)",
                       description="Print every metric flashwatch exports (Prometheus, JSONL, loggers): name, type, "
                                   "labels, unit and meaning, as a Markdown table.")
    p.set_defaults(func=_cmd_metrics)
    p = sub.add_parser("bench", help="attention throughput of flashwatch's kernels vs torch SDPA (needs CUDA)",
                       description="Time forward+backward of flashwatch's kernels (plain, with statistics, with the "
                                   "W^Q-error chain, fixed, fp32_delta) against torch SDPA's flash and cuDNN "
                                   "backends in the same process, and print the ratios.")
    p.add_argument("--shape", action="append", metavar="B,H,N,D",
                   help="a shape to time (repeatable); default: 16,12,1024,64 8,16,2048,64 4,32,4096,128 1,32,16384,128, "
                        "then 16,12,1024,64 non-causal and in fp16")
    p.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    p.add_argument("--no-causal", action="store_true", help="time non-causal attention (default: causal)")
    p.add_argument("--quick", action="store_true", help="first two shapes, shorter timings")
    p.add_argument("--tune", action="store_true",
                   help="autotune block shapes per kernel (FLASHWATCH_AUTOTUNE=1) and print the chosen configs")
    p.add_argument("--device-time", action="store_true",
                   help="also time forward+backward replayed from a CUDA graph (GPU time alone, no Python "
                        "launch work) and print it beside the event timing")
    p.add_argument("--json", metavar="PATH", help="write all numbers as JSON")
    p.set_defaults(func=_cmd_bench)
    # everything after `experiment` goes to flashwatch.replay.cli (its own --help, subcommands)
    p = sub.add_parser("experiment", add_help=False, prefix_chars="\x00",
                       help="replay the detectors on recorded runs, calibrate thresholds (--help for the manual)")
    p.add_argument("rest", nargs="*")
    p.set_defaults(func=_cmd_experiment)
    return parser


def run_subcommand(parser: argparse.ArgumentParser, argv: list[str] | None = None) -> int:
    """Parse ``argv`` with ``parser``, whose subcommands set ``func``, and run the one named; no
    subcommand prints the help (exit status 2). Every flashwatch command line (this one, ``flashwatch
    experiment``, ``python -m research.experiments``) dispatches so."""
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return args.func(args)


def main(argv: list[str] | None = None) -> int:
    try:
        return run_subcommand(build_parser(), argv)
    except BrokenPipeError:  # the reader stopped early (`flashwatch metrics | head`): not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error when Python flushes
        return 0


if __name__ == "__main__":
    sys.exit(main())
