"""Liger kernels with ``PackgraphTrainer``'s graphed decoder layers on Qwen3-MoE, on the H200: the cases and checks of
tests/cuda/test_liger_cuda.py (its docstring says what they are), in a process and a file of their own so that
``scripts/gpu-check --jobs`` runs them beside the dense families."""

import pytest

pytest.importorskip("transformers")
pytest.importorskip("liger_kernel")

from tests.cuda.test_liger_cuda import CASES, check_case, run_cases  # noqa: E402

FAMILIES = ["qwen3_moe"]
MY_CASES = [c for c in CASES if c[0] in FAMILIES]


@pytest.fixture(scope="module")
def liger_runs(tmp_path_factory):
    return run_cases(tmp_path_factory, FAMILIES)


@pytest.mark.parametrize("name,weights,scope", MY_CASES, ids=["-".join(c) for c in MY_CASES])
def test_liger_moe_graphed_equal_liger_eager(name, weights, scope, liger_runs, report):
    check_case(liger_runs, name, weights, scope, report)
