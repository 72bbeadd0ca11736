"""What the bench tests share: the record schema written out independently of the harness, record builders, and
the goals (:mod:`packgraph.bench.targets`)."""

from types import ModuleType

from packgraph.bench.report import derive

# The schema a results.json record must follow (written out here, independently of the harness' own table).
NUM = (int, float)
OPT_NUM = (int, float, type(None))
RECORD_TYPES = {
    "model": str,
    "T": int,
    "mix": str,
    "method": str,
    "status": str,
    "error": (str, type(None)),
    "device": str,
    "timer": (str, type(None)),
    "steps": int,
    "step_ms": OPT_NUM,
    "step_ms_p10": OPT_NUM,
    "step_ms_p90": OPT_NUM,
    "real_tokens_per_step": OPT_NUM,
    "tokens_per_s": OPT_NUM,
    "speedup_vs_eager": OPT_NUM,
    "gpu_busy_ms": OPT_NUM,
    "gpu_copy_ms": OPT_NUM,
    "kernels_per_step": OPT_NUM,
    "busy_steps": (int, type(None)),
    "step_ms_busy_batches": OPT_NUM,
    "gpu_busy_by_class": (dict, type(None)),
    "top_kernels": (list, type(None)),
    "step_over_busy": OPT_NUM,
    "first_step_s": OPT_NUM,
    "first_loss": OPT_NUM,
    "first_loss_vs_eager": OPT_NUM,
    "graphs": (int, type(None)),
    "graph_batches": (int, type(None)),
    "predicted_graphs": (int, type(None)),
    "recompiles": (int, type(None)),
    "peak_mem_mib": OPT_NUM,
    "peak_mem_timed_mib": OPT_NUM,
    "peak_reserved_mib": OPT_NUM,
    "peak_requested_mib": OPT_NUM,
    "elapsed_s": OPT_NUM,
    "extra": dict,
    "run": int,
}


def load_targets() -> ModuleType:
    """:mod:`packgraph.bench.targets`."""
    from packgraph.bench import targets

    return targets


def record(method, step_ms, busy=None, first=None, graphs=None, peak=None, tokens=1000.0, mix="corpus", requested=None):
    row = dict.fromkeys(RECORD_TYPES)
    row.update(
        model="small",
        T=2048,
        mix=mix,
        method=method,
        status="ok",
        step_ms=step_ms,
        gpu_busy_ms=busy,
        first_step_s=first,
        graphs=graphs,
        graph_batches=200 if graphs is not None else None,
        peak_mem_mib=peak,
        peak_requested_mib=requested,
        real_tokens_per_step=tokens,
        extra={},
        run=0,
    )
    return row


def results_doc(records):
    derive(records)
    return {"machine": {"gpu": "Test GPU"}, "runs": [], "records": records, "attention": []}


def one_cell_records() -> list[dict]:
    """small T=2048 corpus: eager, packgraph, packgraph-model, compile-ro and padded, with chosen figures."""
    return [
        record("eager", 20.0, busy=4.0, first=0.5, peak=1000.0, requested=990.0),
        record("packgraph", 5.0, busy=4.5, first=1.0, graphs=6, peak=1050.0, requested=980.1),  # 1.11x busy: met
        record("packgraph-model", 5.0, busy=4.5, first=2.0, graphs=6),  # 1.11x busy > 1.05: not met
        record("compile-ro", 5.5, busy=4.0, first=15.0, graphs=40),
        record("padded", 30.0, busy=20.0),
    ]


def busy_split_cell() -> tuple[dict, dict]:
    """``(eager, packgraph)`` records whose GPU-busy times are split by kernel class."""
    eager = record("eager", 20.0, busy=4.0)
    pg = record("packgraph", 5.0, busy=4.4)
    eager["gpu_busy_by_class"] = {"gemm": 3.0, "attention fwd": 0.5, "elementwise": 0.5, "memcpy/memset": 0.1}
    pg["gpu_busy_by_class"] = {"gemm": 3.0, "attention fwd": 0.8, "elementwise": 0.6, "memcpy/memset": 0.3}
    eager["busy_steps"] = pg["busy_steps"] = 8
    pg["kernels_per_step"] = 2170.0
    pg["step_ms_busy_batches"] = 4.84  # the profiled batches' mean step, not the pool's median
    return eager, pg
