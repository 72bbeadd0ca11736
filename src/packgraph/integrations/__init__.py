"""Integrations with other frameworks; each submodule imports its framework, so import them explicitly.

* :mod:`packgraph.integrations.hf`: Hugging Face transformers (the ``"packgraph"`` attention, batch conversion,
  graphed decoder layers). Needs ``transformers``.
* :mod:`packgraph.integrations.megatron`: Megatron-Core ``PackedSeqParams`` conversion and Megatron RL bin params.
  Needs ``megatron-core`` only for :func:`~packgraph.integrations.megatron.to_megatron`.
"""
