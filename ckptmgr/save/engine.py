"""The save engine: staging slots, the stager, one worker thread, an I/O pool, per-save handles.

Every write path of ckptmgr runs on one :class:`AsyncWriter`: the manager's saver (which adds
its policies: a coalescing job picker, the local tier, retries; see :mod:`.saver`), the
Lightning ``.ckpt`` files and the Hugging Face/accelerate checkpoint directories. What differs
between them is what a save's images hold and how its bytes are committed (a :class:`Commit`).

A save, as :meth:`AsyncWriter.submit` runs it (training thread):

1. acquire a staging slot (reused host memory, pinned where CUDA is), waiting at most
   ``busy_timeout`` seconds, and fit it to the images' sizes;
2. ``image.fill(segment)`` writes each image's static bytes into its segment;
3. the stager enqueues the tensors' copies (device-to-host DMA, or CPU copies on its threads);
4. the save is queued for the worker; its :class:`Pending` is returned with the copies in
   flight (:meth:`Pending.wait_staged` says when the tensors may change).

The worker thread takes work from the job picker (first in, first out unless the owner passes
its own: the saver's picks the newest step) and, for a submitted save, calls its commit in
this order: each image's ``seal(buffer, io)`` and ``write(buffers, io)`` once the copies have
landed, while the slot is held (the buffers are valid during that call only); the slot is
released; ``commit(error)`` with the write's error, if any (it raises to fail the save, e.g.
after the ranks have agreed); then the pending completes, ``after(result)`` runs, and
``close()`` always runs last.

Failures surface three ways: on the save's own :class:`Pending`, at the owner's next
:meth:`AsyncWriter.take_errors` / :meth:`AsyncWriter.take_failure` (a failure nobody has been
told of), and at :meth:`AsyncWriter.wait`. Every wait here has a timeout parameter.

Who owns what: ``_mu`` (a Condition, never held across I/O) guards ``_unsettled``,
``_outstanding``, ``_errors``, ``_closed`` and the thread fields; the slot table has the
pool's own lock; a save's slot and buffers belong to the training thread until it is queued,
then to the worker until the slot is released.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from typing import Any, Protocol

import numpy as np
import torch

from .. import _lifecycle
from .._threads import holding
from ..errors import CkptTimeoutError, SaveError
from ..format.layout import FilePlan, Plan
from ..storage.tier import LocalTier
from .outcome import Pending
from .slots import Slot, SlotPool
from .staging import Stager, StagingJob

__all__ = ["AsyncWriter", "Commit", "Fifo", "Image", "JobPicker", "Pending"]

log = logging.getLogger("ckptmgr")

Work = Callable[[], None]


class Image(Protocol):
    """One file of a save, as the engine stages it.

    Attributes:
        size: the file's bytes (its segment of the slot).
        plan: the tensors the stager copies into the segment (None: nothing is staged; the
            image is filled by :meth:`fill` alone, or is empty).
    """

    @property
    def size(self) -> int: ...

    @property
    def plan(self) -> FilePlan | None: ...

    def fill(self, segment: torch.Tensor) -> None:
        """Write the static bytes (headers, archive records) into ``segment`` (training thread)."""

    def seal(self, buffer: np.ndarray[Any, Any], io: Executor) -> None:
        """Finish the image once the copies have landed (the torch-zip CRC-32s; worker thread)."""


class Commit(Protocol):
    """How a save's bytes leave the slot and become visible, on the engine's worker thread.

    Call order: :meth:`write` once the copies have landed (the slot is held; its buffers are
    valid during that call only), then :meth:`commit` (the slot was released), then
    :meth:`close`, always, whatever happened before.
    """

    def write(self, buffers: list[np.ndarray[Any, Any]], io: Executor) -> None:
        """Write (and checksum) the images' bytes."""

    def commit(self, error: BaseException | None) -> Any:
        """Make the save visible and return its result; ``error``: the write's failure (or
        the copies'), which this raises (after whatever the strategy must do first)."""

    def close(self) -> None:
        """Release what the save held (claims, in-flight marks); runs last."""


class JobPicker(Protocol):
    """Decides what the worker runs next."""

    def next(self) -> Work | None:
        """Block until there is work, and return it; None once the engine stops."""

    def stop(self) -> None:
        """Make :meth:`next` return None once nothing is left (called by the engine)."""


class Fifo:
    """The default picker: work in the order it was queued."""

    def __init__(self) -> None:
        self._queue: queue.Queue[Work | None] = queue.Queue()

    def put(self, work: Work) -> None:
        self._queue.put(work)

    def next(self) -> Work | None:
        return self._queue.get()

    def stop(self) -> None:
        self._queue.put(None)


