"""The body of the Lightning CheckpointIO plugins, shared by the ``lightning.pytorch`` and the
``pytorch_lightning`` classes (each Trainer accepts only plugins of its own namespace).

Every ``.ckpt`` is a standard PyTorch checkpoint file, the file ``torch.save`` would write
for the same dict plus one record of CRC32C checksums that torch ignores: ``torch.load``,
Lightning's ``pl_load``, ``Model.load_from_checkpoint`` and LightningCLI read it with no
ckptmgr installed. What differs from Lightning's own plugin is when the work happens: the
training step pays for a copy into reused host memory (no GPU clone), and the file is
written, fsynced and renamed into place by a background thread: the save engine
(:class:`ckptmgr.save.engine.AsyncWriter`) stages the file's image (:class:`_ZipImage`) and its
worker commits it (:class:`ckptmgr.storage.commit.file.FileCommit`). Saves and removals run in the
order they were made: a ``.ckpt`` path that exists always holds a complete file, and a removal
never overtakes a save in flight.

Which saves run in the background: those a ``Checkpoint`` callback (ModelCheckpoint) makes,
which Lightning waits for at teardown. Any other ``trainer.save_checkpoint(path)`` returns
once ``path`` is on disk (unless ``async_direct_saves=True``), as with Lightning's own
plugin: the next line may copy, load or upload it.

ModelCheckpoint picks a versioned name (``-v1``) when its file exists; a file still being
written does not exist yet. So while a plugin has saves in flight, ``ModelCheckpoint.file_exists``
also answers True for their paths (the one change this module makes to Lightning, installed
at the first background save), and no two saves ever get the same name.

The plugin holds nothing but its options until the first save: the writer (threads, staging
slots) is created then, dropped by ``teardown`` and never pickled, so Trainers, strategies and
callbacks that hold the plugin can be pickled, deep-copied and sent to ``ddp_spawn`` workers.
"""

from __future__ import annotations

import io
import logging
import os
import re
import shutil
import sys
import threading
from concurrent.futures import Executor
from types import FrameType
from typing import Any

import numpy as np
import torch

from ckptmgr import CheckpointCorruptError, ConfigError, S3Options, StagingOptions, WriteOptions
from ckptmgr.extend import (
    AsyncWriter,
    Destinations,
    FileCommit,
    FilePlan,
    StoredTensor,
    TorchZipImage,
    option_or_default,
    plan_image,
    seal,
    verify_file,
)

from ._fence import StagingFence

__all__ = ["CkptmgrIOMixin", "install_in_flight_check"]

_STACK_DEPTH = 12  # frames searched for the Checkpoint callback that asked for a save
_ZIP_MAGIC = b"PK\x03\x04"
_LAST = re.compile(r"last(-v?\d+)?\.ckpt$")  # ModelCheckpoint's last checkpoints: last.ckpt, last-v1.ckpt
_STEP = re.compile(r"(?:^|[-_])step=(\d+)")  # ModelCheckpoint's names: epoch=3-step=400.ckpt

log = logging.getLogger("ckptmgr")


def _cpu(storage: Any, location: Any) -> Any:
    return storage  # Lightning's default map_location: tensors stay on the CPU


def _url_fs(path: Any, storage_options: dict[str, Any] | None, *, resolve: bool = True) -> tuple[str, Any]:
    """``(path, fs)``: an absolute local path and None, or an fsspec URL and its filesystem
    (None without ``resolve``)."""
    p = os.fspath(path)
    if "://" in p and not p.startswith("file://"):
        if not resolve:
            return p, None
        import fsspec

        fs, _ = fsspec.core.url_to_fs(p, **(storage_options or {}))
        return p, fs
    if p.startswith("file://"):
        p = p[len("file://"):]
    return os.path.abspath(p), None


def _basename(p: str) -> str:
    return p.rstrip("/").rsplit("/", 1)[-1]


def _newer(p: str, fs: Any, step: int) -> list[tuple[int, str]]:
    """The ``.ckpt`` files beside ``p`` whose names give a step above ``step``, newest first."""
    directory = p.rstrip("/").rsplit("/", 1)[0] if "/" in p.rstrip("/") else "."
    try:
        names = [n.rstrip("/") for n in fs.ls(directory, detail=False)] if fs is not None else \
            [os.path.join(directory, n) for n in os.listdir(directory)]
    except OSError:
        return []
    found = []
    for n in names:
        m = _STEP.search(_basename(n))
        if m is not None and n.endswith(".ckpt") and int(m.group(1)) > step and not _LAST.match(_basename(n)):
            found.append((int(m.group(1)), n if fs is None or "://" not in p else _with_protocol(p, n)))
    return sorted(found, reverse=True)


