"""``packgraph bench``: packgraph against eager, torch.compile and padded batching (see :mod:`packgraph.bench.run`)."""

from packgraph.bench.run import PRESETS, machine_info, main, readme_table, run_bench

__all__ = ["PRESETS", "machine_info", "main", "readme_table", "run_bench"]
