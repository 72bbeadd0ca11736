"""What ``on_graph_stream`` records on the capture stream: every tensor among the arguments (the stream order
itself is checked on the GPU, ``tests/cuda/test_streams_cuda.py``)."""

import dataclasses

import torch

from packgraph.graphs.streams import _tensors_in
from packgraph.params import PackedSeqParams


def test_the_arguments_tensors_are_found_wherever_they_are_nested():
    params = PackedSeqParams.from_seqlens([5, 0, 7], capacity=8, total_tokens=32, max_seqlen=8, pad_to_multiple=4)
    params = params.with_seq_idx()
    assert params.host_offsets  # present, and not walked: they hold no tensor
    tokens, labels, mask = torch.zeros(32, dtype=torch.long), torch.ones(32, dtype=torch.long), torch.ones(32)
    args = ((tokens, params, [labels, None, 3]), {"inputs": {"mask": mask, "n": 1}})
    want = [tokens, *(getattr(params, f.name) for f in dataclasses.fields(params)), labels, mask]
    want = [t for t in want if isinstance(t, torch.Tensor)]
    got = list(_tensors_in(args))
    assert len(want) == 3 + 5  # cu_seqlens_q/kv, their padded twins, seq_idx
    assert [id(t) for t in got] == [id(t) for t in want]
