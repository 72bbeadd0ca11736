"""The model families of issue #32 with graphed decoder layers, on the CPU stand-ins (tests/eager_recorder.py).

For each family and scope (``"layer"``, ``"attn"``, ``"mlp"``) ``graph_decoder_layers`` runs the production engine
on a stand-in recorder; the reference is the same model, packed and eager (test_hf_families.py ties that to each
document alone). Every test runs under both stand-ins (tests/conftest.py): the eager one re-runs the Python body at
each replay, so only the op-replay one, which replays the recorded aten ops and refuses host reads as a CUDA capture
does, tells which scopes capture (integer indexing included, as CUDA graphs capture it).

MoE: transformers 5 runs the experts through ``experts_implementation``: ``"grouped_mm"`` (its default),
``"batched_mm"`` or ``"eager"``. The routers (softmax and top-k) read nothing on the host, so the attention of every
MoE model is captured; whole layers and MoE blocks are captured with ``"grouped_mm"`` and ``"batched_mm"`` here, and
refused with ``"eager"``, whose loop over the experts hit needs ``nonzero`` and reads the expert ids on the host. (On
CUDA, ``"grouped_mm"`` has no host read only where torch's fused grouped GEMM runs: bf16 weights on sm90/sm100;
tests/cuda/test_hf_families_cuda.py.)
"""

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from packgraph.graphs import use_recorder  # noqa: E402
from packgraph.host_syncs import GraphCaptureError  # noqa: E402
from packgraph.integrations import hf  # noqa: E402
from packgraph.integrations.hf_families import FAMILIES, documents, packed_batch, tiny_model  # noqa: E402
from tests.eager_recorder import EagerRecorder, OpReplayRecorder  # noqa: E402

TOL = dict(atol=1e-6, rtol=1e-5)
MOE = [n for n, f in FAMILIES.items() if f.moe]


def _stand_in():
    return EagerRecorder()


def _replays_ops():
    return EagerRecorder is OpReplayRecorder


def _batches():
    """Two packings of one static signature (capacity 8, max_seqlen 32): one capture, then a replay."""
    return [
        packed_batch(documents(lengths, seed), capacity=8, max_seqlen=32)
        for seed, lengths in enumerate([(5, 17, 1, 9, 12, 26), (30, 2, 7, 11)])
    ]


def _cases():
    cases = []
    for name, family in FAMILIES.items():
        for experts in ("grouped_mm", "batched_mm", "eager") if family.moe else (None,):
            ids = [name, experts] if experts else [name]
            cases += [pytest.param(name, experts, scope, id="-".join([*ids, scope])) for scope in hf.SCOPES]
    return cases