def _with_protocol(p: str, listed: str) -> str:
    """``listed`` (as fsspec lists it, without the protocol) as a URL like ``p``."""
    return listed if "://" in listed else f"{p.split('://', 1)[0]}://{listed.lstrip('/')}"


class InFlight:
    """Paths with a save enqueued and not yet committed, counted (one lock, any thread)."""

    def __init__(self) -> None:
        self._mu = threading.Lock()
        self._paths: dict[str, int] = {}  # guarded by _mu

    def add(self, path: str) -> None:
        with self._mu:
            self._paths[path] = self._paths.get(path, 0) + 1

    def discard(self, path: str) -> None:
        with self._mu:
            n = self._paths.get(path, 0) - 1
            if n > 0:
                self._paths[path] = n
            else:
                self._paths.pop(path, None)

    def __contains__(self, path: object) -> bool:
        with self._mu:
            return path in self._paths


IN_FLIGHT = InFlight()  # every plugin of the process: what ModelCheckpoint must count as existing


class _ZipImage:
    """A torch checkpoint file's image (:mod:`ckptmgr.format.torchzip`) as the save engine
    stages it: torch's static bytes filled in, each storage copied as a ``U8`` tensor at its
    offset, the CRC-32 of every record sealed once the copies have landed."""

    def __init__(self, image: TorchZipImage) -> None:
        self.image = image
        self.size = image.size
        self.plan: FilePlan | None = None
        if image.static:
            head = image.static[0][1]
            assert image.static[0][0] == 0
            assert head
            tensors = [StoredTensor(f"data/{s.key}", "U8", (s.nbytes,), s.offset - len(head),
                                    s.offset - len(head) + s.nbytes, s.source) for s in image.spans]
            self.plan = FilePlan("checkpoint", head, tensors)

    def fill(self, segment: torch.Tensor) -> None:
        self.image.write_static(segment.numpy())

    def seal(self, buffer: np.ndarray[Any, Any], io: Executor) -> None:
        seal(self.image, buffer, io)


def _remove(path: str, fs: Any) -> None:
    if fs is None:
        try:
            os.remove(path)
        except FileNotFoundError:
            return
        except IsADirectoryError:  # a directory Lightning's own plugin might have made
            shutil.rmtree(path)
        return
    if fs.exists(path):
        fs.rm(path, recursive=True)


def install_in_flight_check(model_checkpoint: Any) -> None:
    """Make ``model_checkpoint.file_exists`` count paths with a save in flight as existing."""
    original = model_checkpoint.file_exists
    if getattr(original, "_ckptmgr", False):
        return

    def file_exists(self: Any, filepath: Any, trainer: Any) -> bool:
        if trainer.is_global_zero and _url_fs(filepath, None, resolve=False)[0] in IN_FLIGHT:
            return bool(trainer.strategy.broadcast(True))
        return bool(original(self, filepath, trainer))

    file_exists._ckptmgr = True  # type: ignore[attr-defined]
    file_exists.__doc__ = original.__doc__
    model_checkpoint.file_exists = file_exists


