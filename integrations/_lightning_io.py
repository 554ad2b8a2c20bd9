"""The body of the Lightning CheckpointIO plugins, shared by the ``lightning.pytorch`` and the
``pytorch_lightning`` classes (each Trainer accepts only plugins of its own namespace).

Lightning names checkpoints by path (``epoch=3-step=400.ckpt``, ``last.ckpt``); ckptmgr by
step. Each directory Lightning writes to gets one manager, rooted in ``<dir>/.ckptmgr``, and
each save becomes the next step there. The path Lightning asked for becomes a small pointer
file naming that step, written (atomically) only once the step has committed: a path that
exists always names a complete checkpoint, and ``ckpt_path="last"``, which picks the newest
``last*.ckpt``, finds the newest complete one. Removals run on the same ordered queue as
the commits, so ``remove_checkpoint`` never overtakes a save still in flight; a step no
pointer names any more is deleted by the manager's retention run after the next commit.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
from collections.abc import Sequence
from typing import Any

import torch

from ckptmgr import CheckpointManager, ConfigError, SaveHandle
from ckptmgr.retention import RetentionPolicy, StepInfo

from ._fence import StagingFence

__all__ = ["ROOT_NAME", "CkptmgrIOMixin", "read_pointer"]

log = logging.getLogger("ckptmgr")
ROOT_NAME = ".ckptmgr"
_FORMAT = "ckptmgr-lightning-pointer"


def read_pointer(path: str) -> int | None:
    """The step a pointer file names; None when ``path`` is not a pointer (e.g. a torch file).

    Raises:
        FileNotFoundError: no such file.
    """
    with open(path, "rb") as f:
        head = f.read(4096)
    try:
        doc = json.loads(head)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(doc, dict) or doc.get("format") != _FORMAT or type(doc.get("step")) is not int:
        return None
    return int(doc["step"])


def _write_pointer(path: str, step: int) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump({"format": _FORMAT, "root": ROOT_NAME, "step": step}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(os.path.dirname(path), os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _Unreferenced(RetentionPolicy):
    """Keeps every step but those the plugin has marked dead (no pointer names them)."""

    def __init__(self) -> None:
        self.dead: set[int] = set()
        self._mu = threading.Lock()

    def mark(self, step: int) -> None:
        with self._mu:
            self.dead.add(step)

    def keep(self, steps: Sequence[StepInfo]) -> list[bool]:
        with self._mu:
            return [s.step not in self.dead for s in steps]

    def __repr__(self) -> str:
        return "_Unreferenced()"


class _Directory:
    """One checkpoint directory: its manager, its pointers and its dead steps."""

    def __init__(self, path: str, options: dict[str, Any]) -> None:
        self.path = path
        self.policy = _Unreferenced()
        self.manager = CheckpointManager(os.path.join(path, ROOT_NAME), retention=self.policy, allow_pickle=True,
                                         **options)
        self.pointers: dict[str, int] = {}
        for name in os.listdir(path):
            p = os.path.join(path, name)
            step = read_pointer(p) if name.endswith(".ckpt") and os.path.isfile(p) else None
            if step is not None:
                self.pointers[p] = step
        named = set(self.pointers.values())
        steps = self.manager.steps()
        for s in steps:  # left by an earlier run: removed, replaced, or never pointed to (killed)
            if s not in named:
                self.policy.mark(s)
        self.next_step = steps[-1] + 1 if steps else 0


class CkptmgrIOMixin:
    """See :class:`ckptmgr.integrations.lightning.CkptmgrCheckpointIO`."""

    def __init__(self, *, overlap: bool = True, **manager_options: Any) -> None:
        for bad in ("retention", "allow_pickle"):
            if bad in manager_options:
                raise ConfigError(f"CkptmgrCheckpointIO manages {bad!r} itself (Lightning's ModelCheckpoint "
                                  "decides what to keep)")
        super().__init__()
        self.overlap = bool(overlap)
        self._options = manager_options
        self._dirs: dict[str, _Directory] = {}
        self._mu = threading.Lock()
        self._fence = StagingFence()
        self._queue: queue.Queue[tuple[str, str, int, SaveHandle | None] | None] = queue.Queue()
        self._errors: list[BaseException] = []
        self._worker: threading.Thread | None = None

    # ------------------------------------------------------------ Lightning API

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        """Start saving ``checkpoint``; ``path`` appears once it has committed."""
        if storage_options is not None:
            raise TypeError("CkptmgrCheckpointIO.save_checkpoint takes no storage_options; configure the "
                            f"manager through CkptmgrCheckpointIO(...) instead (got {storage_options!r})")
        self._raise_errors()
        path = os.path.abspath(os.fspath(path))
        d = self._directory(os.path.dirname(path))
        with self._mu:
            step, d.next_step = d.next_step, d.next_step + 1
        handle = d.manager.save(step, checkpoint, metadata={"lightning_path": os.path.basename(path)},
                                block=not self.overlap)
        self._fence.arm(handle)
        self._enqueue((path, d.path, step, handle))

    def load_checkpoint(self, path: Any, map_location: Any | None = None, weights_only: bool | None = None
                        ) -> dict[str, Any]:
        """The checkpoint ``path`` names (a pointer written by this plugin, or a file saved
        by Lightning's own ``torch.save``)."""
        path = os.path.abspath(os.fspath(path))
        self._drain()
        if not os.path.exists(path):
            raise FileNotFoundError(f"Checkpoint file not found: {path}")
        step = read_pointer(path)
        if step is None:
            # a file from Lightning's own CheckpointIO: trusted as Lightning trusts it
            loaded: dict[str, Any] = torch.load(path, map_location=map_location, weights_only=bool(weights_only))
            return loaded
        d = self._directory(os.path.dirname(path))
        device = map_location if isinstance(map_location, (str, torch.device)) else None
        out: dict[str, Any] = d.manager.restore(step, device=device)
        return out

    def remove_checkpoint(self, path: Any) -> None:
        """Remove ``path``, after every save queued before this call has committed."""
        path = os.path.abspath(os.fspath(path))
        if os.path.isdir(os.path.dirname(path)):
            self._directory(os.path.dirname(path))
        self._enqueue((path, os.path.dirname(path), -1, None))

    def teardown(self) -> None:
        """Wait until every save has committed and every removal is done; raise the first
        error of any of them."""
        try:
            self._fence.wait()
            self._drain()
            with self._mu:
                dirs = list(self._dirs.values())
            for d in dirs:
                d.manager.wait()
                d.manager.apply_retention()  # steps no pointer names any more
                d.manager.close()
        finally:
            with self._mu:
                self._dirs = {}
            self._raise_errors()

    # ------------------------------------------------------------- internals

    def _directory(self, path: str) -> _Directory:
        with self._mu:
            d = self._dirs.get(path)
            if d is None:
                os.makedirs(path, exist_ok=True)
                d = self._dirs[path] = _Directory(path, self._options)
            return d

    def _enqueue(self, item: tuple[str, str, int, SaveHandle | None]) -> None:
        with self._mu:
            if self._worker is None or not self._worker.is_alive():
                self._worker = threading.Thread(target=self._work, name="ckptmgr-lightning", daemon=True)
                self._worker.start()
        self._queue.put(item)

    def _drain(self) -> None:
        self._queue.join()

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                self._apply(*item)
            except BaseException as exc:
                log.error("lightning checkpoint %s: %s", item[0] if item else "?", exc)
                with self._mu:
                    self._errors.append(exc)
            finally:
                self._queue.task_done()

    def _apply(self, path: str, dirpath: str, step: int, handle: SaveHandle | None) -> None:
        d = self._dirs.get(dirpath)
        if handle is not None:
            handle.result()  # committed; a failure leaves the path as it was
            assert d is not None
            _write_pointer(path, step)
        elif os.path.exists(path):
            os.remove(path)
        if d is None:
            return
        old = d.pointers.pop(path, None)
        if handle is not None:
            d.pointers[path] = step
        if old is not None and old not in d.pointers.values():
            d.policy.mark(old)

    def _raise_errors(self) -> None:
        with self._mu:
            errors, self._errors = self._errors, []
        if errors:
            raise errors[0]