class AsyncWriter:
    """The save engine (see the module docstring).

    Args:
        slots: saves staged or in flight at once (None: sized by the pool, see
            :class:`~ckptmgr.save.slots.SlotPool`).
        copy_threads: threads for CPU tensor copies.
        io_threads: threads of the I/O pool handed to each commit's ``write`` (0: none).
        chunk_size: bytes per checksum chunk of the slots' images (pinning pieces are whole
            numbers of it).
        max_host_bytes: cap on the slots' host memory (None: none).
        busy_timeout: seconds a save waits for a free slot (None: no limit).
        stage_timeout: seconds the worker waits for a save's copies to land (None: no limit).
        tier: the local tier whose files the slots may be.
        device_buffer_bytes: the stager's device snapshot buffer per device.
        picker: decides what the worker runs next (default: :class:`Fifo`).
        daemon: False for owners that stop the threads at a known point and must leave no
            daemon thread behind (a Lightning plugin's teardown).
        name: the worker thread's name (the I/O pool's threads get ``name + "-io"``).
        close_at_exit: close the engine at interpreter exit unless :meth:`park` or
            :meth:`close` ran (registered when the worker starts).
        on_stop: called once the threads have stopped (the owner's per-writer state, such as
            the S3 targets its commits opened, is released there).
    """

    def __init__(self, *, slots: int | None, copy_threads: int, io_threads: int = 0, chunk_size: int = 16 << 20,
                 max_host_bytes: int | None = None, busy_timeout: float | None = None,
                 stage_timeout: float | None = None, tier: LocalTier | None = None, device_buffer_bytes: int = 0,
                 picker: JobPicker | None = None, daemon: bool = True, name: str = "ckptmgr-writer",
                 close_at_exit: bool = False, on_stop: Callable[[], None] | None = None) -> None:
        self.pool = SlotPool(slots, tier=tier, max_host_bytes=max_host_bytes, chunk_size=chunk_size)
        self.chunk_size = chunk_size
        self.busy_timeout = busy_timeout
        self.stage_timeout = stage_timeout
        self._copy_threads = copy_threads
        self._device_buffer_bytes = device_buffer_bytes
        self._io_threads = io_threads
        self._fifo: Fifo | None = None
        if picker is None:
            picker = self._fifo = Fifo()
        self._picker = picker
        self._daemon = daemon
        self._name = name
        self._close_at_exit = close_at_exit
        self._on_stop = on_stop
        self._mu = threading.Condition()
        self._stager: Stager | None = None
        self._io: ThreadPoolExecutor | None = None
        self._thread: threading.Thread | None = None
        self._unsettled = 0  # saves (and other work) queued or running, not settled yet
        self._outstanding: list[Pending[Any]] = []  # pendings not settled, or failed and not told
        self._errors: list[BaseException] = []  # failures outside any pending (hooks, removals)
        self._closed = False

    # ------------------------------------------------------------ any thread

    @property
    def stager(self) -> Stager:
        """The stager, made on first use (its streams belong to the training thread)."""
        with self._mu:
            if self._stager is None:
                self._stager = Stager(self._copy_threads, device_buffer_bytes=self._device_buffer_bytes,
                                      daemon=self._daemon)
            return self._stager

    def start(self) -> None:
        """Start the worker (and the I/O pool) unless running; submissions start it too.

        Raises:
            SaveError: the engine is closed.
        """
        with self._mu:
            if self._closed:
                raise SaveError("the checkpoint writer is closed")
            if self._io is None and self._io_threads:
                self._io = ThreadPoolExecutor(self._io_threads, thread_name_prefix=f"{self._name}-io")
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=self._name, daemon=self._daemon)
                self._thread.start()
                if self._close_at_exit:  # an owner never torn down must not hang the exit
                    _lifecycle.close_at_exit(self)

    @property
    def idle(self) -> bool:
        """True when nothing is queued or running."""
        with self._mu:
            return not self._unsettled

    @property
    def hung(self) -> bool:
        """True when the worker outlived :meth:`stop`."""
        thread = self._thread
        return thread is not None and thread.is_alive()

    # ------------------------------------------------------------ training thread

    def stage(self, sizes: list[int], fill: Callable[[list[torch.Tensor]], tuple[Plan, list[torch.Tensor]]], *,
              wait: bool = True, timeout: float | None = None, acquired: Callable[[Slot], None] | None = None
              ) -> tuple[Slot | None, StagingJob | None, float]:
        """Take a slot for files of ``sizes``, fill it and start the copies.

        ``fill(segments)`` writes the static bytes and returns the plan to copy with the
        segments of its files (one each, in order). ``acquired`` is told the slot before
        anything is written into it. If anything fails, the copies
        already enqueued are waited for and the slot is released.

        Returns:
            The slot, its staging job and the seconds waited for the slot; (None, None,
            waited) when ``wait`` is False and every slot is busy.

        Raises:
            CkptTimeoutError: no slot became free within ``timeout`` seconds.
        """
        slot, waited = self.pool.acquire(wait=wait, timeout=timeout)
        if slot is None:
            return None, None, waited
        job: StagingJob | None = None
        try:
            if acquired is not None:
                acquired(slot)
            t_fit = time.perf_counter()
            self.pool.fit(slot, sizes)
            fit_s = time.perf_counter() - t_fit
            plan, segments = fill(slot.segments)
            job = self.stager.stage(plan, segments, slot.piece)
            job.setup_s = slot.prep_wait_s + fit_s  # (a wait for a busy slot is no set-up)
        except BaseException:
            try:  # (copies in flight must land before the slot is free again)
                if job is not None:
                    job.wait(timeout=60)
            except BaseException:
                pass
            finally:
                self.pool.release(slot, step=None, durable=False)
            raise
        return slot, job, waited

    def submit(self, images: Sequence[Image], commit: Commit, *, step: int = 0, label: str = "checkpoint",
               after: Callable[[Any], None] | None = None, report: bool = True, timeout: float | None = None
               ) -> Pending[Any]:
        """Stage ``images`` and queue their write and commit (see the module docstring).

        Args:
            images: the save's files, in the order ``commit.write`` gets their buffers.
            commit: how they are written and committed.
            step: the save's step (for messages and :meth:`take_failure`).
            label: what the save is called in messages (a path).
            after: run on the worker with the commit's result once the pending completed; a
                failure is reported at :meth:`take_errors`.
            report: a failure is also kept for :meth:`take_errors` (False: the caller waits
                for the pending itself).
            timeout: seconds to wait for a free slot (None: the engine's ``busy_timeout``).

        Raises:
            CkptTimeoutError: no staging slot became free within the busy timeout.
            SaveError: the engine is closed.
        """
        assert self._fifo is not None, "submit() needs the default picker"
        slot: Slot | None = None
        job: StagingJob | None = None
        wanted = [im for im in images if im.size or im.plan is not None]
        if wanted:
            self.pool.check_capacity([im.size for im in wanted])
        self.start()
        if wanted:
            sizes = [im.size for im in wanted]

            def fill(segments: list[torch.Tensor]) -> tuple[Plan, list[torch.Tensor]]:
                for im, seg in zip(wanted, segments, strict=True):
                    im.fill(seg)
                planned = [(im.plan, seg) for im, seg in zip(wanted, segments, strict=True) if im.plan is not None]
                return Plan([p for p, _ in planned], []), [seg for _, seg in planned]

            slot, job, waited = self.stage(sizes, fill, timeout=self.busy_timeout if timeout is None else timeout)
            assert slot is not None
            if waited > 1e-3:
                log.info("%s waited %.3f s for a free staging slot", label, waited)
        pending: Pending[Any] = Pending(step, Future(), job, observed=not report)
        self.track(pending)
        self._fifo.put(lambda: self._run(pending, wanted, commit, slot, label, after))
        return pending

    def call(self, fn: Callable[[], None], *, label: str = "checkpoint") -> None:
        """Run ``fn`` on the worker after everything queued before (a failure is reported at
        :meth:`take_errors`)."""
        assert self._fifo is not None, "call() needs the default picker"
        self.start()
        pending: Pending[None] = Pending(0, Future(), None)
        self.track(pending)

        def run() -> None:
            try:
                fn()
                pending.future.set_result(None)
            except BaseException as exc:
                log.error("%s: %s: %s", label, type(exc).__name__, exc)
                pending.future.set_exception(exc)
            finally:
                self.settled()

        self._fifo.put(run)

    # ------------------------------------------------------------ settlement

    def track(self, pending: Pending[Any]) -> None:
        """Count ``pending`` as unsettled until :meth:`settled` (and keep it for its failure)."""
        with self._mu:
            self._outstanding = [p for p in self._outstanding if not p.future.done() or
                                 (p.failure() is not None and not p.observed)]
            self._outstanding.append(pending)
            self._unsettled += 1

    def hold(self) -> None:
        """Count one more piece of work that :meth:`wait` waits for (ended by :meth:`settled`)."""
        with self._mu:
            self._unsettled += 1

    def settled(self) -> None:
        with self._mu:
            self._unsettled -= 1
            self._mu.notify_all()

    def report(self, exc: BaseException) -> None:
        """Keep a failure outside any pending for :meth:`take_errors`."""
        with self._mu:
            self._errors.append(exc)

    def wait(self, timeout: float | None = None, *, what: Callable[[], str] | None = None) -> None:
        """Block until everything queued so far has settled.

        Raises:
            CkptTimeoutError: still busy after ``timeout`` seconds (``what()`` says what).
        """
        with holding(self._mu):  # (a Ctrl-C here is raised as itself)
            if not self._mu.wait_for(lambda: not self._unsettled, timeout):
                told = what() if what is not None else f"{self._unsettled} checkpoint write(s) still running"
                raise CkptTimeoutError(f"{told} after {timeout} s")

    def outstanding(self, step: int) -> Pending[Any] | None:
        """The pending of ``step`` not completed yet, if any."""
        with self._mu:
            return next((p for p in self._outstanding if p.step == step and not p.future.done()), None)

    def take_errors(self) -> list[BaseException]:
        """Every failure nobody has been told of (then they are told), oldest first."""
        with self._mu:
            errors, self._errors = self._errors, []
            pendings = list(self._outstanding)
        failed = [e for p in pendings if (e := p.failure()) is not None and p.observe()]
        return failed + errors

    def take_failure(self) -> SaveError | None:
        """The oldest failed save nobody has been told of, as a SaveError (then it is told)."""
        with self._mu:
            pendings = list(self._outstanding)
        for p in pendings:
            if p.future.done():
                err = p.take_error()
                if err is not None:
                    return err
        return None

    # ------------------------------------------------------------ worker thread

    def _loop(self) -> None:
        while True:
            work = self._picker.next()
            if work is None:
                return
            work()

    def _run(self, pending: Pending[Any], images: Sequence[Image], commit: Commit, slot: Slot | None, label: str,
             after: Callable[[Any], None] | None) -> None:
        try:
            error: BaseException | None = None
            try:
                if pending.staging is not None:
                    pending.staging.wait(self.stage_timeout)
                io = self._io or _NO_IO
                buffers = [] if slot is None else [s.numpy() for s in slot.segments]
                for im, buf in zip(images, buffers, strict=True):
                    im.seal(buf, io)
                commit.write(buffers, io)
            except Exception as exc:  # handed to the commit, which raises it
                error = exc
            finally:
                if slot is not None:
                    self.pool.release(slot, step=None, durable=False)
            result = commit.commit(error)
            pending.future.set_result(result)
            if after is not None:
                try:
                    after(result)
                except Exception as exc:
                    log.error("%s, after its commit: %s: %s", label, type(exc).__name__, exc)
                    self.report(exc)
        except BaseException as exc:  # told on the pending, at take_errors() and wait()
            log.error("%s: %s: %s", label, type(exc).__name__, exc)
            if not pending.future.done():
                pending.future.set_exception(exc)
        finally:
            try:
                commit.close()
            finally:
                self.settled()

    # ------------------------------------------------------------ end

    def stop(self, timeout: float | None = None) -> bool:
        """Stop the worker once its picker runs dry, then the I/O pool and the stager (the
        slots stay). Returns False when the worker is still running after ``timeout`` s
        (a hung write: its threads are left as they are)."""
        with self._mu:
            thread, self._thread = self._thread, None
            io, self._io = self._io, None
        if thread is not None:
            self._picker.stop()
            thread.join(timeout)
            if thread.is_alive():
                with self._mu:
                    self._thread, self._io = thread, io
                return False
        if io is not None:
            io.shutdown(wait=True)
        with self._mu:
            stager, self._stager = self._stager, None
        if stager is not None:
            stager.close(timeout)
        if self._on_stop is not None:
            self._on_stop()
        _lifecycle.forget(self)
        return True

    def park(self, timeout: float | None = None) -> None:
        """Wait for everything queued, then stop the threads (the slots stay for the next save)."""
        self.wait(timeout)
        self.stop(timeout)

    def close(self, timeout: float | None = None) -> None:
        """Wait for everything queued, stop the threads and free the slots; a later submit
        raises SaveError."""
        try:
            self.wait(timeout)
        finally:
            with self._mu:
                self._closed = True
            self.stop(timeout)
            self.pool.close()


class _NoIO(Executor):
    """The executor handed to commits of an engine made without I/O threads: runs inline."""

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        f: Future[Any] = Future()
        try:
            f.set_result(fn(*args, **kwargs))
        except BaseException as exc:
            f.set_exception(exc)
        return f


_NO_IO = _NoIO()