@pytest.mark.parametrize("name,experts,scope", _cases())
def test_graphed_scopes_equal_packed_eager(name, experts, scope):
    model = tiny_model(name, experts_implementation=experts).train()
    ref = tiny_model(name, state_dict=model.state_dict(), experts_implementation=experts).train()
    batches = _batches()
    if experts == "eager" and scope != "attn" and _replays_ops():
        with pytest.raises(GraphCaptureError, match="reads device values on the host") as info:
            with use_recorder(_stand_in()):
                hf.graph_decoder_layers(model, batches[0], scope=scope)
        assert "experts_implementation='eager'" in str(info.value)  # and what to do instead
        assert not any("forward" in m.__dict__ for m in model.modules())
        hf.packed_forward(model, batches[0], compute_loss=True).loss.backward()  # still runs, packed and eager
        return
    with use_recorder(_stand_in()):
        handle = hf.graph_decoder_layers(model, batches[0], scope=scope)
    for batch in batches:
        model.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
        out = hf.packed_forward(model, batch, compute_loss=True)
        want = hf.packed_forward(ref, batch, compute_loss=True)
        out.loss.backward()
        want.loss.backward()
        torch.testing.assert_close(out.logits, want.logits, **TOL)
        for (n, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
            assert (p.grad is None) == (q.grad is None), n
            if p.grad is not None:
                torch.testing.assert_close(p.grad, q.grad, **TOL, msg=n)
    assert [g.captures for g in handle.graphed] == [1] * model.config.num_hidden_layers
    handle.remove()


@pytest.mark.parametrize("scope", hf.SCOPES)
def test_router_logits_are_refused_where_the_routers_are_graphed(scope):
    """transformers records router logits (the load-balancing loss) with forward hooks on the routers, which a
    replay does not run: graphed layers or MoE blocks refuse output_router_logits=True; graphed attention keeps the
    routers eager and its aux loss is packed eager's."""
    name = "qwen3_moe"
    model = tiny_model(name, experts_implementation="batched_mm").train()
    ref = tiny_model(name, state_dict=model.state_dict(), experts_implementation="batched_mm").train()
    batch = _batches()[0]
    with use_recorder(_stand_in()), torch.no_grad():
        hf.graph_decoder_layers(model, batch, scope=scope, forward_only=True)
        if scope != "attn":
            with pytest.raises(ValueError, match="output_router_logits=True"):
                hf.packed_forward(model, batch, output_router_logits=True)
            return
        out = hf.packed_forward(model, batch, output_router_logits=True)
        want = hf.packed_forward(ref, batch, output_router_logits=True)
    torch.testing.assert_close(out.aux_loss, want.aux_loss, **TOL)
    assert len(out.router_logits) == model.config.num_hidden_layers


# ---------------------------------------------------------------------------------------------------- Trainer
@pytest.mark.parametrize("name,scope", [("gpt_oss", "attn"), ("gemma2", "layer")])
def test_packgraph_trainer_graphed_equals_packed_eager(name, scope, tmp_path):
    """The same path as a Llama: PackgraphTrainer with graphs (stand-in) trains like PackgraphTrainer without."""
    from packgraph.buckets import BucketPolicy
    from packgraph.integrations.hf_trainer import PackgraphTrainer, pack_dataset

    total = 64
    policy = BucketPolicy((32, 64), (8,))
    examples = [{"input_ids": d.tolist()} for d in documents((5, 17, 1, 9, 12, 26, 30, 2, 7, 11, 20, 13), seed=5)]
    rows = pack_dataset(examples, total, buckets=policy)
    init = tiny_model(name).state_dict()
    losses = {}
    for graphs in (False, True):
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path / str(graphs)), use_cpu=True, per_device_train_batch_size=1, max_steps=len(rows),
            learning_rate=1e-2, lr_scheduler_type="constant", optim="adamw_torch", save_strategy="no", report_to=[],
            disable_tqdm=True, seed=0, dataloader_num_workers=0, logging_steps=1,
        )  # fmt: skip
        trainer = PackgraphTrainer(
            model=tiny_model(name, state_dict=init), args=args, train_dataset=rows, total_tokens=total,
            buckets=policy, graphs=graphs, scope=scope, capture_options={"num_warmup_iters": 1},
        )  # fmt: skip
        with use_recorder(_stand_in()):
            trainer.train()
        losses[graphs] = [log["loss"] for log in trainer.state.log_history if "loss" in log]
        if graphs:
            assert trainer.packgraph_layers is not None and trainer.packgraph_layers.scope == scope
    assert len(losses[True]) == len(rows) > 1
    torch.testing.assert_close(torch.tensor(losses[True]), torch.tensor(losses[False]), atol=1e-5, rtol=1e-5)


class _HostRead(torch.nn.Module):
    def forward(self, x):
        x.sum().item()  # what a capture must refuse
        return x


def test_a_dense_model_gets_no_moe_hint():
    """Every transformers 5 config says experts_implementation="eager"; only models with experts get the MoE note."""
    model = tiny_model("llama").train()
    for layer in model.model.layers:
        layer.mlp.act_fn = _HostRead()
    if not _replays_ops():
        return  # the eager stand-in re-runs Python: it cannot see a host read
    with pytest.raises(GraphCaptureError, match="reads device values on the host") as info:
        with use_recorder(_stand_in()):
            hf.graph_decoder_layers(model, _batches()[0], scope="mlp")
    assert "MoE" not in str(info.value)


@pytest.mark.parametrize("scope", hf.SCOPES)
def test_one_capture_per_layer_under_autocast(scope):
    """Under bf16 autocast a partial scope's layer k > 0 is sampled at capture with the input dtype a real call
    brings (the float32 norm of the residual stream), so the first real step replays: one capture per layer."""
    model = tiny_model("llama").train()
    batches = _batches()
    with use_recorder(_stand_in()):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            handle = hf.graph_decoder_layers(model, batches[0], scope=scope)
        for batch in batches:
            model.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = hf.packed_forward(model, batch, compute_loss=True)
            out.loss.backward()
    assert [g.captures for g in handle.graphed] == [1] * model.config.num_hidden_layers
    handle.remove()
