"""packgraph: packed variable-length sequences under CUDA graphs, forward and backward."""

from packgraph.params import PackedSeqParams, PackedSeqParamsError, StaticSignature

__all__ = ["PackedSeqParams", "PackedSeqParamsError", "StaticSignature"]
__version__ = "0.1.0"
