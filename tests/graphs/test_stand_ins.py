"""The CPU stand-in recorders themselves. ``OpReplayRecorder`` must never be more forgiving than a CUDA graph: it
runs no Python at replay, refuses host reads at capture, leaves the capture's own tensors unwritten until the first
replay, and overwrites what CUDA may reuse: at each replay what its recording let go of, and what only its logs
hold at later captures of the pool and the replays of their graphs. ``EagerRecorder`` re-runs the Python body, which
the engine tests run under too."""

import pytest
import torch
from torch import nn

from packgraph.graphs import GraphCaptureError
from packgraph.graphs.capture import capture_with
from packgraph.graphs.memory import unowned_storage

# No global named EagerRecorder: these tests are about each stand-in, which tests/conftest.py must not swap.
from tests import eager_recorder as stand_ins


class _Counting(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4).double()
        self.calls = 0

    def forward(self, x):
        self.calls += 1  # a Python side effect
        return self.lin(x).relu()


def _x(seed):
    return torch.randn(3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(seed), requires_grad=True)


def test_op_replay_runs_no_python_and_equals_eager():
    module = _Counting()
    graphed = capture_with(stand_ins.OpReplayRecorder(), module, (_x(0),))
    after_capture = module.calls
    for seed in range(1, 4):
        x = _x(seed)
        out = graphed(x)
        out.sum().backward()
        got = (out.detach().clone(), x.grad.clone(), module.lin.weight.grad.clone())
        module.zero_grad(set_to_none=True)
        x = _x(seed)
        want = module(x)
        want.sum().backward()
        module.calls -= 1
        torch.testing.assert_close(got[0], want.detach(), rtol=0, atol=0)
        torch.testing.assert_close(got[1], x.grad, rtol=0, atol=0)
        torch.testing.assert_close(got[2], module.lin.weight.grad, rtol=0, atol=0)
        module.zero_grad(set_to_none=True)
    assert module.calls == after_capture  # replays ran no Python


def test_eager_recorder_reruns_python_at_each_replay():
    module = _Counting()
    graphed = capture_with(stand_ins.EagerRecorder(), module, (_x(0),))
    before = module.calls
    graphed(_x(1)).sum().backward()
    assert module.calls == before + 1


class _HostRead(nn.Module):
    def __init__(self, how):
        super().__init__()
        self.lin = nn.Linear(4, 4).double()
        self.how = how

    def forward(self, x):
        y = self.lin(x)
        if self.how == "item":
            return y * y.sum().item()
        if self.how == "bool":
            return y if bool(y.sum() > 0) else -y
        if self.how == "tolist":
            return y * len(y.sum(1).tolist())
        if self.how == "nonzero":
            return y[y.sum(1) > 0].sum(0)
        raise AssertionError(self.how)


@pytest.mark.parametrize("how", ["item", "bool", "tolist", "nonzero"])
def test_op_replay_refuses_what_a_capture_refuses(how):
    """A host read of device values at capture fails as a CUDA capture does, with the line named; the eager
    stand-in lets it through (and would bake the capture's value into every replay)."""
    with pytest.raises(GraphCaptureError, match="host sync"):
        capture_with(stand_ins.OpReplayRecorder(), _HostRead(how), (_x(0),))
    capture_with(stand_ins.EagerRecorder(), _HostRead(how), (_x(0),))


def test_op_replay_leaves_capture_results_unwritten_until_a_replay():
    recorder = stand_ins.OpReplayRecorder()
    lin = nn.Linear(4, 4).double()
    x = _x(0).detach()
    graph, (out,) = recorder.record(lambda: [lin(x)])
    assert torch.isnan(out).all()
    graph.replay()
    torch.testing.assert_close(out, lin(x).detach(), rtol=0, atol=0)


def test_op_replay_writes_no_older_tensor_at_record():
    recorder = stand_ins.OpReplayRecorder()
    older = torch.zeros(4, dtype=torch.float64)
    src = torch.arange(4, dtype=torch.float64)
    graph, _ = recorder.record(lambda: [older.copy_(src * 2)])
    assert torch.equal(older, torch.zeros(4, dtype=torch.float64)) and recorder.skipped_writes == 1
    graph.replay()
    assert torch.equal(older, src * 2)
    src += 1
    graph.replay()  # reads its inputs at every replay
    assert torch.equal(older, src * 2)


def test_op_replay_draws_fresh_dropout_masks_and_its_backward_reads_them():
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(64, 64), nn.Dropout(0.5)).double()
    graphed = capture_with(stand_ins.OpReplayRecorder(), module, (torch.randn(8, 64, dtype=torch.float64),))
    x = torch.randn(8, 64, dtype=torch.float64, requires_grad=True)
    outs = []
    for _ in range(2):
        out = graphed(x)
        out.sum().backward()
        zeros = out.detach() == 0
        # the grad of x is W^T applied to the mask of this very replay
        mask = (~zeros).double() * 2.0
        torch.testing.assert_close(x.grad, mask @ module[0].weight.detach())
        x.grad = None
        outs.append(zeros.clone())
    assert not torch.equal(outs[0], outs[1])


