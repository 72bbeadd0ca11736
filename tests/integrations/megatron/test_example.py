"""examples/megatron_packed_gpt.py on the CPU: the eager comparison end to end, and a graphed run driven through
the real engine with the CPU stand-in recorder, against the eager run (same weights, same batches)."""

import pytest
import torch

pytest.importorskip("megatron.core")

from packgraph.graphs import use_recorder  # noqa: E402
from tests.eager_recorder import EagerRecorder  # noqa: E402
from tests.megatron_shims import megatron_on_cpu  # noqa: E402


@pytest.fixture(scope="module")
def example():
    from examples import megatron_packed_gpt as module

    with megatron_on_cpu():
        yield module


def _tiny(example, **overrides):
    fields = dict(
        steps=6, T=128, d_model=32, layers=2, heads=4, query_groups=2, max_docs=30, device="cpu", dtype=torch.float32
    )
    fields.update(overrides)
    return example.ExampleConfig(**fields)


def test_eager_run_trains_and_writes_its_results(example, tmp_path):
    summary = example.run(_tiny(example, scopes=()), out_dir=tmp_path, echo=None)
    losses = summary["runs"]["eager"]["losses"]
    assert len(losses) == 6 and all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0]  # AdamW at lr 1e-3 on byte tokens: the loss drops within a few steps
    assert (tmp_path / "results.json").exists()
    with pytest.raises(RuntimeError, match="need CUDA"):
        example.run(_tiny(example), echo=None)


def test_graphed_run_equals_the_eager_run(example):
    cfg = _tiny(example)
    batches = example.make_batches(cfg)
    # T=128 gives one bucket, captured before the first step (the stand-in records by running the bodies).
    assert len({b.bucket for b in batches}) == 1
    state = {k: v.clone() for k, v in example.build_model(cfg).state_dict().items() if v is not None}
    eager = example.train_run(cfg, state, batches)
    with use_recorder(EagerRecorder()):
        graphed = example.train_run(cfg, state, batches, scope="layer")
    assert graphed["losses"] == eager["losses"]
    assert graphed["graphs_captured"] == cfg.layers and graphed["signatures"] == 1
