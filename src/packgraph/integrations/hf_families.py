"""Tiny random configs of the Hugging Face model families packgraph's HF path is checked on.

One place for the CPU tests (``tests/integrations/test_hf_families*.py``), the GPU tests
(``tests/cuda/test_hf_families_cuda.py``) and ``scripts/model-table``. Each family is the tiniest config
transformers builds for it (2 layers, hidden 32, 4 query heads over 2 kv heads where the family has GQA, vocab 128),
with the features of its released models kept and made to matter:

* every sliding window is :data:`WINDOW` tokens, shorter than most of :data:`DOC_LENGTHS`, and a family whose
  released models alternate local and global layers (Gemma 2/3, gpt-oss, Qwen2 with ``use_sliding_window``) has
  one of each;
* Gemma 2's attention logit softcap is small enough to bend these weights' scores; gpt-oss keeps its sinks;
* the MoE families (Qwen3-MoE, Mixtral, gpt-oss) have 4 experts, 2 per token;
* weights are drawn with ``initializer_range`` :data:`INIT_RANGE`, so that attention is far from uniform and a
  wrong window, softcap or sink shows in the logits.

Only configs and batches live here; the checks are the callers'. Needs transformers (imported on use).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from packgraph.integrations.hf_batches import from_flattening_batch
from packgraph.packing import PackedBatch

__all__ = [
    "DOC_LENGTHS",
    "FAMILIES",
    "INIT_RANGE",
    "TOTAL_TOKENS",
    "VOCAB",
    "WINDOW",
    "Family",
    "documents",
    "packed_batch",
    "per_document_reference",
    "random_documents",
    "size_overrides",
    "tiny_config",
    "tiny_model",
]

VOCAB = 128
WINDOW = 8
"""Every sliding window of the tiny configs: shorter than four of the six documents of :data:`DOC_LENGTHS`."""
DOC_LENGTHS: tuple[int, ...] = (5, 17, 1, 9, 12, 26)
TOTAL_TOKENS = 80
"""The stream size: 70 document tokens and 10 dead tail rows."""
INIT_RANGE = 0.2

_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    initializer_range=INIT_RANGE,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    tie_word_embeddings=False,
)
_ALTERNATING = ("sliding_attention", "full_attention")
_MOE = dict(num_experts_per_tok=2)


@dataclasses.dataclass(frozen=True)
class Family:
    """One model family: its transformers config class and the overrides of :data:`_COMMON` that make it tiny.

    Attributes:
        name: the key in :data:`FAMILIES` (``"gemma3"``).
        title: the name the model table prints (``"Gemma 3"``).
        config_class: the ``transformers`` config class name.
        overrides: config kwargs on top of the common tiny ones (``None`` removes a common kwarg).
        features: what the family adds to a Llama: ``"window"`` (sliding window on every layer),
            ``"alternating"`` (local and global layers), ``"softcap"``, ``"sinks"``, ``"moe"``.
        layer_pattern: the ``layer_types`` of the first layers, repeated over every layer (whatever their count).
    """

    name: str
    title: str
    config_class: str
    overrides: Mapping[str, Any]
    features: tuple[str, ...] = ()
    layer_pattern: tuple[str, ...] | None = None

    @property
    def moe(self) -> bool:
        return "moe" in self.features

    @property
    def windowed(self) -> bool:
        return "window" in self.features or "alternating" in self.features


_FAMILIES = [
    Family("llama", "Llama", "LlamaConfig", {}),
    Family(
        "qwen2",
        "Qwen2 (use_sliding_window)",
        "Qwen2Config",
        # Layers from max_window_layers on slide: layer 0 global, layer 1 local.
        dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
        ("alternating",),
    ),
    Family("qwen3", "Qwen3", "Qwen3Config", dict(head_dim=8)),
    Family(
        "qwen3_moe",
        "Qwen3-MoE",
        "Qwen3MoeConfig",
        dict(head_dim=8, num_experts=4, moe_intermediate_size=32, **_MOE),
        ("moe",),
    ),
    Family("mistral", "Mistral (v0.1 window)", "MistralConfig", dict(sliding_window=WINDOW), ("window",)),
    Family(
        "mixtral",
        "Mixtral",
        "MixtralConfig",
        dict(sliding_window=WINDOW, num_local_experts=4, **_MOE),
        ("window", "moe"),
    ),
    Family(
        "gemma2",
        "Gemma 2",
        "Gemma2Config",
        dict(
            head_dim=8,
            query_pre_attn_scalar=8,
            sliding_window=WINDOW,
            attn_logit_softcapping=2.0,
            final_logit_softcapping=30.0,
        ),
        ("alternating", "softcap"),
        _ALTERNATING,
    ),
    Family(
        "gemma3",
        "Gemma 3",
        "Gemma3TextConfig",
        dict(head_dim=8, query_pre_attn_scalar=8, sliding_window=WINDOW),
        ("alternating",),
        _ALTERNATING,
    ),
    Family("phi3", "Phi-3", "Phi3Config", dict(sliding_window=WINDOW), ("window",)),
    Family("olmo2", "OLMo 2", "Olmo2Config", {}),
    Family("gpt_neox", "GPT-NeoX", "GPTNeoXConfig", dict(num_key_value_heads=None)),
    Family("starcoder2", "Starcoder2", "Starcoder2Config", dict(sliding_window=WINDOW), ("window",)),
    Family(
        "gpt_oss",
        "gpt-oss",
        "GptOssConfig",
        dict(
            head_dim=8,
            sliding_window=WINDOW,
            num_local_experts=4,
            # gpt-oss's YaRN, its ratio kept (max_position_embeddings / original = 32) at this size
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 150000.0,
                "factor": 32.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": 4,
            },
            **_MOE,
        ),
        ("alternating", "sinks", "moe"),
        _ALTERNATING,
    ),
]
FAMILIES: dict[str, Family] = {f.name: f for f in _FAMILIES}
"""Every family, by name, in the order of the model table."""


def tiny_config(name: str, **overrides: Any) -> Any:
    """The tiny ``transformers`` config of family ``name`` (a fresh object), with ``overrides`` on top."""
    import transformers

    family = FAMILIES[name]
    kwargs = {**_COMMON, **family.overrides, **overrides}
    kwargs = {k: v for k, v in kwargs.items() if v is not None}
    if family.layer_pattern is not None and "layer_types" not in kwargs:
        pattern = family.layer_pattern
        kwargs["layer_types"] = [pattern[i % len(pattern)] for i in range(kwargs["num_hidden_layers"])]
    return getattr(transformers, family.config_class)(**copy.deepcopy(kwargs))


def tiny_model(
    name: str,
    attn_implementation: str = "packgraph",
    *,
    state_dict: Mapping[str, Tensor] | None = None,
    experts_implementation: str | None = None,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    **overrides: Any,
) -> nn.Module:
    """A causal LM of family ``name`` in eval mode on the CPU: random weights drawn under ``seed``, or ``state_dict``.

    ``experts_implementation`` (MoE families): transformers' ``"grouped_mm"`` (its default where it can run),
    ``"batched_mm"`` or ``"eager"`` (a Python loop over the experts hit, found with ``nonzero``).
    """
    import transformers

    if attn_implementation == "packgraph":
        from packgraph.integrations import hf  # noqa: F401  (registers the attention)
    options: dict[str, Any] = {"attn_implementation": attn_implementation}
    if experts_implementation is not None:
        options["experts_implementation"] = experts_implementation
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config(name, **overrides), **options)
    model = model.to(dtype)
    if state_dict is not None:
        model.load_state_dict(state_dict)
    return model.eval()


def documents(lengths: Sequence[int] = DOC_LENGTHS, seed: int = 0, vocab: int = VOCAB) -> list[Tensor]:
    """Random int64 token documents of the given lengths."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g) for n in lengths]  # no pad/bos/eos ids


