"""A request window that backs off when the object store says "slow down".

Object stores throttle per prefix: past some request rate they answer 503 SlowDown (or 429).
Retrying each throttled request after a backoff, at the same concurrency, keeps the rate at
the limit and every retry pays for it. Instead, like TCP's congestion window, the number of
requests in flight to one root adapts: each success adds ``1/limit`` (one more request per
window's worth of successes, up to the configured concurrency), and a throttled answer halves
it (at most once per window: the requests already in flight when it shrank were sent at the
old rate, their answers say nothing new).

Reads ask more of the same window: a :class:`ReadTuner` also sizes the ranges of a ranged
read and grows the number it keeps in flight while the store answers faster for it, below
the window's limit, so that a throttled store slows reads and writes alike.
"""

from __future__ import annotations

import threading
import time

from ..errors import StorageError

__all__ = ["AdaptiveWindow", "ReadTuner"]


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


class ReadTuner:
    """How one ranged read of an object store cuts its requests and how many it keeps in
    flight, adapted from the store's answers; the target's :class:`AdaptiveWindow` (shared
    with the writer) bounds them and backs off on SlowDown.

    A read starts wide: ``start_inflight`` requests of ``start_range`` bytes at once, so
    that a store with a high latency is never read one range at a time. Every *round*
    (as many answers as requests were allowed in flight when it began) is judged by its
    throughput (bytes answered over the round's wall time) and by the throughput of one
    connection (bytes over the requests' own durations). While a round moves more bytes
    per second than the one before by ``gain``, the read grows: half as many requests
    again in flight (up to the window), and ranges twice as long (up to ``max_range``)
    while one connection also got faster with longer ranges (latency, not bandwidth,
    bounded it). Once a round gains less, the read settles; a round clearly slower than
    the one before goes back to the size and count before it. Once what is left fits in
    one wave and a half of requests, it is cut into equal ranges, one per request allowed in flight
    (never below ``min_range``), so that the read ends on every connection at once; a read
    that fits in one wave from the start (nothing to learn from) is spread over as many
    requests as the window allows (256 MiB behind 50-350 ms of latency, CPU: on SeaweedFS 1.70 s
    in 17 requests against 2.44 s in 9 with 25 MB/s per connection, 0.98 against 1.26 s
    without; only moto, which reads the whole object for every ranged GET, is faster with fewer:
    ``benchmarks/results/cpu-2026-11-28-s3-width/``). Each read has its own tuner;
    :meth:`observe` may be called from any thread (a lock guards the state), the other
    methods from the read's dispatching thread.
    """

    def __init__(self, window: AdaptiveWindow, *, start_inflight: int = 8, start_range: int = 32 << 20,
                 min_range: int = 4 << 20, max_range: int = 128 << 20, gain: float = 1.15) -> None:
        self.window = window
        self.min_range = min_range
        self.max_range = max(max_range, min_range)
        self.gain = gain
        self._mu = threading.Lock()  # guards everything below
        self._inflight = max(1, min(start_inflight, window.ceiling))
        self._size = max(min_range, min(start_range, self.max_range))
        self._settled = False
        self._tail: int | None = None  # the range length of the last wave, once it began
        self._prev: tuple[float, float, int, int] | None = None  # (round rate, connection rate, size, inflight)
        self._round_start: float | None = None
        self._round_left = self._inflight
        self._round_bytes = 0
        self._round_busy = 0.0
        self.rounds = 0  # rounds judged, for telemetry and tests
        self.requests = 0  # answers observed
        self.bytes = 0  # bytes they brought

    @property
    def settled(self) -> bool:
        with self._mu:
            return self._settled

    def inflight(self) -> int:
        """Requests allowed in flight now (never more than the shared window allows)."""
        with self._mu:
            n = self._inflight
        return max(1, min(n, self.window.limit))

    def range_size(self, remaining: int) -> int:
        """The length of the next request, ``remaining`` bytes being left to ask for."""
        n = self.inflight()
        with self._mu:
            # the last wave (what is left would make at most half a wave more): spread over every request
            if self._tail is None and 2 * remaining <= 3 * n * self._size:
                if self._round_start is None:  # the whole read is one wave: nothing to learn, as wide as allowed
                    self._inflight = self.window.ceiling
                    n = max(1, min(self._inflight, self.window.limit))
                self._tail = max(self.min_range, -(-remaining // n))
            size = self._size if self._tail is None else self._tail
        return max(1, min(remaining, size))

    def started(self, now: float) -> None:
        """A request was sent at ``now`` (``time.monotonic()``): the first one starts the first round."""
        with self._mu:
            if self._round_start is None:
                self._round_start = now

    def observe(self, nbytes: int, seconds: float, now: float) -> None:
        """A request of ``nbytes`` was answered in ``seconds``, at ``now``."""
        with self._mu:
            self.requests += 1
            self.bytes += nbytes
            self._round_bytes += nbytes
            self._round_busy += max(seconds, 1e-9)
            self._round_left -= 1
            if self._round_left > 0 or self._round_start is None:
                return
            wall = max(now - self._round_start, 1e-9)
            rate, conn = self._round_bytes / wall, self._round_bytes / self._round_busy
            self._judge(rate, conn)
            self.rounds += 1
            self._round_start, self._round_left = now, self._inflight
            self._round_bytes, self._round_busy = 0, 0.0

    def _judge(self, rate: float, conn: float) -> None:
        prev, here = self._prev, (rate, conn, self._size, self._inflight)
        if self._settled:
            return
        if prev is not None and rate < prev[0] * self.gain:
            self._settled = True
            if rate * self.gain < prev[0]:  # clearly slower: back to what the round before ran
                self._size, self._inflight = prev[2], prev[3]
            return
        self._prev = here
        self._inflight = max(self._inflight + 1, min(self.window.ceiling, self._inflight * 3 // 2))
        self._inflight = min(self._inflight, self.window.ceiling)
        if prev is None or conn >= prev[1] * self.gain:
            self._size = min(self.max_range, self._size * 2)
