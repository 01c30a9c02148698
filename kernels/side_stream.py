"""The observe-mode statistics pass on a second CUDA stream (opt-in: ``FLASHWATCH_SIDE_STREAM=1``).

The statistics pass of an observed call reads only that call's saved q, k, v, output and output
gradient, and what it writes (the layer's statistics buffers, the W^Q-error chain's sums) is read
only by ``Monitor.step``. So it can run beside the model's own backward (torch SDPA's backward and
the layers before it) instead of before it, on a stream of its own:

- ``statistics_stream(tensors)``: a context in which the pass's launches go to the side stream of
  the current device, after everything the current stream has queued so far (the pass's inputs);
  each tensor it reads is recorded on the side stream (``record_stream``), so that the caching
  allocator does not hand its memory to the main stream before the pass is done with it;
- at the end of the backward (an autograd engine callback queued by each pass) the main stream
  waits for the side stream: everything after the backward, the
  optimizer and ``Monitor.step`` included, sees the statistics complete. No host synchronisation.

Not used (the pass runs on the current stream, as without the switch): on the CPU, while a CUDA
graph is being captured (``torch.compile(mode="reduce-overhead")``: a captured fork must be joined
inside the capture), and outside a backward (no engine to queue the join on).
"""

from __future__ import annotations

import contextlib
from typing import Iterable, Iterator, Optional

import torch

from .checks import switch

__all__ = ["SIDE_STREAM", "statistics_stream"]


SIDE_STREAM: bool = switch("FLASHWATCH_SIDE_STREAM")  # read at import (kernels.checks)
_streams: dict[int, torch.cuda.Stream] = {}  # device index -> its side stream


def _side(device: torch.device) -> Optional[torch.cuda.Stream]:
    """The side stream of ``device`` where the pass may use one now (its join queued for the end of
    the running backward), else None."""
    if not SIDE_STREAM or device.type != "cuda" or torch.cuda.is_current_stream_capturing():
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = _streams.get(index)
    if stream is None:
        stream = _streams[index] = torch.cuda.Stream(device=index)
    try:  # one join a pass (a backward that stopped before its end leaves none pending): an event and a wait
        torch.autograd.Variable._execution_engine.queue_callback(
            lambda: torch.cuda.current_stream(index).wait_stream(stream))
    except RuntimeError:  # not inside a backward
        return None
    return stream


@contextlib.contextmanager
def statistics_stream(device: torch.device, tensors: Iterable[Optional[torch.Tensor]]) -> Iterator[None]:
    """Run the body (one statistics pass) on the device's side stream where one may be used
    (module docstring), else on the current stream. ``tensors``: every tensor the pass reads that
    was made outside it (None entries are skipped)."""
    side = _side(torch.device(device))
    if side is None:
        yield
        return
    side.wait_stream(torch.cuda.current_stream(side.device))
    with torch.cuda.stream(side):
        yield
    for t in tensors:
        if t is not None and t.is_cuda:
            t.record_stream(side)
