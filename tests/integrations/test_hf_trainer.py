"""Hugging Face ``Trainer`` on packed batches (packgraph.integrations.hf_trainer), on the CPU, with the real Trainer.

References are independent of the code under test: a hand-written packed loop (``PackedBatch.from_documents``,
``packed_forward``, packgraph's own loss, torch's AdamW), every document run alone through transformers' own
"eager" attention, one Trainer step on the union of two accumulated batches, and batch layouts written out by hand.
The graphed path runs the production engine on a stand-in recorder (``packgraph.graphs.use_recorder``).
"""

import copy
import types
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # transformers.Trainer needs it

from packgraph.buckets import BucketPolicy  # noqa: E402
from packgraph.graphs import use_recorder  # noqa: E402
from packgraph.integrations import hf  # noqa: E402
from packgraph.integrations.hf_trainer import (  # noqa: E402
    PackedCollator,
    PackgraphTrainer,
    PackgraphTrainerMixin,
    check_packed_inputs,
    pack_dataset,
)
from packgraph.integrations.hf_trainer import _check_setup as check_setup  # noqa: E402
from packgraph.packing import PackedBatch  # noqa: E402
from tests.eager_recorder import EagerRecorder  # noqa: E402

VOCAB = 97
T = 64
POLICY = BucketPolicy((16, 64), (4, 16))  # a few buckets, so the runs cross static signatures
LR = 1e-2


def _config():
    return transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )


def _model(attn="packgraph", state_dict=None):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(_config()), attn_implementation=attn)
    if state_dict is not None:
        model.load_state_dict(state_dict)
    return model


def _examples(n=24, seed=0, prompt_mask=True):
    """Tokenized examples of varied lengths; every third one masks its first tokens out of the loss (a prompt)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for k in range(n):
        length = int(torch.randint(2, 30, (1,), generator=g))
        ids = torch.randint(0, VOCAB, (length,), generator=g)
        labels = ids.clone()
        if prompt_mask and k % 3 == 0:
            labels[: length // 2] = -100
        out.append({"input_ids": ids.tolist(), "labels": labels.tolist()})
    return out


class _InOrder(torch.utils.data.IterableDataset):
    """Rows in their order (an IterableDataset has no sampler), so a reference can follow the same batches."""

    def __init__(self, rows):
        self.rows = list(rows)

    def __iter__(self):
        return iter(self.rows)


class _Recording(PackgraphTrainer):
    """Keeps each micro-batch's loss (what Trainer accumulates into its logged loss) for exact comparison."""

    def training_step(self, model, inputs, *args, **kwargs):
        loss = super().training_step(model, inputs, *args, **kwargs)
        self.micro_losses.append(loss.item())
        return loss


def _args(tmp_path, steps, **overrides):
    kw = dict(
        output_dir=str(tmp_path),
        use_cpu=True,
        per_device_train_batch_size=1,
        per_device_eval_batch_size=1,
        max_steps=steps,
        learning_rate=LR,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        optim="adamw_torch",
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        seed=0,
        dataloader_num_workers=0,
    )
    kw.update(overrides)
    return transformers.TrainingArguments(**kw)


def _train(tmp_path, rows, steps, *, graphs=False, total_tokens=T, **overrides):
    trainer = _Recording(
        model=_model(),
        args=_args(tmp_path, steps, **overrides),
        train_dataset=_InOrder(rows),
        total_tokens=total_tokens,
        buckets=POLICY if total_tokens == T else None,
        graphs=graphs,
        capture_options={"num_warmup_iters": 1},
    )
    trainer.micro_losses = []
    trainer.train()
    return trainer


def _docs_of(row):
    """A pack_dataset row back to its documents (ids, labels), from its restarting position_ids."""
    starts = [i for i, p in enumerate(row["position_ids"].tolist()) if p == 0] + [row["input_ids"].numel()]
    return [(row["input_ids"][a:b], row["labels"][a:b]) for a, b in zip(starts, starts[1:], strict=False)]


def _reference_step(model, opt, loss):
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)


def _assert_same_params(a, b, tol):
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(p, q, atol=tol, rtol=tol, msg=name)


