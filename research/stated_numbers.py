"""The early-warning numbers the README and docs/EXPERIMENTS.md state, made from the result files.

    python -m research.stated_numbers          # check: exit 1 and say what differs
    python -m research.stated_numbers --write  # rewrite the stated blocks from the result files

Each block is generated from a file in results/ (``research.early_warning``'s test result) and
held equal to it by tests/test_stated_numbers.py, so no number about the early warning is typed
by hand.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import textwrap
from pathlib import Path

from research.early_warning import readme_paragraph

ROOT = Path(__file__).resolve().parents[1]
TEST_1 = ROOT / "results/seed-split-2026-12-01/test.json"
TEST_1_TABLE = ROOT / "results/seed-split-2026-12-01/test.md"
CONFIG_1 = ("Pre-registered test (`research/preregistration/`, one H200, 2026-12-01), runs that differ only "
            "by seed (byte-level GPT 6x384, BF16 SDPA, lr 2e-3; thresholds frozen from 8 other seeds)")
README_HEAD = "**What the early warning predicts: not proven yet.** "
README_TAIL = (" Its one candidate, the BF16 repeated-max trend (`flashwatch_repeated_max_ratio_bf16_trend`), goes"
               " to a second registered test (lr 1.75e-3, more survivors). Table and runs: `docs/EXPERIMENTS.md` §9.")
TABLE_START = "<!-- test.md: generated"
TABLE_END = "<!-- end test.md -->"


def readme_block() -> str:
    """The README's early-warning paragraph, wrapped at 100 columns."""
    result = json.loads(TEST_1.read_text())
    text = README_HEAD + readme_paragraph(result, CONFIG_1) + README_TAIL
    return textwrap.fill(text, 100, break_on_hyphens=False, break_long_words=False)


def _readme_span(readme: str) -> tuple[int, int]:
    start = readme.index(README_HEAD.strip())
    return start, readme.index("\n\n", start)


def _table_span(doc: str) -> tuple[int, int]:
    start = doc.index("\n", doc.index(TABLE_START)) + 1
    return start, doc.index(TABLE_END)


def differences() -> list[str]:
    """What the files state that the result files do not say (empty: all equal)."""
    out = []
    readme = (ROOT / "README.md").read_text()
    a, b = _readme_span(readme)
    if readme[a:b] != readme_block():
        out.append("README.md: the early-warning paragraph differs from research.stated_numbers.readme_block()")
    doc = (ROOT / "docs/EXPERIMENTS.md").read_text()
    a, b = _table_span(doc)
    if doc[a:b].strip() != TEST_1_TABLE.read_text().strip():
        out.append(f"docs/EXPERIMENTS.md: the table of section 9 differs from {TEST_1_TABLE.relative_to(ROOT)}")
    return out


def write() -> None:
    readme_path = ROOT / "README.md"
    readme = readme_path.read_text()
    a, b = _readme_span(readme)
    readme_path.write_text(readme[:a] + readme_block() + readme[b:])
    doc_path = ROOT / "docs/EXPERIMENTS.md"
    doc = doc_path.read_text()
    a, b = _table_span(doc)
    doc_path.write_text(doc[:a] + TEST_1_TABLE.read_text().strip() + "\n" + doc[b:])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m research.stated_numbers", description=__doc__.split("\n\n")[0])
    p.add_argument("--write", action="store_true", help="rewrite the stated blocks from the result files")
    args = p.parse_args(argv)
    if args.write:
        write()
    diff = differences()
    for line in diff:
        print(line)
    return 1 if diff else 0


if __name__ == "__main__":
    sys.exit(main())
