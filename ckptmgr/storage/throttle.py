"""A request window that backs off when the object store says "slow down".

Object stores throttle per prefix: past some request rate they answer 503 SlowDown (or 429).
Retrying each throttled request after a backoff, at the same concurrency, keeps the rate at
the limit and every retry pays for it. Instead, like TCP's congestion window, the number of
requests in flight to one root adapts: each success adds ``1/limit`` (one more request per
window's worth of successes, up to the configured concurrency), and a throttled answer halves
it (at most once per window: the requests already in flight when it shrank were sent at the
old rate, their answers say nothing new).
"""

from __future__ import annotations

import threading
import time

from ..errors import StorageError

__all__ = ["AdaptiveWindow"]


class AdaptiveWindow:
    """At most ``limit`` requests in flight, ``limit`` adapting between ``floor`` and
    ``ceiling`` (additive increase, multiplicative decrease); ``adaptive=False`` keeps it at
    ``ceiling`` (a fixed window)."""

    def __init__(self, ceiling: int, *, floor: int = 1, adaptive: bool = True) -> None:
        self.ceiling = ceiling
        self.floor = min(floor, ceiling)
        self.adaptive = adaptive
        self._cond = threading.Condition()  # guards everything below
        self._limit = float(ceiling)
        self._inflight = 0
        self._epoch = 0  # bumped at every decrease
        self.throttled = 0  # throttled answers seen
        self.decreases = 0
        self.lowest = ceiling  # smallest window reached

    @property
    def limit(self) -> int:
        with self._cond:
            return int(self._limit)

    def acquire(self, deadline: float) -> int:
        """Wait for room in the window (until ``deadline``, a ``time.monotonic()`` value);
        return the ticket to pass to :meth:`release`.

        Raises:
            StorageError: no room before the deadline.
        """
        with self._cond:
            while self._inflight >= int(self._limit):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise StorageError(f"no room in the request window ({int(self._limit)} in flight) before the "
                                       "retry deadline: the store is throttling hard")
                self._cond.wait(left)
            self._inflight += 1
            return self._epoch

    def release(self, ticket: int, *, ok: bool, throttled: bool = False) -> None:
        """One request ended: ``ok``, ``throttled`` (SlowDown/503/429), or failed otherwise."""
        with self._cond:
            self._inflight -= 1
            if throttled:
                self.throttled += 1
            if self.adaptive:
                if ok:
                    self._limit = min(float(self.ceiling), self._limit + 1.0 / self._limit)
                elif throttled and ticket == self._epoch:
                    self._limit = max(float(self.floor), self._limit / 2)
                    self._epoch += 1
                    self.decreases += 1
                    self.lowest = min(self.lowest, int(self._limit))
            self._cond.notify_all()
