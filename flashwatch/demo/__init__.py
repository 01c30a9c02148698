"""``flashwatch demo``: the main job on an embedded default, in about a minute on a laptop CPU.

A small byte-level GPT (``flashwatch.tinygpt``: 4 layers x 4 heads, head dim 16, context 64)
learns the Python standard library's own source text in BF16 mixed precision, with
``FlashWatchCallback`` in a Lightning ``Trainer``. While it trains, flashwatch serves its
metrics to Prometheus on 127.0.0.1 (port 9400 by default, the port of
``dashboards/prometheus.yml``; when 9400 is taken, a free port, and the demo says which),
writes the run folder, and shows ``ConsoleExporter``'s live panel with the run's progress; at
the end (or at Ctrl-C) it prints a short report and renders ``report.html`` (``flashwatch
report``).

- CPU (default without CUDA): ``observe`` mode. The model keeps torch's SDPA; on every
  monitored step flashwatch runs its statistics pass (the PyTorch reference) beside it.
- CUDA: ``own_kernel`` mode. Attention runs through flashwatch's Triton kernel (variant
  ``plain``), statistics in-kernel.
- ``--provoke``: the early-warning scenario with an INJECTED fault: ``own_kernel`` mode with
  ``flashwatch.kernels.faults.rounding_bias(128)``, which, on rows where P_bar rounds to
  exactly 1 at two or more keys, inflates the output by 128 * 2**-8 = 50 % before rounding to
  BF16 (``flashwatch.kernels.reference.inject_rounding_bias``). Every output of such a run
  says INJECTED: the console, the log lines, the alert messages in ``metrics.jsonl`` and
  ``alerts.log``, ``demo.json``, the report, the run folder's name, and a constant label
  ``injected="true"`` on every Prometheus series.

Monitoring schedule. The demo monitors every optimizer step (``interval=1``) and scales the
detectors' clocks to the run (``warmup`` = steps/4, ``window`` and ``repeated_max_baseline`` =
steps/8 monitored steps); thresholds are ``MonitorConfig``'s defaults. A training run of
thousands of steps would use the defaults (``interval=10``, warm-up 20 monitored steps).

Run folder (default ``runs/demo-<timestamp>/``, ``runs/demo-<timestamp>-INJECTED/`` with
``--provoke``): ``metrics.jsonl`` (one JSON line per monitored step), ``alerts.log``,
``checkpoint.ckpt`` (model, optimizer and flashwatch state: ``trainer.fit(..., ckpt_path=)``
resumes; written at the end of the run, not at Ctrl-C), ``demo.json`` (what ran) and ``report.html``.

Modules: ``model`` (the GPT and its batches), ``fault`` (the INJECTED fault and its labels),
``live`` (what is shown while it trains), ``training`` (the run), ``summary`` (the end
report), ``command`` (the command).
"""

from .command import main
from .fault import PROVOKE_STRENGTH
from .model import DemoModel
from .summary import report_lines
from .training import DEFAULT_PORT, DEFAULT_STEPS, DemoError, DemoResult, demo_config, run

__all__ = ["DemoModel", "DemoResult", "DemoError", "demo_config", "run", "main", "report_lines", "DEFAULT_STEPS",
           "DEFAULT_PORT", "PROVOKE_STRENGTH"]