# ---------------------------------------------------------------------------------------------------- training
def test_trainer_losses_equal_the_hand_written_packed_loop(tmp_path):
    rows = pack_dataset(_examples(), T, buckets=POLICY)
    steps = len(rows)
    trainer = _train(tmp_path, rows, steps)
    ref = _model(state_dict=_model().state_dict()).train()
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.0)
    ref_losses = []
    for row in rows:
        docs = _docs_of(row)
        batch = PackedBatch.from_documents([ids for ids, _ in docs], bin_size=T, capacity=16, max_seqlen=T, pad_id=0)
        # The hand loop's labels are pre-shifted: drop targets a document's own labels mask (the "prompt").
        masked = torch.tensor(sum((labels[1:].eq(-100).tolist() + [True] for _, labels in docs), []))
        batch.labels[: masked.numel()][masked] = -100
        batch.loss_mask = (batch.labels != -100).float()
        loss = hf.packed_forward(ref, batch, compute_loss=True).loss
        ref_losses.append(loss.item())
        _reference_step(ref, opt, loss)
    assert len(trainer.micro_losses) == steps
    torch.testing.assert_close(torch.tensor(trainer.micro_losses), torch.tensor(ref_losses), atol=1e-5, rtol=1e-5)
    assert ref_losses[-1] < ref_losses[0]  # it trains
    _assert_same_params(trainer.model, ref, 1e-5)


def test_token_weighted_loss_equals_per_document_training(tmp_path):
    """Each step: the sum of every document's next-token losses, run alone with HF's own eager attention, over
    the step's target count; the same update, the same loss."""
    rows = pack_dataset(_examples(seed=1), T, buckets=POLICY)
    steps = 4
    trainer = _train(tmp_path, rows, steps)
    ref = _model("eager", _model().state_dict()).train()
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.0)
    ref_losses = []
    for row in list(rows)[:steps]:
        total, count = 0.0, 0
        for ids, labels in _docs_of(row):
            logits = ref(input_ids=ids.view(1, -1), use_cache=False).logits[0, :-1].float()
            targets = labels[1:]
            total = total + torch.nn.functional.cross_entropy(logits, targets, ignore_index=-100, reduction="sum")
            count += int(targets.ne(-100).sum())
        loss = total / count
        ref_losses.append(loss.item())
        _reference_step(ref, opt, loss)
    torch.testing.assert_close(torch.tensor(trainer.micro_losses), torch.tensor(ref_losses), atol=1e-5, rtol=1e-5)
    _assert_same_params(trainer.model, ref, 1e-4)


def test_gradient_accumulation_2_equals_one_step_on_the_union(tmp_path):
    """GA=2 over rows (a, b) == one step on one stream holding a and b (batch size 2: the collator packs both)."""
    rows = pack_dataset(_examples(seed=2), T, buckets=POLICY)
    steps = 3
    accumulated = _train(tmp_path / "ga", rows, steps, gradient_accumulation_steps=2)
    union = _train(tmp_path / "union", rows, steps, total_tokens=2 * T, per_device_train_batch_size=2)
    assert len(accumulated.micro_losses) == 2 * steps and len(union.micro_losses) == steps
    # Each micro loss is its share of the token-weighted mean over both micro-batches (num_items_in_batch).
    per_step = torch.tensor(accumulated.micro_losses).view(steps, 2).sum(1)
    torch.testing.assert_close(per_step, torch.tensor(union.micro_losses), atol=1e-5, rtol=1e-5)
    logged = [e["loss"] for e in accumulated.state.log_history if "loss" in e]
    torch.testing.assert_close(torch.tensor(logged), per_step, atol=1e-4, rtol=1e-4)
    _assert_same_params(accumulated.model, union.model, 1e-5)


def test_graphed_trainer_equals_packed_eager_on_a_cpu_stand_in(tmp_path):
    """graphs=True through the production engine (stand-in recorder): the same losses and weights as packed
    eager; one graph per bucket used; evaluation runs eagerly; save_model writes the plain state_dict."""
    rows = pack_dataset(_examples(seed=3), T, buckets=POLICY)
    steps = len(rows)
    eager = _train(tmp_path / "eager", rows, steps)
    with use_recorder(EagerRecorder()):
        graphed = _train(tmp_path / "graphed", rows, steps, graphs=True)
    torch.testing.assert_close(
        torch.tensor(graphed.micro_losses), torch.tensor(eager.micro_losses), atol=1e-6, rtol=1e-6
    )
    _assert_same_params(graphed.model, eager.model, 1e-6)
    layers = graphed.packgraph_layers
    assert layers is not None and all("forward" in t.__dict__ for t in layers.targets)
    collator = PackedCollator(T, buckets=POLICY)
    used = {(b["max_length_q"], b["cu_seq_lens_q"].numel() - 1) for b in (collator([r]) for r in rows)}
    assert len(used) > 1
    assert [g.num_graphs for g in layers.graphed] == [len(used)] * 2
    captures = [g.captures for g in layers.graphed]

    eval_rows = pack_dataset(_examples(8, seed=4), T, buckets=POLICY)
    got = graphed.evaluate(eval_dataset=eval_rows)["eval_loss"]
    want = eager.evaluate(eval_dataset=eval_rows)["eval_loss"]
    assert got == pytest.approx(want, rel=1e-6)
    assert [g.captures for g in layers.graphed] == captures  # evaluation captured nothing
    assert all("forward" in t.__dict__ for t in layers.targets)  # and the graphs are back

    graphed.save_model(str(tmp_path / "saved"))
    saved = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "saved"), attn_implementation="packgraph")
    state = eager.model.state_dict()
    assert set(saved.state_dict()) == set(state) == set(graphed.model.state_dict())
    for name, value in saved.state_dict().items():
        torch.testing.assert_close(value, state[name], atol=1e-6, rtol=1e-6, msg=name)


