"""Hugging Face ``Trainer`` on packed, fixed-shape batches, with the decoder layers replayed from CUDA graphs.

The recipe::

    from packgraph.integrations.hf_trainer import PackgraphTrainer, pack_dataset

    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="packgraph")
    rows = pack_dataset(tokenized, total_tokens=4096)         # best-fit decreasing into rows of <= 4096 tokens
    trainer = PackgraphTrainer(model=model, args=args, train_dataset=rows, total_tokens=4096)
    trainer.train()                                          # graphed on CUDA, packed and eager elsewhere

Three pieces:

* :func:`pack_dataset` packs an ordinary tokenized dataset (``input_ids``, optional ``labels`` with -100) into rows
  of at most ``T`` tokens ahead of time, as TRL's best-fit packing does. Each row keeps its documents apart through
  ``position_ids`` that restart at 0 at each document start.
* :class:`PackedCollator` is the ``data_collator``: it lays the features of one batch (packed rows, TRL packed rows
  with ``seq_lengths``, or single documents) out in one ``[1, T]`` stream and adds the packing metadata as HF's
  flash kwargs (``cu_seq_lens_q/k`` as tensors, ``max_length_q/k`` as ints), sized by a
  :class:`~packgraph.buckets.BucketPolicy`: every batch has ``T`` rows and one of the policy's few static
  ``(max_seqlen, capacity)`` buckets, so few graphs serve the whole run. Labels follow HF's convention (aligned with
  the inputs, -100 at each document start and on the tail), so the model's own loss and ``Trainer``'s token count
  (``num_items_in_batch``) score exactly the next-token targets inside each document.
* :class:`PackgraphTrainer` (or :class:`PackgraphTrainerMixin` on any ``Trainer`` subclass, e.g. TRL's
  ``SFTTrainer``) captures the decoder layers with :func:`~packgraph.integrations.hf.graph_decoder_layers` at the
  first training step, from that step's batch, under the same autocast as the model's forward. Everything else is
  ``Trainer``'s own: the model computes its loss eagerly (normalised by ``num_items_in_batch``, so gradient
  accumulation is token-weighted), ``Trainer`` clips, steps, zeroes, logs and saves. Evaluation runs the layers
  eagerly (``prediction_step`` pauses the graphs), and ``save_model`` writes the unchanged ``state_dict``.

Several processes (``accelerate launch``, ``torchrun``) run accelerate's torch DDP over the graphed layers: their
grads reach DDP's hooks through autograd, as eager ones do. With FSDP2 (``fsdp=True``, ``fsdp_config`` version 2),
accelerate shards each decoder layer before the first step, so the layers are captured as FSDP2 units: their
graphs read copies of the gathered parameters while FSDP2's hooks run eagerly around them (docs/distributed.md).
Combinations that graphs cannot serve raise an error at construction, naming the setting: ``torch_compile=True``,
DeepSpeed, FSDP1, DataParallel (several GPUs in one process), and ``bf16/fp16_full_eval``. A padded batch (an
attention mask, batch size above 1, or no packing metadata) raises at its first step whatever the mode.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Mapping, Sequence
from itertools import pairwise
from typing import Any

import torch
from torch import Tensor, nn

try:
    from transformers import Trainer
except ImportError as exc:  # pragma: no cover - exercised only without transformers
    raise ImportError("packgraph.integrations.hf_trainer needs Hugging Face transformers (and accelerate)") from exc

from packgraph.buckets import BucketPolicy, default_buckets
from packgraph.graphs.recorder import loop_stream
from packgraph.integrations.hf import ATTENTION_NAMES, GraphedDecoderLayers, _resolve_scope, graph_decoder_layers
from packgraph.packing import IGNORE_INDEX, PackedBatch, Packing, pack_sequences
from packgraph.params import PackedSeqParams

__all__ = [
    "PackedCollator",
    "PackedDataset",
    "PackgraphTrainer",
    "PackgraphTrainerMixin",
    "check_packed_inputs",
    "pack_dataset",
]

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------------- data
class PackedDataset(torch.utils.data.Dataset):
    """Rows made by :func:`pack_dataset`: each a dict of int64 ``[n]`` tensors, ``n <= total_tokens``.

    Keys: ``input_ids``, ``labels`` (HF convention, aligned with the inputs; the collator masks document starts),
    ``position_ids`` (restarting at 0 at each document: the document boundaries). ``packing`` is the
    :class:`~packgraph.packing.Packing` the rows came from (``packing.efficiency``: real tokens / slots).
    """

    def __init__(self, rows: list[dict[str, Tensor]], packing: Packing, total_tokens: int) -> None:
        self.rows = rows
        self.packing = packing
        self.total_tokens = total_tokens

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        return self.rows[index]

    def __repr__(self) -> str:
        return (
            f"PackedDataset({len(self.rows)} rows of <= {self.total_tokens} tokens, "
            f"{sum(len(b) for b in self.packing)} documents, efficiency {self.packing.efficiency:.3f})"
        )


def pack_dataset(
    examples: Iterable[Mapping[str, Any]],
    total_tokens: int,
    *,
    buckets: BucketPolicy | None = None,
    algorithm: str = "bfd",
    overlong: str = "raise",
) -> PackedDataset:
    """Pack tokenized examples into rows of at most ``total_tokens`` tokens, ahead of training (host work).

    Args:
        examples: mappings with ``input_ids`` (a list or 1-D tensor of ints) and optionally ``labels`` of the same
            length (HF convention: aligned with the inputs, -100 for tokens that carry no loss, e.g. a prompt); a
            list of dicts or a ``datasets.Dataset``. Each example is one document.
        total_tokens: ``T``, the rows of every batch.
        buckets: the policy the collator will use (default ``default_buckets(T)``): a row holds at most its
            largest capacity of documents, and no document may exceed its largest ``max_seqlen``.
        algorithm: ``"bfd"`` (best-fit decreasing, TRL's default), ``"ffd"`` or ``"nfd"``
            (:func:`~packgraph.packing.pack_sequences`).
        overlong: a document longer than ``min(T, buckets.max_seqlen)``: ``"raise"`` or ``"truncate"`` it (its
            first tokens are kept). Documents are never dropped.

    Returns:
        a :class:`PackedDataset`, one row per bin, documents in index order inside each row.

    Raises:
        ValueError: empty input, bad lengths, an overlong document with ``overlong="raise"``.
    """
    policy = default_buckets(total_tokens) if buckets is None else buckets
    limit = min(total_tokens, policy.max_seqlen)
    docs = []
    for k, example in enumerate(examples):
        ids = _as_row(example["input_ids"], f"examples[{k}]['input_ids']")
        labels = example.get("labels")
        labels = ids.clone() if labels is None else _as_row(labels, f"examples[{k}]['labels']", ids.numel())
        docs.append((ids, labels))
    if not docs:
        raise ValueError("pack_dataset got no examples")
    if overlong not in ("raise", "truncate"):
        raise ValueError(f"overlong must be 'raise' or 'truncate', got {overlong!r}")
    too_long = [k for k, (ids, _) in enumerate(docs) if ids.numel() > limit]
    if too_long and overlong == "raise":
        raise ValueError(
            f"{len(too_long)} examples are longer than {limit} tokens (T={total_tokens}, largest max_seqlen rung "
            f"{policy.max_seqlen}), e.g. index {too_long[0]} ({docs[too_long[0]][0].numel()} tokens): pass "
            "overlong='truncate', or a larger total_tokens / max_seqlen rung"
        )
    docs = [(ids[:limit], labels[:limit]) for ids, labels in docs]
    packing = pack_sequences(
        [ids.numel() for ids, _ in docs], total_tokens, max_seqs_per_bin=policy.max_capacity, algorithm=algorithm
    )
    rows = []
    for bin_ in packing:
        parts = [docs[i] for i in bin_]
        rows.append(
            {
                "input_ids": torch.cat([ids for ids, _ in parts]),
                "labels": torch.cat([labels for _, labels in parts]),
                "position_ids": torch.cat([torch.arange(ids.numel(), dtype=torch.int64) for ids, _ in parts]),
            }
        )
    return PackedDataset(rows, packing, total_tokens)


class PackedCollator:
    """``data_collator`` giving fixed-shape packed batches: one ``[1, T]`` stream with bucketed static metadata.

    Features may be rows of :func:`pack_dataset` (documents told apart by ``position_ids`` restarting at 0), TRL
    packed rows (a ``seq_lengths`` list), or plain tokenized examples (one document each). All features of a batch
    are laid out one after the other; rows past the last document are dead (token ``pad_token_id``, position 0,
    label -100) and the attention leaves them out.

    Returns a dict for ``model(**batch)``: ``input_ids``, ``labels`` (HF convention: -100 at every document start
    and on dead rows), ``position_ids``, all int64 ``[1, T]``; int32 ``cu_seq_lens_q``/``cu_seq_lens_k`` of
    ``capacity + 1`` offsets (slots past the last document repeat the last offset); and int ``max_length_q``/
    ``max_length_k``: the bucket's static values, so ``Trainer`` moves the tensors to the device and the ints stay
    static graph metadata.

    Args:
        total_tokens: ``T``.
        buckets: static ``(max_seqlen, capacity)`` ladders (default ``default_buckets(T)``).
        pad_token_id: the token on dead rows (any valid id: those rows carry no loss and reach no document).

    Raises (at call): ValueError when the features hold more than ``T`` tokens (pack ahead with
    :func:`pack_dataset` and use ``per_device_train_batch_size=1``, or raise ``T``), or when no bucket fits.
    """

    def __init__(self, total_tokens: int, *, buckets: BucketPolicy | None = None, pad_token_id: int = 0) -> None:
        if total_tokens < 1:
            raise ValueError(f"total_tokens must be >= 1, got {total_tokens}")
        self.total_tokens = int(total_tokens)
        self.buckets = default_buckets(self.total_tokens) if buckets is None else buckets
        self.pad_token_id = int(pad_token_id)

    def __repr__(self) -> str:
        return f"PackedCollator(total_tokens={self.total_tokens}, {self.buckets.describe()})"

    def __call__(self, features: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        ids_parts, label_parts, lengths = [], [], []
        for k, feature in enumerate(features):
            ids = _as_row(feature["input_ids"], f"features[{k}]['input_ids']")
            labels = feature.get("labels")
            labels = ids.clone() if labels is None else _as_row(labels, f"features[{k}]['labels']", ids.numel())
            ids_parts.append(ids)
            label_parts.append(labels)
            lengths += [n for n in _feature_lengths(feature, ids.numel(), k) if n > 0]
        n, t = sum(lengths), self.total_tokens
        if n > t:
            raise ValueError(
                f"a batch of {len(features)} features holds {n} tokens, more than total_tokens={t}: pack the "
                "dataset ahead with pack_dataset(..., total_tokens) and use per_device_train_batch_size=1 (and "
                "per_device_eval_batch_size=1 for evaluation), or raise total_tokens"
            )
        if n == 0:
            raise ValueError("the batch holds no tokens")
        params = self.buckets.apply(PackedSeqParams.from_seqlens(lengths, total_tokens=t))
        labels = torch.full((t,), IGNORE_INDEX, dtype=torch.int64)
        labels[:n] = torch.cat(label_parts)
        # HF's loss scores label i from row i - 1: at a document start that row is the previous document's end.
        labels[_starts(lengths)] = IGNORE_INDEX
        input_ids = torch.full((t,), self.pad_token_id, dtype=torch.int64)
        input_ids[:n] = torch.cat(ids_parts)
        position_ids = torch.zeros(t, dtype=torch.int64)
        position_ids[:n] = torch.cat([torch.arange(m, dtype=torch.int64) for m in lengths])
        return {
            "input_ids": input_ids.view(1, t),
            "labels": labels.view(1, t),
            "position_ids": position_ids.view(1, t),
            "cu_seq_lens_q": params.cu_seqlens_q,
            "cu_seq_lens_k": params.cu_seqlens_kv,
            "max_length_q": params.max_seqlen_q,
            "max_length_k": params.max_seqlen_kv,
        }


def check_packed_inputs(inputs: Mapping[str, Any]) -> None:
    """Raise a ``ValueError`` naming the fix unless ``inputs`` is one packed stream with static packing metadata.

    A padded batch (an ``attention_mask``, or batch size above 1) would otherwise reach the ``"packgraph"``
    attention, which separates documents only by ``cu_seq_lens``.
    """
    fix = "use data_collator=PackedCollator(T) (or PackgraphTrainer(..., total_tokens=T))"
    if inputs.get("attention_mask") is not None:
        raise ValueError(f"a padded batch (with an attention_mask) reached a packed model: {fix}")
    input_ids = inputs.get("input_ids")
    if not isinstance(input_ids, Tensor) or input_ids.dim() != 2 or input_ids.shape[0] != 1:
        shape = tuple(input_ids.shape) if isinstance(input_ids, Tensor) else type(input_ids).__name__
        raise ValueError(f"a packed batch is one [1, T] stream of input_ids, got {shape}: {fix}")
    if inputs.get("cu_seq_lens_q") is None and inputs.get("packed_seq_params") is None:
        raise ValueError(f"the batch carries no packing metadata (cu_seq_lens_q, max_length_q): {fix}")
    for name in ("max_length_q", "max_length_k"):
        if isinstance(inputs.get(name), Tensor):
            raise ValueError(f"{name} must be a Python int (static), got a tensor: {fix}")
    cu_q, cu_k = inputs.get("cu_seq_lens_q"), inputs.get("cu_seq_lens_k")
    for name, cu in (("cu_seq_lens_q", cu_q), ("cu_seq_lens_k", cu_k)):
        if cu is not None and (not isinstance(cu, Tensor) or cu.dim() != 1 or cu.numel() < 2):
            shape = tuple(cu.shape) if isinstance(cu, Tensor) else type(cu).__name__
            raise ValueError(
                f"{name} must be 1-D offsets with at least 2 entries, got {shape} (a data loader that slices "
                f"batches along dim 0, e.g. accelerate's dispatch_batches, cuts it): {fix}"
            )
    if cu_q is not None and cu_k is not None and cu_q.shape != cu_k.shape:
        raise ValueError(f"cu_seq_lens_q and cu_seq_lens_k differ in shape: {tuple(cu_q.shape)} vs {tuple(cu_k.shape)}")


# ---------------------------------------------------------------------------------------------------- trainer
class PackgraphTrainerMixin:
    """Packed batches and graphed decoder layers for a ``transformers.Trainer`` subclass (put it first in the bases).

    Keyword args (all other arguments are the base trainer's):
        graphs: capture the decoder layers (default: when ``args.device`` is CUDA). Without CUDA, ``True`` fails at
            the first step unless a stand-in recorder is active (``packgraph.graphs.use_recorder``, for tests).
        total_tokens: when given, the trainer's collator becomes ``PackedCollator(total_tokens, buckets=...)``
            (with TRL's ``SFTTrainer(packing=True)``, replacing its padding-free collator, which emits exact,
            per-batch metadata and rows of varying length).
        buckets: the static metadata policy (default: the collator's, else ``default_buckets(T)``).
        scope: what each layer graph covers: ``"layer"``, ``"attn"`` or ``"mlp"`` (see
            :data:`~packgraph.integrations.hf.SCOPES`; ``"attention"`` is a deprecated alias of ``"attn"``).
        capture_options: passed on to ``graph_decoder_layers`` (``num_warmup_iters``, ``max_graphs``, ...).

    Attributes: ``packgraph_layers`` (the :class:`~packgraph.integrations.hf.GraphedDecoderLayers` handle, None
    until the first training step), ``packgraph_graphs`` (whether graphs are on).
    """

    def __init__(
        self,
        *args: Any,
        graphs: bool | None = None,
        total_tokens: int | None = None,
        buckets: BucketPolicy | None = None,
        scope: str = "layer",
        capture_options: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        given = kwargs.get("data_collator")
        if total_tokens is not None and given is not None and not isinstance(given, PackedCollator):
            raise ValueError(
                f"total_tokens={total_tokens} makes the collator a PackedCollator, but data_collator={given!r} was "
                "given too: pass one of them"
            )
        super().__init__(*args, **kwargs)
        if total_tokens is not None and not isinstance(self.data_collator, PackedCollator):
            # The base trainer's own default (TRL's padding-free collator, say): exact per-batch metadata, rows of
            # varying length, so every batch would be a new graph signature.
            pad = getattr(getattr(self.model, "config", None), "pad_token_id", None)
            self.data_collator = PackedCollator(total_tokens, buckets=buckets, pad_token_id=pad or 0)
        collator = self.data_collator if isinstance(self.data_collator, PackedCollator) else None
        self.packgraph_buckets = buckets if buckets is not None else getattr(collator, "buckets", None)
        self.packgraph_graphs = self.args.device.type == "cuda" if graphs is None else bool(graphs)
        self.packgraph_scope = _resolve_scope(scope)
        self.packgraph_capture_options = dict(capture_options or {})
        self.packgraph_layers: GraphedDecoderLayers | None = None
        self._packgraph_stream: torch.cuda.Stream | None = None  # the loop stream of every train() call
        self._packgraph_total_tokens = getattr(collator, "total_tokens", None)
        _check_model(self.model)
        _check_setup(self)
        # Dispatching slices every tensor of a batch along dim 0 (an IterableDataset's default): it would cut
        # cu_seq_lens down to the batch size. Without it each process reads its own shard, as for a map dataset.
        loader_config = getattr(self.accelerator, "dataloader_config", None)
        if loader_config is not None and getattr(loader_config, "dispatch_batches", False) is not False:
            loader_config.dispatch_batches = False

    # -------------------------------------------------------------------------------- Trainer hooks
    def train(self, *args: Any, **kwargs: Any) -> Any:
        # The whole loop on one non-default CUDA stream: the graphs are recorded on it, and the eager embedding,
        # head, loss and optimizer share their cuBLAS workspaces (packgraph.graphs.recorder). The same stream at every
        # call: a chained stack replays only on the stream it was recorded on.
        device = torch.device(self.args.device)
        if device.type == "cuda" and self._packgraph_stream is None:
            self._packgraph_stream = torch.cuda.Stream(device)
        with loop_stream(device, self._packgraph_stream):
            return super().train(*args, **kwargs)

    def training_step(self, model: nn.Module, inputs: dict[str, Any], *args: Any, **kwargs: Any) -> Tensor:
        if self.packgraph_graphs and self.packgraph_layers is None:
            self._capture_decoder_layers(inputs)
        return super().training_step(model, inputs, *args, **kwargs)

    def compute_loss(self, model: nn.Module, inputs: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        check_packed_inputs(inputs)
        if self.packgraph_buckets is not None and self._packgraph_total_tokens is not None:
            self._check_static(inputs)
        return super().compute_loss(model, inputs, *args, **kwargs)

    def prediction_step(self, *args: Any, **kwargs: Any) -> Any:
        # Evaluation runs the layers eagerly: its no-grad forwards would otherwise each need graphs of their own.
        layers = self.packgraph_layers
        with layers.paused() if layers is not None else contextlib.nullcontext():
            return super().prediction_step(*args, **kwargs)

    def remove_packgraph_graphs(self) -> None:
        """Restore the plain decoder layers; the next training step captures again (if graphs are on)."""
        if self.packgraph_layers is not None:
            self.packgraph_layers.remove()
            self.packgraph_layers = None

    # -------------------------------------------------------------------------------- internals
    def _capture_decoder_layers(self, inputs: Mapping[str, Any]) -> None:
        check_packed_inputs(inputs)
        model = self.accelerator.unwrap_model(self.model)
        device = next(model.parameters()).device
        sample = _sample_batch(inputs, device)
        if self._packgraph_total_tokens is None:
            self._packgraph_total_tokens = sample.total_tokens
        if self.packgraph_buckets is None:
            self.packgraph_buckets = default_buckets(sample.total_tokens)
        model.train()
        # One graph set per bucket the run meets: room for all of them, so none is evicted and captured again.
        options = {"max_graphs": self.packgraph_buckets.num_buckets, **self.packgraph_capture_options}
        # The graphs bake in the autocast state they are captured under: capture under the one accelerate wraps
        # the model's forward in (bf16/fp16), or every call would capture again.
        with self.accelerator.autocast():
            self.packgraph_layers = graph_decoder_layers(
                model, sample, scope=self.packgraph_scope, buckets=self.packgraph_buckets, **options
            )
        logger.info(
            "packgraph: captured %d decoder layers (scope %s, T=%d, %s)",
            len(self.packgraph_layers.targets),
            self.packgraph_scope,
            sample.total_tokens,
            self.packgraph_buckets.describe(),
        )

    def _check_static(self, inputs: Mapping[str, Any]) -> None:
        """Every batch has the run's ``T`` rows and one of the policy's buckets (few graphs, no silent slicing)."""
        t = inputs["input_ids"].shape[1]
        if t != self._packgraph_total_tokens:
            raise ValueError(
                f"packed training here runs fixed-shape batches of {self._packgraph_total_tokens} rows, got {t}: "
                "use one PackedCollator(T) for the whole run"
            )
        cu, max_len = inputs.get("cu_seq_lens_q"), inputs.get("max_length_q")
        if cu is None or max_len is None:
            return  # packed_seq_params: the engine buckets and validates them itself
        policy = self.packgraph_buckets
        capacity = cu.numel() - 1
        if max_len not in policy.max_seqlen_ladder or capacity not in policy.capacity_ladder:
            raise ValueError(
                f"the batch's static metadata (max_length_q={max_len}, capacity={capacity}) is not a bucket of "
                f"{policy.describe()}: every new value would capture new graphs. Build batches with "
                "PackedCollator(T, buckets=policy), the policy this trainer graphs with"
            )


class PackgraphTrainer(PackgraphTrainerMixin, Trainer):
    """``transformers.Trainer`` on packed batches with graphed decoder layers; see :class:`PackgraphTrainerMixin`."""


def _check_model(model: nn.Module) -> None:
    attn = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if attn not in ATTENTION_NAMES:
        raise ValueError(
            f"the model runs attn_implementation={attn!r}; packed batches need attn_implementation='packgraph' "
            "or 'packgraph_doc_mask' "
            "(from_pretrained(..., attn_implementation='packgraph') or model.set_attn_implementation('packgraph'))"
        )


def _check_setup(trainer: Any) -> None:
    """Refuse, by name, what packed (and, with graphs, graphed) training cannot serve correctly."""
    args = trainer.args
    if getattr(args, "n_gpu", 1) > 1:
        raise ValueError(
            f"{args.n_gpu} GPUs in one process (DataParallel) split the batch dimension, and a packed batch has "
            "one [1, T] row: launch one process per GPU (torchrun / accelerate launch) or set CUDA_VISIBLE_DEVICES"
        )
    if not trainer.packgraph_graphs:
        return
    why_not = "pass graphs=False to train packed and eager instead"
    refused = [
        (getattr(args, "torch_compile", False), "torch_compile=True would trace through the graph replays: set it "
         "to False (packgraph captures the layers itself)"),
        (getattr(trainer, "is_deepspeed_enabled", False) or getattr(args, "deepspeed", None), "DeepSpeed gathers "
         "and frees parameters around each layer, outside the graphs, which would read freed storage"),
        (_fsdp_version(trainer) == 1, "FSDP1 flattens the parameters and frees them around each layer, outside the "
         "graphs, which would read freed storage: use FSDP2 (fsdp_config={'version': 2}), whose units packgraph "
         "graphs"),
        (getattr(args, "bf16_full_eval", False) or getattr(args, "fp16_full_eval", False), "bf16/fp16_full_eval "
         "casts the model (new parameter storage) and the graphs would keep reading the old weights"),
    ]  # fmt: skip
    for bad, reason in refused:
        if bad:
            raise ValueError(f"PackgraphTrainer with graphs: {reason}; {why_not}")


def _fsdp_version(trainer: Any) -> int | None:
    """The FSDP version the trainer runs (1 or 2), or ``None`` without FSDP."""
    args = trainer.args
    if not (getattr(trainer, "is_fsdp_enabled", False) or getattr(args, "fsdp", None)):
        return None
    plugin = getattr(getattr(trainer, "accelerator", None), "state", None)
    plugin = getattr(plugin, "fsdp_plugin", None)
    if plugin is not None:
        return int(plugin.fsdp_version)
    return int((getattr(args, "fsdp_config", None) or {}).get("version", 1))


def _sample_batch(inputs: Mapping[str, Any], device: torch.device) -> PackedBatch:
    """The capture sample: a ``PackedBatch`` view of one collated batch (only its shapes and metadata matter)."""
    params = inputs.get("packed_seq_params")
    if params is None:
        params = PackedSeqParams.from_hf_kwargs(inputs)
    tokens = inputs["input_ids"].reshape(-1)
    labels = inputs["labels"].reshape(-1) if inputs.get("labels") is not None else tokens
    position_ids = inputs.get("position_ids")
    position_ids = torch.zeros_like(tokens) if position_ids is None else position_ids.reshape(-1)
    return PackedBatch(
        tokens=tokens,
        labels=labels,
        loss_mask=(labels != IGNORE_INDEX).float(),
        position_ids=position_ids,
        packed_seq_params=params,
    ).to(device)


# ---------------------------------------------------------------------------------------------------- host helpers
def _as_row(x: Any, name: str, n: int | None = None) -> Tensor:
    t = torch.as_tensor(x)
    if t.dim() == 2 and t.shape[0] == 1:
        t = t[0]
    if t.dim() != 1 or (n is not None and t.numel() != n):
        want = "a 1-D token sequence" if n is None else f"{n} entries, like input_ids"
        raise ValueError(f"{name} must be {want}, got shape {tuple(t.shape)}")
    return t.to("cpu", torch.int64)


def _feature_lengths(feature: Mapping[str, Any], n: int, k: int) -> list[int]:
    """The document lengths inside one feature: ``seq_lengths``, else ``position_ids`` restarts, else one."""
    if feature.get("seq_lengths") is not None:
        lengths = [int(m) for m in torch.as_tensor(feature["seq_lengths"]).reshape(-1).tolist()]
        if sum(lengths) != n or any(m < 0 for m in lengths):
            raise ValueError(f"features[{k}]['seq_lengths'] = {lengths} does not add up to its {n} input_ids")
        return lengths
    if feature.get("position_ids") is not None and n > 0:
        pos = _as_row(feature["position_ids"], f"features[{k}]['position_ids']", n)
        starts = [0, *(torch.nonzero(pos.diff() != 1).view(-1) + 1).tolist(), n]
        return [b - a for a, b in pairwise(starts)]
    return [n]


def _starts(lengths: Sequence[int]) -> list[int]:
    out, total = [], 0
    for m in lengths:
        out.append(total)
        total += m
    return out
