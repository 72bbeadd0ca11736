"""Liger kernels (``TrainingArguments(use_liger_kernel=True)``: RMSNorm, RoPE, SwiGLU, the fused linear
cross-entropy) with ``PackgraphTrainer``'s graphed decoder layers, on the H200.

Liger patches transformers' modeling modules as well as the model (its RoPE replaces the module's
``apply_rotary_pos_emb``, which every later model of the family then uses), so the cases run in a process of their
own, the runs without Liger first. Each case is one family's config (hidden 256, 4 layers, windows of 64 tokens)
trained on the corpus packed into T=2048 streams, three ways from the same weights and data, under deterministic
kernels:

* graphed without Liger: step time only, to show what Liger adds under graphs;
* Liger, packed eager (``graphs=False``): the reference;
* Liger, graphed: the Triton kernels are captured inside the layer graphs; its per-step losses must equal the
  reference's (the same kernels replay).

The fused linear cross-entropy runs outside the layer graphs (after the last layer), where Liger reads the count
of target tokens on the host: that sync is Liger's, in eager code, and costs what it costs without graphs.

The Qwen3-MoE cases are in tests/cuda/test_liger_moe_cuda.py, a process of their own: ``scripts/gpu-check --jobs``
runs files in parallel, and all five cases in one process made this the longest file of the suite.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("liger_kernel")

STEPS, WARM = 24, 8
T = 2048
TOL = 1e-4  # relative, per step: the same kernels replay under deterministic settings
ROOT = Path(__file__).resolve().parents[2]


# Qwen3-MoE's whole layers need bf16 weights: its experts run torch's grouped GEMM, which under autocast falls back
# to a host loop for float32 weights (tests/cuda/test_hf_families_cuda.py); Liger replaces those experts with its own.
CASES = [("llama", "float32", "attn"), ("llama", "float32", "layer"), ("gemma3", "float32", "layer"),
         ("qwen3_moe", "float32", "attn"), ("qwen3_moe", "bfloat16", "layer")]  # fmt: skip


def _cases(out: str, families: list[str]) -> None:
    """Run in a fresh process: the three trainings of each case of ``families`` (module docstring); writes a JSON to
    ``out``."""
    import time

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    assert os.environ.get("LIGER_FUSED_MOE_AUTOTUNE") == "0", "run_cases sets it before the process imports Liger"
    import transformers

    from packgraph.buckets import default_buckets
    from packgraph.data.corpus import PAD_ID, VOCAB_SIZE, load_corpus
    from packgraph.data.stream import split_documents
    from packgraph.integrations.hf_families import size_overrides, tiny_model
    from packgraph.integrations.hf_trainer import PackgraphTrainer, pack_dataset
    from packgraph.train import deterministic_kernels

    class Clock(transformers.TrainerCallback):
        def __init__(self):
            self.t0 = self.t1 = None

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step in (WARM, state.max_steps):
                torch.cuda.synchronize()
                if state.global_step == WARM:
                    self.t0 = time.perf_counter()
                else:
                    self.t1 = time.perf_counter()

    policy = default_buckets(T)
    docs = split_documents(load_corpus(max_docs=200), 512, min_len=8, seed=0)
    rows = pack_dataset([{"input_ids": d.tolist()} for d in docs], T, buckets=policy)

    def config(name):
        return dict(
            size_overrides(name, hidden_size=256, num_layers=4, window=64, max_positions=T),
            vocab_size=VOCAB_SIZE, pad_token_id=PAD_ID, initializer_range=0.02,
        )  # fmt: skip

    # The initial weights, drawn before any Liger patch: Liger swaps transformers' classes (its MLP, its norm), and
    # a model built after that could draw its random weights in another order.
    cases = [case for case in CASES if case[0] in families]
    inits = {case: tiny_model(case[0], dtype=getattr(torch, case[1]), **config(case[0])).state_dict() for case in cases}

    def train(name, weights, scope, *, liger, graphs):
        init = inits[(name, weights, scope)]
        model = tiny_model(name, dtype=getattr(torch, weights), state_dict=init, **config(name)).cuda()
        args = transformers.TrainingArguments(
            output_dir=f"{out}.runs", per_device_train_batch_size=1, max_steps=STEPS, learning_rate=1e-3,
            lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0, bf16=True,
            logging_steps=1, save_strategy="no", report_to=[], disable_tqdm=True, seed=0,
            dataloader_num_workers=0, use_liger_kernel=liger,
        )  # fmt: skip
        clock = Clock()
        trainer = PackgraphTrainer(
            model=model, args=args, train_dataset=rows, total_tokens=T, buckets=policy, graphs=graphs, scope=scope,
            callbacks=[clock],
        )  # fmt: skip
        run: dict = {}
        try:
            trainer.train()
        except Exception as exc:  # reported: the test decides whether a refusal is expected
            run["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        else:
            run["losses"] = [log["loss"] for log in trainer.state.log_history if "loss" in log]
            run["ms_per_step"] = 1e3 * (clock.t1 - clock.t0) / (STEPS - WARM)
            forward = getattr(model.model.norm.forward, "__func__", None)
            run["liger_norm"] = getattr(forward, "__module__", "").startswith("liger_kernel")
            layers = trainer.packgraph_layers
            run["graphs_per_layer"] = layers.graphed[0].num_graphs if graphs and layers else 0
        trainer.remove_packgraph_graphs()
        del trainer, model
        torch.cuda.empty_cache()
        return run

    results: dict = {}
    with deterministic_kernels(True):
        for case in cases:  # before any Liger patch
            results["-".join(case)] = {"graphed": train(*case, liger=False, graphs=True)}
        for case in cases:
            results["-".join(case)]["liger-eager"] = train(*case, liger=True, graphs=False)
            results["-".join(case)]["liger-graphed"] = train(*case, liger=True, graphs=True)
    Path(out).write_text(json.dumps(results))


def run_cases(tmp_path_factory, families: list[str]) -> dict:
    """The trainings of ``families``' cases, in a process of their own."""
    out = tmp_path_factory.mktemp("liger") / "runs.json"
    code = f"from tests.cuda.test_liger_cuda import _cases; _cases({str(out)!r}, {families!r})"
    # Liger's fused MoE backward adds the routing weights' grad over the intermediate dimension's tiles by float
    # atomics, in the order the tiles finish, and its autotuner picks the tile width by timing (on a shared GPU,
    # either). Pinned to one config (read when Liger's module is imported), BLOCK_N 128, this config's 256
    # intermediate columns are two tiles: two partial sums added to zero give the same bits in either order, so
    # the reference training is deterministic.
    env = {**os.environ, "LIGER_FUSED_MOE_AUTOTUNE": "0"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


FAMILIES = ["llama", "gemma3"]
MY_CASES = [c for c in CASES if c[0] in FAMILIES]


@pytest.fixture(scope="module")
def liger_runs(tmp_path_factory):
    return run_cases(tmp_path_factory, FAMILIES)


@pytest.mark.parametrize("name,weights,scope", MY_CASES, ids=["-".join(c) for c in MY_CASES])
def test_liger_kernels_graphed_equal_liger_eager(name, weights, scope, liger_runs, report):
    check_case(liger_runs, name, weights, scope, report)


def check_case(liger_runs: dict, name: str, weights: str, scope: str, report) -> None:
    """Liger graphed equals Liger eager, step for step; or the one refusal allowed, named."""
    runs = liger_runs[f"{name}-{weights}-{scope}"]
    label = f"liger {name} {weights} weights, scope={scope}"
    for key, run in runs.items():
        if "error" in run:
            report(f"{label} {key}: refused", run["error"])
    ref, got, plain = runs["liger-eager"], runs["liger-graphed"], runs["graphed"]
    assert "error" not in ref, ref["error"]
    if "error" in got:
        # The only refusal allowed: a capture refusal (named, with its fix) of a whole MoE layer, where Liger's
        # fused MoE experts replace transformers' grouped GEMM; the attention side must always capture.
        assert got["error"].startswith("GraphCaptureError"), got["error"]
        assert name == "qwen3_moe" and scope == "layer", got["error"]
        assert "error" not in plain, plain["error"]  # without Liger, these layers capture
        return
    eager, graphed = torch.tensor(ref["losses"]), torch.tensor(got["losses"])
    assert len(eager) == len(graphed) == STEPS
    rel = ((graphed - eager).abs() / eager.abs()).max().item()
    report(f"{label}: graphed vs eager (both Liger) max rel loss diff, bitwise-equal steps",
           f"{rel:.2e}, {int((graphed == eager).sum())}/{STEPS}")  # fmt: skip
    times = [run.get("ms_per_step", float("nan")) for run in (ref, got, plain)]
    report(f"{label}: ms/step Liger eager / Liger graphed / graphed without Liger", "/".join(f"{t:.2f}" for t in times))
    assert ref["liger_norm"] and got["liger_norm"], "Trainer did not apply Liger's RMSNorm"
    assert not plain.get("liger_norm"), "the run without Liger ran Liger's RMSNorm"
    assert rel <= TOL
    assert eager[-1] < eager[0]
    assert got["graphs_per_layer"] >= 1
