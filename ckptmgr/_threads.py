"""Worker threads that never keep the process alive.

:class:`DaemonPool` is a small :class:`concurrent.futures.Executor` whose workers are daemon
threads. ``ThreadPoolExecutor`` workers are joined, without a timeout, when the interpreter
exits (``concurrent.futures`` registers that join at import), so one write stuck on a dead
NFS server or a hung S3 connection would keep a finished training job alive forever. The
manager bounds its own shutdown instead (``CheckpointManager.close(timeout)``): it waits for
pending work up to a deadline, says in the log what did not finish, and lets the process go.

The background work that may block on storage (persist, storage I/O, retention) runs on
these pools. Restore-time readers and checksum pools (the restore ring, the read driver's
threads, a save engine's I/O pool, the CLI's) are ordinary thread pools: their work is waited
for by the call that started it, with a timeout. The peer tier's restore threads are daemons
(its own copy's check, the writer of received pieces, the fetch's host copies): after a fetch
that failed or timed out they may still be in I/O, and are let go unjoined.
docs/ARCHITECTURE.md lists every thread.

:func:`collector_paused` holds Python's cyclic garbage collector off while a restore runs.
A restore builds tens of objects per stored tensor (the manifest, the headers, the landing
plan, the tree), nearly all acyclic and freed by reference counting when it returns; with
the collector on, that many allocations set off full collections, each of which traverses
the whole process's heap (torch's modules, the model) and finds nothing to free. Measured on
one restore of 10,000 small tensors: two full collections, 0.2 s of its 0.37 s.

:func:`holding` is ``with condition:`` for the waits of the caller's thread (``close()``, a save
waiting for a slot): it never hides an interrupt behind a RuntimeError.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import queue
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Executor, Future
from typing import Any, TypeVar

__all__ = ["DaemonPool", "collector_paused", "holding"]

T = TypeVar("T")
# a queued call: its future and [fn, args, kwargs], emptied when the future is cancelled, so that a
# call cancelled while it waits in the queue holds nothing of what it was given (memory a caller
# is about to release, such as a mapping's views)
_Item = tuple[Future[Any], list[Any]]


def _forget_if_cancelled(call: list[Any]) -> Callable[[Future[Any]], None]:
    def done(f: Future[Any]) -> None:
        if f.cancelled():
            call.clear()
    return done
_serial = itertools.count()

_gc_mu = threading.Lock()
_gc_holders = 0  # calls inside collector_paused()                                (guarded by _gc_mu)
_gc_was_enabled = False  # the collector was on when the first of them came in      (guarded by _gc_mu)


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Hold the cyclic garbage collector off until the last of the calls inside this (from any
    thread) has left, then turn it back on if it was on when the first came in. Reference
    counting still frees everything acyclic meanwhile. The pause is process-wide: a restore
    that hangs (a collective that never completes) holds the collector off meanwhile.

    Example:
        >>> with collector_paused():
        ...     tree = build_many_small_objects()
    """
    global _gc_holders, _gc_was_enabled
    held = False
    try:
        with _gc_mu:
            if _gc_holders == 0:
                _gc_was_enabled = gc.isenabled()
                gc.disable()
            _gc_holders, held = _gc_holders + 1, True
        yield
    finally:
        if held:
            with _gc_mu:
                _gc_holders -= 1
                if _gc_holders == 0 and _gc_was_enabled:
                    gc.enable()


@contextlib.contextmanager
def holding(cond: threading.Condition) -> Iterator[None]:
    """``with cond:`` that never hides an interrupt. ``Condition.wait`` is not safe against an
    asynchronous exception: a KeyboardInterrupt (a signal handler's) raised after the wait has
    ended and before the lock is taken back leaves the lock not held, and the ``with`` then
    fails to release it: ``RuntimeError("cannot release un-acquired lock")``, the interrupt in
    its context. The interrupt is raised instead, as if the RuntimeError had not happened (the
    lock is free: it was never taken back). Seen as a Ctrl-C during ``close()``'s wait said
    "interrupted (RuntimeError)"."""
    try:
        with cond:
            yield
    except RuntimeError as exc:
        hidden = exc.__context__
        if hidden is not None and not isinstance(hidden, Exception):
            raise hidden from None
        raise


class DaemonPool(Executor):
    """Up to ``max_workers`` daemon threads, started on demand, running submitted calls in order.

    Args:
        max_workers: the most threads running at once.
        thread_name_prefix: names the threads ``<prefix>_<n>`` (they show in py-spy and gdb).
    """

    def __init__(self, max_workers: int, thread_name_prefix: str = "ckptmgr") -> None:
        if max_workers <= 0:
            raise ValueError(f"max_workers must be positive, got {max_workers}")
        self._max = max_workers
        self._max_workers = max_workers  # (as ThreadPoolExecutor names it: callers size their work by it)
        self._prefix = thread_name_prefix
        self._queue: queue.SimpleQueue[_Item | None] = queue.SimpleQueue()
        self._mu = threading.Lock()  # guards the three fields below
        self._threads: list[threading.Thread] = []
        self._idle = 0
        self._shutdown = False

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        """Run ``fn(*args, **kwargs)`` on a worker; its outcome lands in the returned future.

        Raises:
            RuntimeError: the pool was shut down.
        """
        future: Future[T] = Future()
        with self._mu:
            if self._shutdown:
                raise RuntimeError(f"cannot schedule new work: the {self._prefix} pool is shut down")
            call: list[Any] = [fn, args, kwargs]
            future.add_done_callback(_forget_if_cancelled(call))
            self._queue.put((future, call))
            if self._idle > 0:
                self._idle -= 1  # an idle worker takes it
            elif len(self._threads) < self._max:
                t = threading.Thread(target=self._work, name=f"{self._prefix}_{next(_serial)}", daemon=True)
                self._threads.append(t)
                t.start()
        return future

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                self._queue.put(None)  # wake the next worker too
                return
            future, call = item
            if future.set_running_or_notify_cancel():
                fn, args, kwargs = call
                call.clear()
                try:
                    result = fn(*args, **kwargs)
                except BaseException as exc:  # the caller of result() decides what to do with it
                    del fn, args, kwargs  # (before the caller is woken: it may release what they hold)
                    future.set_exception(exc)
                else:
                    del fn, args, kwargs
                    future.set_result(result)
                    del result
            del future, call, item
            with self._mu:
                self._idle += 1

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Refuse new work; with ``cancel_futures``, drop what has not started; with ``wait``,
        join the workers (see :meth:`stop` for a bounded join)."""
        self.stop(cancel=cancel_futures, timeout=None if wait else 0)

    def stop(self, *, cancel: bool = True, timeout: float | None = None) -> bool:
        """Refuse new work; with ``cancel``, drop what has not started; join the workers for up
        to ``timeout`` seconds (None: as long as it takes).

        Returns:
            True when every worker has exited.
        """
        with self._mu:
            self._shutdown = True
            threads = list(self._threads)
        if cancel:
            while True:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is not None:
                    item[0].cancel()
        self._queue.put(None)
        deadline = None if timeout is None else time.monotonic() + timeout
        for t in threads:
            t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in threads)
