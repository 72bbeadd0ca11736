"""``on_graph_stream`` orders its work like a call on the caller's stream, in the two cases the plain waits miss.

Each test holds the capture stream back with ``torch.cuda._sleep`` so that a missing order shows up as a wrong
value, not as a race that happens to pass.
"""

from types import SimpleNamespace

import pytest
import torch

from packgraph.graphs.streams import graph_stream, on_graph_stream

pytestmark = pytest.mark.cuda

SLEEP_CYCLES = 200_000_000  # about 0.1 s on an H200: far longer than the host needs to queue the caller's work
N = 3 * 2**18 + 17  # a size no other tensor of these tests has, so a freed block of it is the one reused


def _graphed_on(stream: torch.cuda.Stream) -> SimpleNamespace:
    """An object shaped like a GraphedCallable as far as ``graph_stream`` reads it."""
    return SimpleNamespace(group=SimpleNamespace(recorder=SimpleNamespace(stream=stream)))


def test_caller_waits_for_the_work_of_a_call_that_raised():
    graphed = _graphed_on(torch.cuda.Stream())
    assert graph_stream(graphed) is graphed.group.recorder.stream
    caller = torch.cuda.current_stream()
    x = torch.zeros(N, device="cuda")

    def fn():
        torch.cuda._sleep(SLEEP_CYCLES)
        x.fill_(1.0)
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        on_graph_stream(graphed, fn)
    assert torch.cuda.current_stream() == caller
    seen = x.clone()  # on the caller's stream: must run after fn's fill
    torch.cuda.synchronize()
    assert bool((seen == 1.0).all()), "the caller's stream read x before the capture stream's fill"


class _SlowScale(torch.autograd.Function):
    """``x * w``, whose backward reads the saved ``x`` only after a long sleep on its stream."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x)
        return x * w

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        torch.cuda._sleep(SLEEP_CYCLES)
        return None, grad * x


class _Scale3(torch.autograd.Function):
    """``t`` itself, whose backward allocates its grad (``3 * grad``) on the stream of its forward."""

    @staticmethod
    def forward(ctx, t):
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad):
        return grad * 3.0


@pytest.mark.parametrize("repeat", range(3))
def test_an_input_freed_by_autograd_is_not_reused_while_the_capture_stream_reads_it(repeat):
    """Eager's contract: ``w.grad`` is ``x``. Autograd frees the saved ``x`` (the caller dropped its reference)
    as soon as the slow backward is queued on the capture stream; the caller-stream backward of an independent
    branch that runs next allocates a tensor of ``x``'s size. Without ``x`` recorded on the capture stream, that
    tensor takes ``x``'s memory and overwrites it before the sleeping backward reads it. (A first run in a process
    may pass by timing alone, hence the repeats.)"""
    graphed = _graphed_on(torch.cuda.Stream())
    x = torch.randn(N, device="cuda")
    expected = x.clone()
    w = torch.ones(N, device="cuda", requires_grad=True)
    y = torch.ones(N, device="cuda", requires_grad=True)
    torch.cuda.synchronize()
    side = _Scale3.apply(y)  # made first, so autograd runs its backward after the slow one (later nodes go first)
    out = on_graph_stream(graphed, _SlowScale.apply, x, w)
    del x
    (out.sum() + side.sum()).backward()
    torch.cuda.synchronize()
    torch.testing.assert_close(y.grad, torch.full_like(y, 3.0))
    torch.testing.assert_close(w.grad, expected, rtol=0, atol=0)