def test_attention_scope_is_a_deprecated_alias_of_attn(tmp_path):
    """scope="attention" (the old name) warns once, at construction, naming "attn", and graphs each self_attn."""
    rows = pack_dataset(_examples(4, seed=6), T, buckets=POLICY)
    with use_recorder(EagerRecorder()), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = PackgraphTrainer(
            model=_model(), args=_args(tmp_path, 1), train_dataset=_InOrder(rows), total_tokens=T, buckets=POLICY,
            graphs=True, scope="attention", capture_options={"num_warmup_iters": 1},
        )  # fmt: skip
        trainer.train()
    (warning,) = [w for w in caught if issubclass(w.category, FutureWarning) and "scope=" in str(w.message)]
    assert "'attn'" in str(warning.message) and warning.filename == __file__
    assert trainer.packgraph_scope == "attn" and trainer.packgraph_layers.scope == "attn"
    layers = trainer.accelerator.unwrap_model(trainer.model).model.layers
    assert all(t is layer.self_attn for t, layer in zip(trainer.packgraph_layers.targets, layers, strict=True))


def test_gradient_checkpointing_eager_and_graphed_are_exact(tmp_path):
    """gradient_checkpointing=True: packed eager recomputes through HF's wrapper, graphed layers inside their
    backward graphs (capture_layers(recompute=True), HF's wrapper switched off while graphed); both train as
    without checkpointing."""
    rows = pack_dataset(_examples(6, seed=5), T, buckets=POLICY)
    plain = _train(tmp_path / "plain", rows, 2)
    checkpointed = _train(tmp_path / "gc", rows, 2, gradient_checkpointing=True)
    torch.testing.assert_close(torch.tensor(checkpointed.micro_losses), torch.tensor(plain.micro_losses))
    _assert_same_params(checkpointed.model, plain.model, 1e-6)
    with use_recorder(EagerRecorder()):
        graphed = _train(tmp_path / "graphed-gc", rows, 2, graphs=True, gradient_checkpointing=True)
    torch.testing.assert_close(torch.tensor(graphed.micro_losses), torch.tensor(plain.micro_losses))
    _assert_same_params(graphed.model, plain.model, 1e-6)
    layers = graphed.packgraph_layers
    assert all(g.recompute for g in layers.graphed) and layers.checkpointed
    assert not any(layer.gradient_checkpointing for layer in layers.checkpointed)


# ---------------------------------------------------------------------------------------------------- errors
def _pad_collator(features):
    n = max(len(f["input_ids"]) for f in features)
    ids = torch.zeros(len(features), n, dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for i, f in enumerate(features):
        ids[i, : len(f["input_ids"])] = torch.tensor(f["input_ids"])
        mask[i, : len(f["input_ids"])] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


@pytest.mark.parametrize("batch_size", [1, 2])
def test_a_padded_batch_is_refused(tmp_path, batch_size):
    trainer = PackgraphTrainer(
        model=_model(),
        args=_args(tmp_path, 1, per_device_train_batch_size=batch_size),
        train_dataset=_InOrder(_examples(4)),
        data_collator=_pad_collator,
    )
    with pytest.raises(ValueError, match="padded batch.*PackedCollator"):
        trainer.train()


def test_batch_checks_name_the_fix():
    collated = PackedCollator(T, buckets=POLICY)([{"input_ids": list(range(10))}])
    check_packed_inputs(collated)
    with pytest.raises(ValueError, match=r"one \[1, T\] stream"):
        check_packed_inputs(dict(collated, input_ids=collated["input_ids"].expand(2, -1)))
    with pytest.raises(ValueError, match="no packing metadata"):
        check_packed_inputs({k: v for k, v in collated.items() if not k.startswith(("cu_", "max_"))})
    with pytest.raises(ValueError, match="Python int"):
        check_packed_inputs(dict(collated, max_length_q=torch.tensor(16)))


def test_model_must_run_the_packgraph_attention(tmp_path):
    with pytest.raises(ValueError, match="attn_implementation='packgraph'"):
        PackgraphTrainer(model=_model("eager"), args=_args(tmp_path, 1), total_tokens=T)
    with pytest.raises(ValueError, match="pass one of them"):
        PackgraphTrainer(model=_model(), args=_args(tmp_path, 1), total_tokens=T, data_collator=_pad_collator)


def test_unbucketed_metadata_is_refused_when_graphed(tmp_path):
    """DataCollatorWithFlattening's exact max lengths would capture graphs for every new value."""
    collator = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True)
    with use_recorder(EagerRecorder()):
        trainer = PackgraphTrainer(
            model=_model(), args=_args(tmp_path, 1), train_dataset=_InOrder(_examples(4)), data_collator=collator,
            buckets=POLICY, graphs=True,
        )  # fmt: skip
        with pytest.raises(ValueError, match="not a bucket of"):
            trainer.train()


