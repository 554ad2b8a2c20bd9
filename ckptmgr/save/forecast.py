"""When the default options need one more staging slot: a forecast of the next saves against
the durable writes.

Two slots carry saves as long as each durable write ends before the save after next comes:
one slot holds the step being written, the other the newest step (the only copy of it, never
overwritten), and the next save reuses the first once its write is done. A third slot is what
lets a save come while both are busy (the queued step is then superseded by the newer one
instead of being waited for), and it costs gigabytes of pinned host memory, made while
training runs. So it is made when the forecast says a save would otherwise wait, early enough
to be made in time, and not at the first sign of overlap: a decoder saving every 2.45 s to a
disk that writes its 4.02 GB in 3.0 s waits first at its seventh save, not its third.

The forecast needs how long a durable write takes. :class:`WriteWatch` (owned by the saver,
under its lock) knows it from the last completed write, or, before any completed, from the
bytes the write in flight has reported so far (see ``StepWriter.progress``); where neither is
known it says so, and the pool keeps its simpler rule (a slot once saves overlap).
:func:`first_wait` is the forecast itself: a pure function of times and slot states, tested
against simulated clocks.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

__all__ = ["Progress", "WriteWatch", "Writes", "first_wait"]

MIN_PROGRESS = 0.05  # of a write's bytes reported before its rate is trusted
MIN_ELAPSED_S = 0.05  # ... and seconds since it began
MAX_SAVES = 64  # saves the forecast looks ahead at most


class Progress:
    """Bytes a durable write has reported so far; written by the target's I/O threads, read
    by anyone (guarded by its own lock)."""

    def __init__(self) -> None:
        self._mu = threading.Lock()
        self._n = 0

    def add(self, n: int) -> None:
        with self._mu:
            self._n += n

    @property
    def bytes(self) -> int:
        with self._mu:
            return self._n


@dataclass(frozen=True)
class Writes:
    """What the forecast knows of the durable writes at ``now`` (see :meth:`WriteWatch.view`)."""

    write_s: float  # how long one save's durable write takes
    slot: int | None  # the slot whose write is in flight, or None
    ends: float  # when that write is expected to end (``now`` when none is in flight)


class WriteWatch:
    """The durable writes' timing, for the forecast (the owner guards it with its lock)."""

    def __init__(self) -> None:
        self.rate: float | None = None  # bytes per second of the last completed durable write
        self._slot: int | None = None
        self._began = 0.0
        self._nbytes = 0
        self._progress: Progress | None = None

    def begin(self, slot: int, nbytes: int, now: float, progress: Progress) -> None:
        self._slot, self._began, self._nbytes, self._progress = slot, now, nbytes, progress

    def end(self, now: float, ok: bool) -> None:
        """The write in flight ended; a successful one sets the rate."""
        if ok and self._slot is not None and self._nbytes > 0 and now > self._began:
            self.rate = self._nbytes / (now - self._began)
        self._slot, self._progress = None, None

    def view(self, now: float, nbytes: int) -> Writes | None:
        """The writes as the forecast sees them, for saves of ``nbytes``; None when the write
        in flight cannot be timed: no write completed and it has not reported enough of its
        bytes (or all of them: its tail, an fsync, a commit, is not in its bytes), or it runs
        past what the last completed write's rate allows and reports nothing more (a target
        that reports no bytes, or a long tail). The pool then keeps its earlier rule."""
        rate = self.rate
        if self._slot is None or self._progress is None:
            return None if rate is None else Writes(write_s=nbytes / rate, slot=None, ends=now)
        done, elapsed, total = self._progress.bytes, now - self._began, self._nbytes
        reporting = 0 < done < total
        if reporting and done >= MIN_PROGRESS * total and elapsed >= MIN_ELAPSED_S:
            now_rate = done / elapsed
            rate = now_rate if rate is None else min(rate, now_rate)  # a slower disk now counts at once
        elif self.rate is None:
            return None
        assert rate is not None
        ends = self._began + total / rate  # the whole write, timed from its start (bytes reported or not)
        if reporting:
            ends = max(ends, now + (total - done) / rate)
        elif ends < now:
            return None  # overdue, and its bytes tell nothing more (none reported, or all): it cannot be timed
        return Writes(write_s=nbytes / rate, slot=self._slot, ends=ends)


def first_wait(*, now: float, interval: float, write_s: float, free_at: list[float],
               queued: int, writing_ends: float, horizon_s: float) -> float | None:
    """When the first save from now on would find no slot free, or None if none does before
    ``now + horizon_s``.

    Saves come every ``interval`` seconds of training, the next one ``interval`` from now (the
    forecast is asked by a save before it returns to training); each takes the slot free
    soonest and queues its durable write behind the others (one at a time, ``write_s`` each).

    Args:
        now: the present (any clock, the same for every argument).
        interval: seconds of training between saves.
        write_s: seconds one durable write takes.
        free_at: for each slot whose step needs no further write: when it can be reused
            (``now`` for one reusable now, the expected end of its write for one being
            written).
        queued: slots whose step waits for a durable write not begun yet (the one a save just
            took among them); each is free once its write, queued behind the others, ends.
        writing_ends: when the write in flight ends (``now`` when none is).
        horizon_s: how far ahead to look.
    """
    if interval <= 0 or write_s < 0:
        return None
    slots = list(free_at)
    cursor = max(now, writing_ends)
    for _ in range(queued):
        cursor += write_s
        slots.append(cursor)
    if not slots:
        return None
    t = now + interval
    for _ in range(MAX_SAVES):
        if t > now + horizon_s:
            return None
        i = min(range(len(slots)), key=slots.__getitem__)
        if slots[i] > t:  # (a save that finds none free makes one on the spot: no tolerance)
            return t
        cursor = max(cursor, t) + write_s
        slots[i] = cursor
        t += interval
    return None