def packed_batch(
    docs: Sequence[Tensor],
    total_tokens: int = TOTAL_TOKENS,
    *,
    capacity: int | None = None,
    max_seqlen: int | None = None,
) -> PackedBatch:
    """``docs`` packed into one fixed-shape ``[total_tokens]`` stream (CPU; static capacity/max_seqlen as given)."""
    lengths = [len(d) for d in docs]
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    flat = {"input_ids": torch.cat(list(docs)).view(1, -1), "cu_seq_lens_q": offsets}
    return from_flattening_batch(flat, total_tokens=total_tokens, capacity=capacity, max_seqlen=max_seqlen)


def random_documents(
    total_tokens: int, *, max_seqlen: int, capacity: int, seed: int = 0, vocab: int = VOCAB
) -> list[Tensor]:
    """Random documents for one ``[total_tokens]`` stream: at most ``capacity`` of them, each at most ``max_seqlen``
    tokens (every third one at least half of it), filling ``total_tokens`` less a dead tail of up to an eighth."""
    g = torch.Generator().manual_seed(seed)
    budget = total_tokens - int(torch.randint(0, total_tokens // 8 + 1, (1,), generator=g))
    lengths: list[int] = []
    while len(lengths) < capacity and budget > 0:
        low = max(1, max_seqlen // 2) if len(lengths) % 3 == 0 else 1
        n = min(int(torch.randint(low, max_seqlen + 1, (1,), generator=g)), budget)
        lengths.append(n)
        budget -= n
    return documents(lengths, seed=seed, vocab=vocab)


def size_overrides(name: str, *, hidden_size: int, num_layers: int, window: int, max_positions: int) -> dict[str, Any]:
    """Config overrides that grow family ``name``'s tiny config (for timings): 4 query heads over 2 kv heads, head
    dim ``hidden_size / 4``, MLPs of twice the width (MoE experts: the width), windows of ``window`` tokens."""
    family = FAMILIES[name]
    out: dict[str, Any] = dict(
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        max_position_embeddings=max_positions,
    )
    if "head_dim" in family.overrides:
        out["head_dim"] = hidden_size // 4
    if "query_pre_attn_scalar" in family.overrides:
        out["query_pre_attn_scalar"] = hidden_size // 4
    if "moe_intermediate_size" in family.overrides:
        out["moe_intermediate_size"] = hidden_size
    if "sliding_window" in family.overrides:
        out["sliding_window"] = window
    return out


def per_document_reference(model: nn.Module, docs: Sequence[Tensor]) -> tuple[list[Tensor], dict[str, Tensor]]:
    """Each document alone through ``model`` (any attention, e.g. transformers' ``"eager"``): its logits, and the
    parameter grads of the packed loss (mean next-token cross-entropy over every document's targets).

    Returns ``(logits per document [len, vocab], {parameter name: grad})``; the model's grads are left zeroed.
    """
    model.zero_grad(set_to_none=True)
    targets = sum(max(len(d) - 1, 0) for d in docs)
    logits = []
    for doc in docs:
        out = model(input_ids=doc.view(1, -1), use_cache=False).logits[0]
        logits.append(out.detach())
        if len(doc) > 1:
            loss = nn.functional.cross_entropy(out[:-1].float(), doc[1:], reduction="sum") / targets
            loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return logits, grads
