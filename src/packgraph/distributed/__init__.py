"""Multi-process training on ``torch.distributed``: data parallelism and THD context parallelism.

* :mod:`~packgraph.distributed.dp`: shard batches, normalise by the global token count, reduce gradients with
  torch's DDP (:func:`summing_ddp`) or an explicit all-reduce after backward; both work with graphed layers.
* :mod:`~packgraph.distributed.cp`: load-balanced ``2 * CP`` sharding of packed sequences and all-gather K/V
  causal attention.
* :mod:`~packgraph.distributed.launch`: ``torchrun`` launch and process-group initialisation.
"""

from packgraph.distributed.cp import (
    CPShard,
    all_gather_autograd,
    cp_position_ids,
    cp_shard_index,
    cp_varlen_attention,
    shard_thd_for_cp,
)
from packgraph.distributed.dp import (
    allreduce_gradients,
    broadcast_parameters,
    global_token_count,
    shard_batches,
    summing_ddp,
)
from packgraph.distributed.launch import (
    DistributedContext,
    ParallelGroups,
    init_distributed,
    launch,
    parallel_groups,
    shutdown_distributed,
    torchrun_command,
)

__all__ = [
    "CPShard",
    "DistributedContext",
    "ParallelGroups",
    "all_gather_autograd",
    "allreduce_gradients",
    "broadcast_parameters",
    "cp_position_ids",
    "cp_shard_index",
    "cp_varlen_attention",
    "global_token_count",
    "init_distributed",
    "launch",
    "parallel_groups",
    "shard_batches",
    "shard_thd_for_cp",
    "shutdown_distributed",
    "summing_ddp",
    "torchrun_command",
]
