"""CPU shims for Megatron-Core in tests (never in the library), and a one-rank parallel state.

Megatron-Core assumes CUDA in a few places that a CPU test reaches:

* ``torch.cuda.current_device()``: RotaryEmbedding moves ``inv_freq`` there, the global memory buffer that
  ``DotProductAttention`` multiplies into allocates there, and so do a few tensor-parallel buffers;
* the default causal mask of ``FusedScaleMaskSoftmax`` is built with ``device="cuda"``;
* the RNG tracker (``get_cuda_rng_tracker().fork()``) keeps CUDA generator states, and so does the activation
  checkpoint of full recomputation, which saves and restores the CUDA generator's state around its re-run.

:func:`megatron_on_cpu` patches exactly these for the duration of a ``with`` block (the tests use it in a
module-scoped fixture) and sets up a one-rank gloo process group with model parallel sizes 1 (Megatron's groups on
the default group when one exists, as in a forked rank). On exit it frees every group Megatron still holds, so that
no process forked later inherits one. Dropout is off in every test model, so the RNG tracker's ``fork`` can be a
no-op.

Also the tiny models the Megatron tests share: :func:`tiny_config`, :func:`gpt_model`, :func:`hybrid_model` (with
:class:`StandInMixer` for the Mamba layers, whose kernels need CUDA), and the packed forward/loss helpers.
"""

from __future__ import annotations

import contextlib
import gc
import socket
from collections.abc import Iterator

import pytest
import torch


class _CpuRngTracker:
    """Stands for Megatron's ``CudaRNGStatesTracker``: ``fork`` draws nothing (dropout is 0 in the tests)."""

    def fork(self, name: str | None = None) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def get_states(self) -> dict:
        return {}

    def set_states(self, states: dict) -> None:
        pass

    def add(self, name: str, seed: int) -> None:
        pass

    def reset(self) -> None:
        pass

    def is_initialized(self) -> bool:
        return True


def _cpu_causal_mask(sq: int) -> torch.Tensor:
    return torch.triu(torch.ones(sq, sq), diagonal=1).bool()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def megatron_on_cpu() -> Iterator[None]:
    """Megatron-Core runnable on the CPU: the shims above plus a one-rank gloo group and parallel state."""
    import megatron.core.fusions.fused_softmax as fused_softmax
    import megatron.core.tensor_parallel.random as tp_random
    import megatron.core.transformer.utils as transformer_utils
    from megatron.core import parallel_state

    started_group = False
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.cuda, "current_device", lambda: torch.device("cpu"))
        mp.setattr(transformer_utils, "get_default_causal_mask", _cpu_causal_mask)
        mp.setattr(fused_softmax, "get_default_causal_mask", _cpu_causal_mask)
        mp.setattr(tp_random, "_CUDA_RNG_STATE_TRACKER", _CpuRngTracker())
        mp.setattr(tp_random, "_CUDA_RNG_STATE_TRACKER_INITIALIZED", True)
        # the CPU generator's state is saved and restored beside these by the checkpoint itself
        mp.setattr(tp_random, "_get_cuda_rng_state", lambda *args, **kwargs: torch.empty(0), raising=False)
        mp.setattr(tp_random, "_set_cuda_rng_state", lambda *args, **kwargs: None, raising=False)
        if not torch.distributed.is_initialized():
            mp.setenv("MASTER_ADDR", "127.0.0.1")
            mp.setenv("MASTER_PORT", str(_free_port()))
            torch.distributed.init_process_group("gloo", rank=0, world_size=1)
            started_group = True
        parallel_state.initialize_model_parallel(1, 1)
        try:
            yield
        finally:
            parallel_state.destroy_model_parallel()
            if started_group:
                torch.distributed.destroy_process_group()
            _drop_process_groups(parallel_state)


def _drop_process_groups(parallel_state) -> None:
    """Free every process group Megatron still references, here and now.

    A gloo group's destructor joins its worker threads, which a forked process does not have: a group that
    outlives this block and is freed in a process forked later (the multi-rank tests fork their ranks) hangs or
    crashes it there. Megatron-Core 0.16's ``destroy_model_parallel`` leaves two of its globals set
    (``_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP`` and its ``_GLOO`` twin), which a forked rank's
    ``initialize_model_parallel`` overwrites; and Megatron's modules hold groups too, often from reference
    cycles that only the cycle collector frees.
    """
    for name, value in list(vars(parallel_state).items()):
        if isinstance(value, torch.distributed.ProcessGroup):
            setattr(parallel_state, name, None)
    gc.collect()


