import torch

from packgraph.buckets import BucketPolicy
from packgraph.packing import PackedBatch
from tests.bench.records import load_bench_script

ladder_ghosts = load_bench_script("ladder_ghosts")


def _batch(lengths):
    """A batch with its true params (the bench's streams leave bucketing to the engine)."""
    docs = [torch.zeros(n, dtype=torch.long) for n in lengths]
    return PackedBatch.from_documents(docs, bin_size=1024, capacity=len(docs), max_seqlen=max(lengths))


def test_counts_match_a_hand_count_of_fa2_blocks():
    """Two batches under max_seqlen rungs (128, 512, 1024) and capacities (2, 8), per head, counted by hand:

    * [700, 100, 30]: bucket (1024, 8): 8 x 8 = 64 blocks, eager 6 x 3 = 18; longest alone: 8 + 7 x 1 = 15;
    * [60]: bucket (128, 2): 1 x 2 = 2 blocks, eager 1; longest alone: 1 (no second call).
    """
    policy = BucketPolicy((128, 512, 1024), (2, 8))
    got = ladder_ghosts.count([_batch([700, 100, 30]), _batch([60])], policy)
    assert got["buckets"] == 2
    assert got["capture_ghosts"] == 5  # 8 slots for 3 documents
    assert got["grid_over_eager"] == (64 + 2) / (18 + 1)
    assert got["empty_blocks"] == ((64 - 18) + (2 - 1)) / 2
    assert got["empty_blocks_longest_alone"] == ((15 - 18) + (1 - 1)) / 2
    assert got["graphs_longest_alone"] == 2  # (1024, 8, 128) and (128, 2, 0)


def test_the_rest_rung_is_a_signature_of_its_own():
    """Same bucket, second-longest documents on two rungs: two graphs where the plain ladder has one."""
    policy = BucketPolicy((128, 512, 1024), (8,))
    stream = [_batch([600, 400]), _batch([600, 100])]
    got = ladder_ghosts.count(stream, policy)
    assert got["buckets"] == 1 and got["graphs_longest_alone"] == 2
