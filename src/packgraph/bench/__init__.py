"""``packgraph bench``: packgraph against eager, torch.compile and padded batching (see :mod:`packgraph.bench.run`).

Modules: ``presets`` and ``options`` (what a run measures), ``run`` (the harness and the CLI entry point),
``machine``, ``data`` (length mixes, batch streams), ``methods``, ``padded``, ``measure``, ``profiling``,
``attention`` (the micro-benchmark), ``report`` (tables, ``results.md``, the README table) and ``plots``.
"""

from packgraph.bench.machine import machine_info
from packgraph.bench.presets import PRESETS
from packgraph.bench.report import readme_table
from packgraph.bench.run import main, run_bench

__all__ = ["PRESETS", "machine_info", "main", "readme_table", "run_bench"]
