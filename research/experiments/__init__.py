"""flashwatch experiments: does the Monitor warn before BF16 attention training blows up?

``flashwatch experiment --help`` is the manual; docs/EXPERIMENTS.md holds the results.

Modules:
    scenarios   the scenarios (recipes) and their arms
    model       the probe's byte-level GPT
    worker      one run in its own process: train, monitor, record, stop at blow-up or a bound
    runner      runs as subprocesses, N at a time over the GPUs; one merged results JSON
    records     the run folder's files (written exactly, read back for replay)
    analysis    blow-up, replay of the detectors, baselines, lead times, targets, calibration
    baselines   Lightning-style loss spike, ZClip, QK-Clip, replayed on recordings
    figures     one PNG per (scenario, arm), from the recordings
    cli         ``flashwatch experiment`` (early-warning, real-failure, analyze, list)
"""