class CkptmgrIOMixin:
    """See :class:`ckptmgr.integrations.lightning.CkptmgrCheckpointIO`."""

    _namespace = "lightning.pytorch"  # where the Checkpoint callback classes live

    def __init__(self, *, overlap: bool = True, async_direct_saves: bool = False,
                 write_options: WriteOptions | None = None, staging: StagingOptions | None = None,
                 storage_options: dict[str, Any] | None = None, s3_options: S3Options | None = None) -> None:
        if not isinstance(overlap, bool) or not isinstance(async_direct_saves, bool):
            raise ConfigError(f"overlap and async_direct_saves must be bools, got {overlap!r}, {async_direct_saves!r}")
        self._write_options = option_or_default(write_options, WriteOptions, "write_options", WriteOptions)
        self._staging = option_or_default(staging, StagingOptions, "staging", lambda: StagingOptions(slots=2))
        self._storage_options = option_or_default(storage_options, dict, "storage_options", None)
        self._s3_options = option_or_default(s3_options, S3Options, "s3_options", None)
        if self._staging.on_busy != "wait":
            raise ConfigError("CkptmgrCheckpointIO never skips a save Lightning asked for: StagingOptions.on_busy "
                              "must be 'wait'")
        if self._staging.local_tier:
            raise ConfigError("CkptmgrCheckpointIO writes .ckpt files; StagingOptions.local_tier does not apply")
        if self._staging.device_buffer_bytes:
            raise ConfigError("CkptmgrCheckpointIO copies straight to the host; StagingOptions.device_buffer_bytes "
                              "applies to CheckpointManager")
        super().__init__()
        self.overlap = overlap
        self.async_direct_saves = async_direct_saves
        self._init_runtime()

    def _init_runtime(self) -> None:
        self._mu = threading.Lock()  # guards _writer
        self._writer: AsyncWriter | None = None
        self._dests: Destinations | None = None  # the writer's (its worker thread's)
        self._fence = StagingFence()

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        for name in ("_mu", "_writer", "_dests", "_fence"):
            state.pop(name, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._init_runtime()

    # ------------------------------------------------------------ Lightning API

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        """Write ``checkpoint`` to ``path`` as a torch checkpoint file.

        A save by a ``Checkpoint`` callback returns once the copy off the training tensors is
        enqueued; the file appears, complete, when it has been written. Any other save returns
        once the file is on disk (see ``async_direct_saves``).

        Raises:
            TypeError: ``storage_options`` were given (as Lightning's own plugin).
            Exception: an earlier background save or removal failed.
        """
        if storage_options is not None:
            raise TypeError(
                "`Trainer.save_checkpoint(..., storage_options=...)` with `storage_options` arg is not supported "
                f"for `{self.__class__.__name__}`; configure it through CkptmgrCheckpointIO(...) instead")
        self._raise_errors()
        p, fs = _url_fs(path, self._storage_options)
        callback, manual = self._caller()
        background = self.async_direct_saves or callback
        writer, dests = self._get_writer()
        self._fence.wait()  # a previous save's copies (its tensors may be these)
        w = self._write_options
        image = plan_image(checkpoint, chunk_size=max(w.chunk_size, 4 << 20))
        IN_FLIGHT.add(p)
        try:
            commit = FileCommit(p, fs, dests, chunk_size=max(w.chunk_size, 4 << 20), direct_io=w.direct_io,
                                done=lambda: IN_FLIGHT.discard(p))
            staged = writer.submit([_ZipImage(image)], commit, label=f"checkpoint {p}", report=background)
        except BaseException:
            IN_FLIGHT.discard(p)
            raise
        if not background:
            try:
                staged.result()  # on disk when this returns; the error, if any, is raised here
            finally:
                self._park_if_idle()
            return
        # Overlap the device-to-host copies with the next step only where the fence sees every
        # change to come: automatic optimization (Lightning orders the steps). CPU copies compete
        # with the training thread for memory bandwidth anyway: they are waited for here.
        if self.overlap and not manual and any(s.source.is_cuda for s in image.spans):
            self._fence.arm(staged)
        else:
            staged.wait_staged()

    def load_checkpoint(self, path: Any, map_location: Any | None = _cpu, weights_only: bool | None = None
                        ) -> dict[str, Any]:
        """Load a checkpoint file (this plugin's, or any ``torch.save`` file), after the saves
        in flight have finished; a file of this plugin's has its checksums verified first.

        ``weights_only`` is passed to ``torch.load`` as given (None: torch's default, True).

        A *last* checkpoint (``last.ckpt``, ``last-v1.ckpt``: what ``ckpt_path="last"`` picks, by
        modification time) stands for the newest complete checkpoint of its directory: when a
        ``.ckpt`` beside it names a higher step (``...step=N...``, Lightning's names) and
        verifies, that one is loaded instead (the save of ``last.ckpt`` was cut short by a
        crash, say); when the last checkpoint itself fails its checksums, the newest one that
        verifies is loaded. Either is logged as a warning naming both files.

        Raises:
            FileNotFoundError: no such file.
            CheckpointCorruptError: the file fails its checksums (a last checkpoint: and no
                other checkpoint of its directory verifies).
        """
        p, fs = _url_fs(path, self._storage_options)
        self.wait()
        if not (os.path.isfile(p) if fs is None else fs.isfile(p)):
            raise FileNotFoundError(f"Checkpoint file not found: {path}")
        if not _LAST.match(_basename(p)):
            return self._load(path, p, fs, map_location, weights_only)
        loaded: dict[str, Any] | None = None
        try:
            loaded = self._load(path, p, fs, map_location, weights_only)
        except CheckpointCorruptError as exc:
            damaged: CheckpointCorruptError | None = exc
            log.warning("%s is damaged (%s); looking for the newest checkpoint beside it that verifies", path, exc)
        else:
            damaged = None
        step = loaded.get("global_step", -1) if isinstance(loaded, dict) else -1
        for other_step, other in _newer(p, fs, step if isinstance(step, int) else -1):
            try:
                newer = self._load(other, other, fs, map_location, weights_only)
            except CheckpointCorruptError as exc:
                log.warning("%s is damaged (%s); skipped", other, exc)
                continue
            log.warning("resuming from %s (step %d), the newest checkpoint that verifies, rather than %s (%s)",
                        other, other_step, path, "damaged" if damaged is not None else f"step {step}")
            return newer
        if loaded is None:
            assert damaged is not None
            raise damaged
        return loaded

    def _load(self, path: Any, p: str, fs: Any, map_location: Any | None, weights_only: bool | None
              ) -> dict[str, Any]:
        """Verify and load the file ``p`` (``path`` as the caller named it)."""
        if fs is None:
            with open(p, "rb") as f:
                if f.read(4) == _ZIP_MAGIC:  # else a legacy torch.save file: torch.load decides
                    verify_file(f, what=str(path))
            loaded: dict[str, Any] = torch.load(p, map_location=map_location, weights_only=weights_only)
            return loaded
        with fs.open(p, "rb") as f:
            data = io.BytesIO(f.read())  # read once: verified, then loaded
        if data.getvalue()[:4] == _ZIP_MAGIC:
            verify_file(data, what=str(path))
        data.seek(0)
        loaded = torch.load(data, map_location=map_location, weights_only=weights_only)
        return loaded

    def remove_checkpoint(self, path: Any) -> None:
        """Remove ``path``, after every save enqueued before this call has been written."""
        p, fs = _url_fs(path, self._storage_options)
        writer, _ = self._get_writer()
        if writer.idle:  # nothing in flight: no thread needed (a failure is raised here)
            _remove(p, fs)
            return
        writer.call(lambda: _remove(p, fs), label=f"checkpoint {p}")  # after the saves before it

    def teardown(self) -> None:
        """Wait for every save and removal; stop the threads and free the staging memory.

        Raises:
            Exception: the first error of a background save or removal not yet reported.
        """
        with self._mu:
            writer, self._writer, self._dests = self._writer, None, None
        try:
            self._fence.wait()
        finally:
            if writer is not None:
                writer.close()
                self._raise(writer.take_errors())

    def wait(self, timeout: float | None = None) -> None:
        """Block until every save and removal so far has finished (the threads stay).

        Raises:
            CkptTimeoutError: still busy after ``timeout`` seconds.
            Exception: the first error of a background save or removal not yet reported.
        """
        with self._mu:
            writer = self._writer
        if writer is not None:
            writer.wait(timeout)
            self._raise(writer.take_errors())

    # ------------------------------------------------------------- internals

    def _get_writer(self) -> tuple[AsyncWriter, Destinations]:
        with self._mu:
            if self._writer is None or self._dests is None:
                w, s = self._write_options, self._staging
                dests = Destinations(self._storage_options, self._s3_options, io_threads=w.io_threads)
                # (no daemon threads: teardown stops them; a plugin never torn down is closed at exit)
                self._writer = AsyncWriter(slots=s.slots, copy_threads=s.copy_threads, io_threads=w.io_threads,
                                           max_host_bytes=s.max_host_bytes, busy_timeout=s.busy_timeout,
                                           daemon=False, name="ckptmgr-lightning", close_at_exit=True,
                                           on_stop=dests.close)
                self._dests = dests
            return self._writer, self._dests

    def _park_if_idle(self) -> None:
        with self._mu:
            writer = self._writer
        if writer is not None:
            writer.park()

    def _caller(self) -> tuple[bool, bool]:
        """Whether a ``Checkpoint`` callback (ModelCheckpoint, ...) of a running Trainer asked
        for this save (its teardown then waits for it), and whether the module trains with
        manual optimization."""
        callbacks = sys.modules.get(f"{self._namespace}.callbacks")
        kinds = getattr(callbacks, "Checkpoint", None)
        frame: FrameType | None = sys._getframe(2)
        for _ in range(_STACK_DEPTH):
            if frame is None or kinds is None:
                return False, False
            if isinstance(frame.f_locals.get("self"), kinds):
                trainer = frame.f_locals.get("trainer")
                status = getattr(getattr(trainer, "state", None), "status", None)
                if getattr(status, "value", None) != "running":
                    return False, False  # no run whose teardown would wait for it
                model_checkpoint = getattr(callbacks, "ModelCheckpoint", None)
                if model_checkpoint is not None:
                    install_in_flight_check(model_checkpoint)
                module = getattr(trainer, "lightning_module", None)
                return True, not getattr(module, "automatic_optimization", True)
            frame = frame.f_back
        return False, False

    def _raise_errors(self) -> None:
        with self._mu:
            writer = self._writer
        if writer is not None:
            self._raise(writer.take_errors())

    @staticmethod
    def _raise(errors: list[BaseException]) -> None:
        if errors:
            raise errors[0]
