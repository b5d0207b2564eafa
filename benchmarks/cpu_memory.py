"""Exact CPU tensor memory: the CPU allocator's own count of live tensor bytes,
read through the profiler's memory events (the CPU counterpart of
torch.cuda.max_memory_allocated).

    with TensorBytes() as t:
        build()
        t.mark()
        train()
    t.at_mark, t.peak   # live tensor bytes when marked, and the most live at or after it

The count is the allocator's process-wide total of live bytes
(``FLAGS_caffe2_report_cpu_memory_usage``, which this module turns on), as
each allocator event of the profiling thread reports it. The sizes of the
events alone are not enough: the profiler records the events of the thread
that started it only, so a tensor allocated there and freed by another
thread (a gloo worker dropping the last reference to a collective's
tensor, which happens or not depending on who finishes first) would read as
live to the end, and the peak would drift up by whole buffers from run to
run. The total counts every thread's frees and allocations; it is sampled at
the profiling thread's events, where the step's own tensors are made.

Counting starts at zero when the block is entered, after a garbage
collection (an earlier object freed inside the window would read as negative
bytes), so build everything that should count inside the block.
"""

import ctypes
import gc
import os
import time

import torch
from torch.profiler import ProfilerActivity, profile


def _count_every_thread() -> None:
    lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so"))
    ctypes.c_bool.in_dll(lib, "FLAGS_caffe2_report_cpu_memory_usage").value = True


def _walk(nodes):
    for n in nodes:
        yield n
        yield from _walk(n.children)


class TensorBytes:
    def __enter__(self):
        gc.collect()
        _count_every_thread()
        self._mark_ns = None
        self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self._prof.__enter__()
        self._origin = torch.empty(64, dtype=torch.uint8)  # its event carries the total at entry
        return self

    def mark(self):
        self._mark_ns = time.time_ns()

    def __exit__(self, *exc):
        self._prof.__exit__(*exc)
        if exc[0] is not None:
            return False
        tree = self._prof.profiler.kineto_results.experimental_event_tree()
        allocs = sorted(
            (n.start_time_ns, n.extra_fields)
            for n in _walk(tree)
            if type(n.extra_fields).__name__ == "_ExtraFields_Allocation"
        )
        origin = next(f for _, f in allocs if f.ptr == self._origin.data_ptr() and f.alloc_size > 0)
        base = origin.total_allocated - origin.alloc_size
        self.at_mark, self.peak = 0, 0
        for t, f in allocs:  # (the events' clock is time.time_ns's)
            live = f.total_allocated - base
            if self._mark_ns is None or t >= self._mark_ns:
                self.peak = max(self.peak, live)
            else:
                self.at_mark = live
        return False
