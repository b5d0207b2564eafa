"""Gradient reductions issued in one fixed order on every rank, shared by every stage.

Each item (a stage-1/2 bucket, a ZeRO-3 unit) has a ``pending`` count of
gradients still to arrive in this backward. ``advance()`` launches items in
``order`` as long as the next one has nothing pending, so all ranks issue the
same collectives in the same order whatever order gradients arrive in (an item
that completes early waits for the ones before it; ``flush=True`` at the end of
backward launches the rest, missing gradients counting as zero). At most
``max_inflight`` launched items are not yet retired: launching one more first
retires the oldest, which bounds the gradient buffers they hold.
"""
from __future__ import annotations

from typing import Callable, List


class OrderedReductions:
    def __init__(self, launch: Callable, retire: Callable, max_inflight: int):
        self._launch, self._retire, self.max_inflight = launch, retire, max_inflight
        self.order: List = []
        self.next = 0
        self.inflight: List = []

    def start(self, order: List):
        """A new backward: launch ``order`` from its first item."""
        self.order, self.next = list(order), 0

    def advance(self, flush: bool = False):
        while self.next < len(self.order):
            item = self.order[self.next]
            if item.pending > 0 and not flush:
                return
            self.next += 1
            self._launch(item)
            self.inflight.append(item)
            while len(self.inflight) > self.max_inflight:
                self._retire(self.inflight.pop(0))

    def retire_done(self, done: Callable):
        """Retire, oldest first, the launched items for which ``done(item)`` holds."""
        while self.inflight and done(self.inflight[0]):
            self._retire(self.inflight.pop(0))

    def reset(self):
        """Forget the current backward (its launched items are the caller's to wait on first)."""
        self.order, self.next, self.inflight = [], 0, []

    def drain(self):
        """Retire every launched item."""
        self.retire_done(lambda item: True)
