"""Experiments: does the Monitor warn before BF16 attention training blows up?

``python -m research.experiments --help`` is the manual; docs/EXPERIMENTS.md holds the results.
Recorded runs are read, replayed and calibrated by the product (``flashwatch.replay``,
``flashwatch experiment analyze``); this package makes them.

Modules:
    scenarios   the scenarios (recipes) and their arms
    model       the experiments' byte-level GPT
    worker      one run in its own process: train, monitor, record, stop at blow-up or a bound
    runner      runs as subprocesses, N at a time over the GPUs; one merged results JSON
    figures     one PNG per (scenario, arm), from the recordings
    cli         ``python -m research.experiments`` (early-warning, real-failure, list, figures)
"""
