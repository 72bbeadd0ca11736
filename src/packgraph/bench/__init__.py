"""``packgraph bench``: packgraph against eager, torch.compile and padded batching (see :mod:`packgraph.bench.run`)."""

from packgraph.bench.run import PRESETS, check_targets, machine_info, main, readme_table, run_bench

__all__ = ["PRESETS", "check_targets", "machine_info", "main", "readme_table", "run_bench"]
