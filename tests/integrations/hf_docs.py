"""The documents and collator the HF tests share (transformers is imported by the tests that skip without it)."""

import torch

VOCAB = 97
DOC_LENGTHS = (5, 17, 1, 9, 12)
TOTAL_TOKENS = 56  # > sum(DOC_LENGTHS) = 44: the stream has dead tail rows


def docs(lengths=DOC_LENGTHS, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g) for n in lengths]


def collate(docs, **collator_kwargs):
    import transformers

    collator = transformers.DataCollatorWithFlattening(**collator_kwargs)
    return collator([{"input_ids": d.tolist()} for d in docs])