# ---------------------------------------------------------------------------------------------------- tiny models
VOCAB = 64
PAD_ID = VOCAB - 1


def tiny_config(**overrides):
    """A two-layer TransformerConfig small enough for CPU tests (fp32, no dropout, CPU initialisation)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    base = dict(
        num_layers=2,
        hidden_size=32,
        ffn_hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_dropout_fusion=False,  # on, Megatron torch.compiles the fused op at its first call (slow on a CPU)
    )
    base.update(overrides)
    return TransformerConfig(**base)


def gpt_model(spec, config, *, position_embedding_type: str = "rope", seed: int = 0, **model_kwargs):
    """A Megatron GPTModel on the CPU, its weights drawn from ``seed``."""
    from megatron.core.models.gpt import GPTModel

    torch.manual_seed(seed)
    model_kwargs.setdefault("max_sequence_length", 128)
    return GPTModel(config, spec, vocab_size=VOCAB, position_embedding_type=position_embedding_type, **model_kwargs)


def packed_logits(model, batch, params=None) -> torch.Tensor:
    """``model``'s logits ``[T, vocab]`` on a packed ``PackedBatch`` (Megatron's params class, attention view)."""
    from packgraph.integrations.megatron import to_megatron

    if params is None:
        params = to_megatron(batch.packed_seq_params.attention_view())
    out = model(batch.tokens[None], batch.position_ids[None], None, packed_seq_params=params)
    return out[0]


def packed_loss(logits: torch.Tensor, batch) -> torch.Tensor:
    """Summed next-token cross entropy over the rows that have a target (dead rows carry none)."""
    per_row = torch.nn.functional.cross_entropy(logits.float(), batch.labels.clamp_min(0), reduction="none")
    return (per_row * batch.loss_mask).sum()


class StandInMixer(torch.nn.Module):
    """An eager stand-in for a Mamba layer in a hybrid stack (the real mixer needs mamba-ssm's CUDA kernels).

    It mixes each row with a learned linear map and records the packed params it was given, so a test sees that
    non-TransformerLayer layers keep running eagerly with Megatron's own params object.
    """

    def __init__(self, config, layer_number: int = 1, **kwargs) -> None:
        super().__init__()
        self.layer_number = layer_number
        self.mix = torch.nn.Linear(config.hidden_size, config.hidden_size)
        self.seen_params: list = []

    def forward(self, hidden_states, attention_mask=None, inference_context=None, packed_seq_params=None, **kwargs):
        self.seen_params.append(packed_seq_params)
        return hidden_states + torch.tanh(self.mix(hidden_states))


def hybrid_model(attention_spec, config, pattern: str, *, seed: int = 0):
    """Megatron's hybrid language model (``HybridModel``, else ``MambaModel`` on Megatron-Core < 0.17) with
    attention layers from ``attention_spec`` and :class:`StandInMixer` for ``M``; no final norm (the stack's is
    Transformer Engine's). ``config.num_layers`` must be ``len(pattern)``."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    try:
        from megatron.core.models.hybrid.hybrid_block import HybridStack as Stack
        from megatron.core.models.hybrid.hybrid_block import HybridStackSubmodules as Submodules
        from megatron.core.models.hybrid.hybrid_model import HybridModel as Model

        pattern_kwarg = "hybrid_layer_pattern"
    except ImportError:
        from megatron.core.models.mamba.mamba_model import MambaModel as Model
        from megatron.core.ssm.mamba_block import MambaStack as Stack
        from megatron.core.ssm.mamba_block import MambaStackSubmodules as Submodules

        pattern_kwarg = "hybrid_override_pattern"
    stack = ModuleSpec(
        module=Stack,
        submodules=Submodules(mamba_layer=StandInMixer, attention_layer=attention_spec),
        params={"post_layer_norm": False},
    )
    torch.manual_seed(seed)
    return Model(
        config,
        stack,
        vocab_size=VOCAB,
        max_sequence_length=128,
        position_embedding_type="rope",
        **{pattern_kwarg: pattern},
    )