SETUP = dict(n_gpu=1, world_size=1, gradient_checkpointing=False, torch_compile=False, deepspeed=None, fsdp=[])


def test_fsdp2_is_served_with_graphs():
    """FSDP2 units are graphed (their gathers run eagerly around the graphs); the GPU test trains through them."""
    fsdp2 = dict(SETUP, fsdp=True, fsdp_config={"version": 2})
    check_setup(types.SimpleNamespace(args=types.SimpleNamespace(**fsdp2), packgraph_graphs=True))
    plugin = types.SimpleNamespace(fsdp_version=2)  # what accelerate's state holds wins over the config
    trainer = types.SimpleNamespace(
        args=types.SimpleNamespace(**dict(SETUP, fsdp=True, fsdp_config={})), packgraph_graphs=True,
        accelerator=types.SimpleNamespace(state=types.SimpleNamespace(fsdp_plugin=plugin)), is_fsdp_enabled=True,
    )  # fmt: skip
    check_setup(trainer)
    plugin.fsdp_version = 1
    with pytest.raises(ValueError, match="FSDP1"):
        check_setup(trainer)


@pytest.mark.parametrize(
    "setting, match",
    [
        (dict(torch_compile=True), "torch_compile"),
        (dict(deepspeed="ds.json"), "DeepSpeed"),
        (dict(fsdp=["full_shard"], fsdp_config={"version": 1}), "FSDP1"),
        (dict(bf16_full_eval=True), "full_eval"),
        (dict(n_gpu=2), "DataParallel"),
    ],
)
def test_settings_graphs_cannot_serve_are_refused(setting, match):
    trainer = types.SimpleNamespace(args=types.SimpleNamespace(**{**SETUP, **setting}), packgraph_graphs=True)
    with pytest.raises(ValueError, match=match):
        check_setup(trainer)
    trainer.packgraph_graphs = False  # packed and eager: only DataParallel (it splits the [1, T] row) is refused
    if "n_gpu" in setting:
        with pytest.raises(ValueError, match=match):
            check_setup(trainer)
    else:
        check_setup(trainer)


# ---------------------------------------------------------------------------------------------------- data
def test_collator_layout_by_hand():
    docs = [[5, 6, 7], [8], [9, 10, 11, 12]]
    row = {"input_ids": [5, 6, 7, 8], "labels": [-100, 6, 7, 8], "position_ids": [0, 1, 2, 0]}  # two documents
    plain = {"input_ids": docs[2]}
    out = PackedCollator(12, buckets=BucketPolicy((4, 8), (2, 4)), pad_token_id=1)([row, plain])
    assert out["input_ids"].tolist() == [[5, 6, 7, 8, 9, 10, 11, 12, 1, 1, 1, 1]]
    assert out["labels"].tolist() == [[-100, 6, 7, -100, -100, 10, 11, 12] + [-100] * 4]
    assert out["position_ids"].tolist() == [[0, 1, 2, 0, 0, 1, 2, 3, 0, 0, 0, 0]]
    assert out["cu_seq_lens_q"].tolist() == [0, 3, 4, 8, 8] and out["cu_seq_lens_q"].dtype == torch.int32
    assert out["cu_seq_lens_k"].tolist() == [0, 3, 4, 8, 8]
    assert (out["max_length_q"], out["max_length_k"]) == (4, 4)
    assert type(out["max_length_q"]) is int
    trl_row = {"input_ids": [5, 6, 7, 8, 9], "seq_lengths": [2, 3]}
    out = PackedCollator(8, buckets=BucketPolicy((8,), (4,)))([trl_row])
    assert out["cu_seq_lens_q"].tolist() == [0, 2, 5, 5, 5]
    assert out["labels"].tolist() == [[-100, 6, -100, 8, 9, -100, -100, -100]]
    with pytest.raises(ValueError, match="more than total_tokens=4.*pack_dataset"):
        PackedCollator(4)([trl_row])
    with pytest.raises(ValueError, match="does not add up"):
        PackedCollator(8)([dict(trl_row, seq_lengths=[2, 2])])


