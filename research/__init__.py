"""Paper reproduction for flashwatch: experiments and the bias lab, run from a checkout.

Not installed with flashwatch: run from the repository root, e.g. ``python -m research.experiments
--help`` and ``python -m research.lab --help``. This code imports flashwatch; flashwatch never
imports it.

    research.experiments   runs that fail in BF16, with the Monitor watching (docs/EXPERIMENTS.md)
    research.lab           the signed rounding bias of each attention kernel (docs/LAB.md)
    research.early_warning the pre-registered tests of the early warning (research/preregistration/)
    research.auto_fix_effect  the pre-registered test of auto_fix against the same seeds without it
    research.recordings    pack run folders into results/ and unpack them
    research.stated_numbers  the early-warning numbers the README states, made from results/
    research/gpu_batch.sh  the GPU batches of the experiments
"""
