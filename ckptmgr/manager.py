"""CheckpointManager: the one object users hold. It orchestrates; it owns no I/O.

save:    validate -> flatten -> plan -> stage (caller blocked until here) -> persist -> commit
restore: discover -> manifest -> read + verify -> assemble -> unflatten -> apply to target
"""

from __future__ import annotations

import logging
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import torch

from . import __version__
from ._flatten import decode_plain, encode_plain, flatten, unflatten
from ._handle import SaveHandle, SaveInfo
from ._layout import plan_layout
from ._manifest import FORMAT_VERSION, FileRecord, Manifest
from ._restore import apply_target
from ._staging import StagedFile, stage
from .errors import (
    CheckpointCorruptError,
    CkptTimeoutError,
    ConfigError,
    StepExistsError,
    StepNotFoundError,
)
from .loaders import read_tensors
from .options import WriteOptions
from .targets import open_target

__all__ = ["CheckpointManager"]

log = logging.getLogger("ckptmgr")


class CheckpointManager:
    """Saves training state as committed safetensors checkpoints and restores it.

    Each ``save`` copies the state off the caller's tensors, then writes and commits it in
    a background thread. A checkpoint is either complete and verified, or invisible.

    Args:
        root: a local or NFS path, or any fsspec URL (``s3://bucket/prefix``, ...).
        retention: which committed steps to keep. None keeps everything.
        storage_options: passed to fsspec for URL roots (credentials, endpoints, ...).
        write_options: file layout and I/O parallelism.
        allow_pickle: store values of other types with pickle, and load them back. Loading
            pickle runs code from the checkpoint: only enable it for checkpoints you trust.

    Example:
        >>> import torch
        >>> from ckptmgr import CheckpointManager
        >>> model = torch.nn.Linear(4, 2)
        >>> opt = torch.optim.AdamW(model.parameters())
        >>> with CheckpointManager(tmp_path / "ckpt") as mgr:  # doctest: +SKIP
        ...     mgr.save(100, {"model": model, "optim": opt, "step": 100}).result()
        ...     state = mgr.restore(target={"model": model, "optim": opt, "step": 0})
        ...     state["step"]
        100
    """

    def __init__(
        self,
        root: str | Any,
        *,
        retention: Any = None,
        storage_options: dict[str, Any] | None = None,
        write_options: WriteOptions | None = None,
        allow_pickle: bool = False,
    ) -> None:
        if retention is not None:
            raise ConfigError("retention policies are not supported by this version; pass retention=None")
        if write_options is None:
            write_options = WriteOptions()
        elif not isinstance(write_options, WriteOptions):
            raise ConfigError(f"write_options must be a WriteOptions, got {type(write_options).__name__}")
        if storage_options is not None and not isinstance(storage_options, dict):
            raise ConfigError(f"storage_options must be a dict, got {type(storage_options).__name__}")
        self._opts = write_options
        self._allow_pickle = bool(allow_pickle)
        self._target = open_target(str(root) if hasattr(root, "__fspath__") else root,
                                   storage_options, io_threads=write_options.io_threads)
        self.root = self._target.url
        removed = self._target.cleanup()
        if removed:
            log.info("removed %d leftovers of interrupted saves under %s", len(removed), self.root)
        self._persist_pool = ThreadPoolExecutor(1, thread_name_prefix="ckptmgr-persist")
        self._lock = threading.Lock()
        self._pending: dict[int, SaveHandle] = {}
        self._handles: list[SaveHandle] = []  # finished handles whose errors nobody saw yet
        self._closed = False

    # ---------------------------------------------------------------- save

    def save(self, step: int, state: Any, *, metadata: dict[str, Any] | None = None) -> SaveHandle:
        """Checkpoint ``state`` as ``step``.

        Returns once the state has been copied: from then on the caller may change it. The
        write and the commit continue in the background; the returned handle reports them.

        Args:
            step: a non-negative int, not committed before.
            state: a nested structure of dicts, lists, tuples, tensors, numpy arrays,
                scalars, strings and objects with ``state_dict()``/``load_state_dict()``.
            metadata: user data stored in the manifest (JSON-like values).

        Raises:
            ConfigError: ``step`` is not a non-negative int.
            StepExistsError: ``step`` is committed or being saved.
            UnsupportedValueError: a value in ``state`` or ``metadata`` cannot be stored;
                nothing has been written.
            SaveError: an earlier save failed and nobody has been told yet.
        """
        self._check_open()
        if type(step) is not int or step < 0:
            raise ConfigError(f"step must be a non-negative int, got {step!r}")
        if metadata is not None and not isinstance(metadata, dict):
            raise ConfigError(f"metadata must be a dict, got {type(metadata).__name__}")
        self._raise_unobserved()
        with self._lock:
            if step in self._pending:
                raise StepExistsError(f"step {step} is already being saved")
        if step in self._target.list_steps():
            raise StepExistsError(
                f"step {step} is already committed under {self.root}; committed checkpoints are never overwritten")
        t0 = time.perf_counter()
        skeleton, leaves = flatten(state, allow_pickle=self._allow_pickle)
        meta_json = encode_plain(metadata or {}, what="metadata")
        plan = plan_layout(leaves, max_file_bytes=self._opts.max_file_bytes,
                           metadata={"format": "pt", "ckptmgr_format_version": str(FORMAT_VERSION)})
        staged = stage(plan)
        t_staged = time.perf_counter()
        manifest = Manifest(step=step, state=skeleton, tensors=plan.tensor_index(), files={},
                            metadata=meta_json, library_version=__version__)
        future = self._persist_pool.submit(self._persist, manifest, staged, t0, t_staged)
        handle = SaveHandle(step, future)
        with self._lock:
            self._pending[step] = handle
            self._handles.append(handle)
        future.add_done_callback(lambda _: self._finished(step))
        return handle

    def _persist(self, manifest: Manifest, staged: list[StagedFile], t0: float, t_staged: float) -> SaveInfo:
        writer = self._target.begin(manifest.step)
        try:
            for f in staged:
                crcs = writer.write_file(f.name, f.image.numpy(), self._opts.chunk_size)
                manifest.files[f.name] = FileRecord(f.image.numel(), self._opts.chunk_size, crcs, f.header_size)
            writer.commit(manifest.to_bytes())
        except BaseException:
            writer.abort()
            raise
        t_end = time.perf_counter()
        info = SaveInfo(step=manifest.step, url=self.root, bytes=manifest.total_bytes,
                        files=len(staged), staging_s=t_staged - t0, persist_s=t_end - t_staged,
                        total_s=t_end - t0)
        log.info("committed step %d: %.1f MB, staged in %.3f s, durable after %.3f s (%.2f GB/s)",
                 info.step, info.bytes / 1e6, info.staging_s, info.total_s, info.throughput_gbps)
        return info

    def _finished(self, step: int) -> None:
        with self._lock:
            self._pending.pop(step, None)

    def _raise_unobserved(self) -> None:
        err = None
        with self._lock:
            keep = []
            for h in self._handles:
                if err is None and h.done():
                    err = h._take_error()
                elif not h.done() or h._future.exception() is not None:
                    keep.append(h)
            self._handles = keep
        if err is not None:
            raise err

    def wait(self, timeout: float | None = None) -> None:
        """Block until every pending save has committed.

        Raises:
            SaveError: a save failed and nobody has been told yet.
            CkptTimeoutError: saves still pending after ``timeout`` seconds.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            pending = list(self._pending.values())
        for h in pending:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                h._future.result(left)
            except FutureTimeout:
                raise CkptTimeoutError(f"save of step {h.step} not finished after {timeout} s") from None
            except BaseException:
                pass  # reported below, once
        self._raise_unobserved()

    # ------------------------------------------------------------- discover

    def steps(self) -> list[int]:
        """Committed steps, ascending, as the storage shows them now."""
        self._check_open()
        return self._target.list_steps()

    def latest_step(self) -> int | None:
        """The newest committed step, or None when there is none."""
        steps = self.steps()
        return steps[-1] if steps else None

    def _manifest(self, step: int) -> Manifest:
        where = f"{self.root}: step {step}"
        m = Manifest.from_bytes(self._target.read_manifest(step), where=where)
        if m.step != step:
            raise CheckpointCorruptError(f"{where}: the manifest is for step {m.step}")
        return m

    def metadata(self, step: int | None = None) -> dict[str, Any]:
        """The user metadata saved with ``step`` (default: the newest committed step).

        Raises:
            StepNotFoundError: no such committed step, or none at all.
        """
        step = self._resolve_step(step)
        meta = decode_plain(self._manifest(step).metadata)
        return meta if isinstance(meta, dict) else {}

    def _resolve_step(self, step: int | None) -> int:
        self._check_open()
        if step is None:
            latest = self.latest_step()
            if latest is None:
                raise StepNotFoundError(f"no committed checkpoint under {self.root}")
            return latest
        if type(step) is not int or step < 0:
            raise ConfigError(f"step must be a non-negative int or None, got {step!r}")
        return step

    # -------------------------------------------------------------- restore

    def restore(self, step: int | None = None, *, target: Any = None,
                device: str | torch.device | None = None) -> Any:
        """Load a committed checkpoint.

        Args:
            step: the step to load; None loads the newest one that verifies, warning about
                any newer one that does not.
            target: a state of the same shape as the one saved. Its tensors are overwritten
                in place and its Stateful objects get ``load_state_dict``; the result mirrors
                ``target`` with the checkpoint's plain values.
            device: where new tensors go when there is no target (default: CPU).

        Returns:
            The restored state.

        Raises:
            StepNotFoundError: no such committed step (or none at all).
            CheckpointCorruptError: an explicit step fails verification.
            StateMismatchError: ``target`` does not match; it has not been modified.
        """
        dev = torch.device(device) if device is not None else None
        if step is not None:
            return self._restore_step(self._resolve_step(step), target, dev)
        self._check_open()
        candidates = self._target.list_steps()
        if not candidates:
            raise StepNotFoundError(f"no committed checkpoint under {self.root}")
        for s in reversed(candidates):
            try:
                return self._restore_step(s, target, dev)
            except (CheckpointCorruptError, StepNotFoundError) as exc:
                warnings.warn(f"skipping step {s}: {exc}", RuntimeWarning, stacklevel=2)
                log.warning("restore: skipping step %d: %s", s, exc)
        raise StepNotFoundError(f"no checkpoint under {self.root} verifies (tried steps {candidates})")

    def _restore_step(self, step: int, target: Any, device: torch.device | None) -> Any:
        manifest = self._manifest(step)
        tensors = read_tensors(self._target, step, manifest, device=None if target is not None else device)
        tree = unflatten(manifest.state, tensors, allow_pickle=self._allow_pickle)
        return tree if target is None else apply_target(target, tree)

    # ------------------------------------------------------------ lifecycle

    def _check_open(self) -> None:
        if self._closed:
            raise ConfigError(f"the CheckpointManager for {self.root} is closed")

    def close(self, timeout: float | None = None) -> None:
        """Wait for pending saves (up to ``timeout`` s), then release threads.

        Raises:
            SaveError: a save failed and nobody has been told yet.
            CkptTimeoutError: saves still pending after ``timeout``; they keep running.
        """
        if self._closed:
            return
        try:
            self.wait(timeout)
        finally:
            with self._lock:
                done = not self._pending
            if done:
                self._closed = True
                self._persist_pool.shutdown(wait=True)
                self._target.close()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"CheckpointManager({self.root!r})"
