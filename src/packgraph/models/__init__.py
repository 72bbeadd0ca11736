"""Reference models on packed (THD) batches."""

from packgraph.models.gpt import GPT, PRESETS, SCOPES, Block, GPTConfig, GraphedGPT

__all__ = ["GPT", "GPTConfig", "GraphedGPT", "Block", "PRESETS", "SCOPES"]
