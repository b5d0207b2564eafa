"""Exact CPU tensor memory: the CPU allocator's own allocation and free events,
read through the profiler's memory events (the CPU counterpart of
torch.cuda.max_memory_allocated).

    with TensorBytes() as t:
        build()
        t.mark()
        train()
    t.at_mark, t.peak   # live tensor bytes when marked, and the most live at or after it

Counting starts at zero when the block is entered, after a garbage
collection (an earlier object freed inside the window would read as negative
bytes), so build everything that should count inside the block.
"""
import gc
import time

from torch.profiler import ProfilerActivity, profile


class TensorBytes:
    def __enter__(self):
        gc.collect()
        self._mark_ns = None
        self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self._prof.__enter__()
        return self

    def mark(self):
        self._mark_ns = time.time_ns()

    def __exit__(self, *exc):
        self._prof.__exit__(*exc)
        if exc[0] is not None:
            return False
        events = sorted((e for e in self._prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                        key=lambda e: e.start_ns())
        live, self.at_mark, self.peak = 0, 0, 0
        for e in events:
            live += e.nbytes()
            if self._mark_ns is None or e.start_ns() >= self._mark_ns:
                self.peak = max(self.peak, live)
            else:
                self.at_mark = live
        return False