def test_op_replay_captures_integer_indexing_and_refuses_boolean_indexing():
    lin = nn.Linear(4, 4).double()
    idx = torch.tensor([2, 0, 1])
    recorder = stand_ins.OpReplayRecorder()
    x = torch.randn(3, 4, dtype=torch.float64)
    graph, (out,) = recorder.record(lambda: [lin(x)[idx]])
    graph.replay()
    torch.testing.assert_close(out, lin(x).detach()[idx], rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="operation not permitted when stream is capturing"):
        recorder.record(lambda: [lin(x)[x[:, 0] > 0]])


def test_op_replay_overwrites_at_each_replay_what_its_recording_let_go_of():
    """A backward recorded without retain_graph frees each activation once read, and a CUDA graph may reuse that
    memory later in the same graph: a second replay of it read NaNs on the H200. The stand-in leaves NaN there."""
    recorder = stand_ins.OpReplayRecorder()
    x = _x(0)
    fwd, (y,) = recorder.record(lambda: [(x.exp() * 2).sum()])
    bwd, (g,) = recorder.record(lambda: list(torch.autograd.grad([y], [x])))
    assert len(bwd.freed) > 0 and not fwd.freed  # exp's result, saved for the backward
    fwd.replay()
    bwd.replay()
    torch.testing.assert_close(g, 2 * x.detach().exp())
    bwd.replay()
    assert g.isnan().all()
    fwd.replay()  # the forward writes them again
    bwd.replay()
    torch.testing.assert_close(g, 2 * x.detach().exp())


def test_op_replay_keeps_what_something_else_holds():
    """Where the backward keeps its graph (retain_graph=True), or the caller holds the activation, nothing is let go
    of: a second replay reads it."""
    recorder = stand_ins.OpReplayRecorder()
    x = _x(0)
    kept = []

    def forward():
        h = x.exp()
        kept.append(h)
        return [(h * 2).sum()]

    fwd, (y,) = recorder.record(forward)
    bwd, (g,) = recorder.record(lambda: list(torch.autograd.grad([y], [x])))
    assert bwd.freed == []
    fwd.replay()
    bwd.replay()
    bwd.replay()
    torch.testing.assert_close(g, 2 * x.detach().exp())


def test_op_replay_lets_later_captures_of_the_pool_write_what_only_its_logs_hold():
    """Once a backward is recorded, the forward's activation is free pool memory in CUDA: a graph captured later in
    that pool may use it, so replaying that graph between the forward and the backward leaves the backward reading
    its values. The stand-in overwrites such memory at each capture in the pool and at each replay of the graphs
    recorded after it was let go; a graph of another pool leaves it alone."""
    recorder = stand_ins.OpReplayRecorder()
    pool, elsewhere = recorder.new_pool(), recorder.new_pool()
    x = _x(0)
    fwd, (y,) = recorder.record(lambda: [(x.exp() * 2).sum()], pool)
    bwd, (g,) = recorder.record(lambda: list(torch.autograd.grad([y], [x])), pool)
    apart, _ = recorder.record(lambda: [x.detach() + 1], elsewhere)
    later, _ = recorder.record(lambda: [x.detach() * 3], pool)
    assert recorder.let_go  # exp's result among them
    for between, poisoned in ((None, False), (apart, False), (later, True), (None, False)):
        fwd.replay()
        if between is not None:
            between.replay()
        bwd.replay()
        assert g.isnan().all() if poisoned else torch.equal(g, 2 * x.detach().exp())


def test_op_replay_follows_a_tensor_the_engine_pointed_at_a_buffer_it_keeps():
    """The engine gives a later signature's raw output back to the pool by pointing the tensor at an alias of the
    buffer it copies into (``free_copied``). The log's tensor then names the buffer, which the engine keeps: no
    later capture may overwrite it."""
    recorder = stand_ins.OpReplayRecorder()
    pool = recorder.new_pool()
    x = _x(0)
    kept = torch.full((3, 4), 7.0, dtype=torch.float64)
    raw = []

    def body():
        raw.append(x.detach().exp())
        return [raw[0] + 1]

    graph, _ = recorder.record(body, pool)  # kept, as the engine keeps its graphs
    freed = raw[0].untyped_storage()  # held here so that the stand-in's reference counts read a live storage
    with torch.no_grad():
        raw.pop().set_(unowned_storage(kept.untyped_storage()), 0, kept.size(), kept.stride())
    recorder.record(lambda: [x.detach() * 3], pool)
    assert graph.log and freed.nbytes() == kept.untyped_storage().nbytes()
    assert torch.equal(kept, torch.full((3, 4), 7.0, dtype=torch.float64))
