"""Graph-safe ops on packed (THD) token streams: varlen attention and rotary embedding."""

from packgraph.ops.attention import varlen_attention, varlen_attention_reference
from packgraph.ops.rope import apply_rope_thd, rope_positions

__all__ = ["varlen_attention", "varlen_attention_reference", "apply_rope_thd", "rope_positions"]