def test_collated_batches_score_what_the_hf_collator_scores():
    """Through the model: our fixed-shape batch gives the loss of DataCollatorWithFlattening's exact batch."""
    model = _model().eval()
    examples = _examples(5, seed=6)
    ours = PackedCollator(T, buckets=POLICY)(examples)
    theirs = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True)(examples)
    with torch.no_grad():
        got = model(**ours, use_cache=False)
        want = model(**theirs, use_cache=False)
    n = theirs["input_ids"].shape[1]
    torch.testing.assert_close(got.logits[0, :n], want.logits[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.loss, want.loss, atol=1e-6, rtol=1e-6)


def test_pack_dataset_keeps_every_document_once():
    examples = _examples(40, seed=7)
    policy = BucketPolicy((32, 64), (4,))
    rows = pack_dataset(examples, T, buckets=policy)
    seen = []
    for row in rows:
        assert row["input_ids"].numel() <= T
        docs = _docs_of(row)
        assert len(docs) <= policy.max_capacity
        seen += [(tuple(ids.tolist()), tuple(labels.tolist())) for ids, labels in docs]
    want = [(tuple(e["input_ids"]), tuple(e["labels"])) for e in examples]
    assert sorted(seen) == sorted(want)
    assert 0 < rows.packing.efficiency <= 1
    long = [{"input_ids": list(range(40))}]
    with pytest.raises(ValueError, match="longer than 32 tokens"):
        pack_dataset(long, T, buckets=BucketPolicy((32,), (4,)))
    cut = pack_dataset(long, T, buckets=BucketPolicy((32,), (4,)), overlong="truncate")
    assert cut[0]["input_ids"].tolist() == list(range(32))


# ---------------------------------------------------------------------------------------------------- TRL
def _word_tokenizer():
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {f"t{i}": i for i in range(VOCAB)}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="t1"))
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="t0", eos_token="t2", unk_token="t1"
    )


def test_trl_sft_trainer_packing_equals_the_hand_written_loop(tmp_path):
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    examples = _examples(20, seed=8, prompt_mask=False)
    dataset = datasets.Dataset.from_dict({"input_ids": [e["input_ids"] for e in examples]})
    sft_trainer = type("PackgraphSFTTrainer", (PackgraphTrainerMixin, trl.SFTTrainer), {})
    config = trl.SFTConfig(
        output_dir=str(tmp_path), use_cpu=True, max_steps=4, per_device_train_batch_size=1, learning_rate=LR,
        lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0, optim="adamw_torch",
        report_to=[], save_strategy="no", disable_tqdm=True, logging_steps=1, seed=0,
        packing=True, max_length=T, bf16=False, gradient_checkpointing=False,
    )  # fmt: skip
    trainer = sft_trainer(
        model=_model(), args=config, train_dataset=dataset, processing_class=_word_tokenizer(), total_tokens=T,
        buckets=POLICY,
    )  # fmt: skip
    assert isinstance(trainer.data_collator, PackedCollator)
    seen, losses = [], []
    inner = trainer.training_step

    def recording_step(model, inputs, *args, **kwargs):
        seen.append(inputs["input_ids"][0].clone())
        loss = inner(model, inputs, *args, **kwargs)
        losses.append(loss.item())
        return loss

    trainer.training_step = recording_step
    trainer.train()
    # The reference follows the same TRL rows (found by content: Trainer shuffles them), with TRL's seq_lengths.
    trl_rows = [(torch.tensor(r["input_ids"]), r["seq_lengths"]) for r in trainer.train_dataset]
    ref = _model(state_dict=_model().state_dict()).train()
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.0)
    ref_losses = []
    for stream in seen:
        ids, lengths = next((i, s) for i, s in trl_rows if torch.equal(stream[: i.numel()], i))
        docs = list(ids.split(list(lengths)))
        batch = PackedBatch.from_documents(docs, bin_size=T, capacity=16, max_seqlen=T, pad_id=0)
        loss = hf.packed_forward(ref, batch, compute_loss=True).loss
        ref_losses.append(loss.item())
        _reference_step(ref, opt, loss)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), atol=1e-5, rtol=1e-5)
    _assert_same_params(trainer.model, ref, 1e-5)
