"""Pinned weights: a safetensors file pinned where it lies once, loaded to the GPU again and again.

The weight-sync case: a trainer writes weights to /dev/shm, and inference processes load them
onto their GPUs after every update. :func:`pin_file` maps the file (read-only, MAP_SHARED: no
second copy in host memory), validates its header, verifies it against its step's checksums
where it has them, and pins the mapping in place in pieces (cudaHostRegister, once). Every
:meth:`PinnedWeights.load` after that is copies only, on several streams, at the link's speed,
into fresh tensors or into the caller's own (``out=``).

The file may be unlinked once pinned: the mapping keeps its pages alive until
:meth:`PinnedWeights.close`, which unpins them, unmaps them and closes the mapping's
descriptor (the memory of an unlinked file then goes back to the system).

A file rewritten under a live handle is picked up at the next :meth:`PinnedWeights.load`
(or :meth:`PinnedWeights.refresh`): each load first looks at the path, and when it names a
file whose (device, inode, size, modification time in ns) differs from the one pinned, the
new file is mapped, validated and pinned, and the old one released, before any copy. When the
path no longer exists the pinned file keeps serving. Write the new weights under another name
and rename them over the path (an atomic replace); a file rewritten through the same inode
while a load copies from it gives that load a mix of old and new bytes, and one truncated
under the mapping faults (SIGBUS).

Thread safety: one lock (the handle's own) guards the mapping and its registrations; loads
and closes from several threads run one at a time. No lock of the caller's is taken.
"""

from __future__ import annotations

import os
import threading
import weakref
from types import TracebackType

import torch

from .._threads import collector_paused
from ..errors import ConfigError, StateMismatchError
from .loaders.landing import Entry, plan_landing
from .loaders.mapped import MappedFile, file_identity, open_mapped, sibling_record, submit_checks, wait_checks
from .loaders.pieces import Pins, checkers, copy_in_pieces, piece_ranges, pin_pieces, workers
from .preflight import drain

__all__ = ["PinnedWeights", "pin_file"]


class _Pinned:
    """One mapped file and the pieces of it that are pinned."""

    def __init__(self, path: str) -> None:
        self.mf = open_mapped(path, reads=False)  # (copies come from the pinned mapping)
        self.pieces = piece_ranges(self.mf.size)
        self.pins = Pins()
        self.by_name = {e.name: e for e in self.mf.entries}
        try:
            rec = sibling_record(self.mf)
            checks = submit_checks(self.mf, rec, checkers()) if rec is not None else []
            try:
                pin_pieces(self.mf.bytes, self.pieces, self.pins, workers())
                wait_checks(checks)
            finally:
                drain(checks)
        except BaseException:
            self.release()
            raise

    def release(self) -> None:
        """Unpin every piece, then unmap and close the descriptor."""
        try:
            self.pins.release()
        finally:
            self.mf.close()


def _release(held: list[_Pinned]) -> None:
    while held:
        held.pop().release()


class PinnedWeights:
    """A safetensors file pinned in place for repeated loads; made by :func:`pin_file`.

    Use it as a context manager, or call :meth:`close` when done (the pinned pages stay in
    host memory until then, also after the file is unlinked).
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        self._mu = threading.Lock()  # guards _held; held through each load, refresh and close
        with collector_paused():
            self._held: list[_Pinned] = [_Pinned(self.path)]  # [the pinned file]; [] once closed
        # Releases an abandoned handle's pins and mapping when it is collected; never at
        # interpreter exit, when the CUDA context may already be gone (the process's exit frees it all).
        self._finalizer = weakref.finalize(self, _release, self._held)
        self._finalizer.atexit = False

    def _current(self) -> _Pinned:
        if not self._held:
            raise ConfigError(f"the pinned weights of {self.path} are closed")
        return self._held[0]

    @property
    def nbytes(self) -> int:
        """Size of the pinned file in bytes (header included)."""
        with self._mu:
            return self._current().mf.size

    def tensors(self) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        """Name -> (dtype, shape) of every tensor of the pinned file, in the file's order."""
        with self._mu:
            return {e.name: (e.dtype, e.shape) for e in self._current().mf.entries}

    def refresh(self) -> bool:
        """Pick up a file rewritten at the path (see the module's docstring), as every
        :meth:`load` does first.

        Returns:
            True when a new file was pinned in place of the old one.

        Raises:
            CheckpointCorruptError: the new file is not a valid safetensors file, or fails its
                step's checksums (the old one stays pinned).
        """
        with self._mu:
            return self._refresh()

    def _refresh(self) -> bool:
        cur = self._current()
        try:
            st = os.stat(self.path)
        except FileNotFoundError:  # unlinked: the pinned pages keep serving
            return False
        if file_identity(st) == cur.mf.identity:
            return False
        with collector_paused():
            new = _Pinned(self.path)
        self._held[0] = new
        cur.release()
        return True

    def load(self, device: str | torch.device = "cuda", *,
             out: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """Copy every tensor of the pinned file to ``device``.

        Args:
            device: where the tensors go (default: the current CUDA device).
            out: tensors to load into, by name (any subset of the file's): each must have the
                stored dtype and shape, be contiguous and live on ``device``; it comes back as
                itself, filled. The others land in one fresh allocation.

        Returns:
            Tensor name -> tensor, in the file's order.

        Raises:
            StateMismatchError: ``out`` names a tensor the file lacks, or one that cannot take
                its bytes as it is (every problem listed), before anything is copied.
            CheckpointCorruptError: the file was rewritten and the new one is not valid.
            ConfigError: the handle is closed.
        """
        dev = torch.device(device)
        if str(dev) == "cuda":  # no index: the current device (compares equal to its tensors' device)
            dev = torch.device("cuda", torch.cuda.current_device())
        with self._mu, collector_paused():
            self._refresh()
            cur = self._current()
            mf = cur.mf
            dests = _checked_out(mf, cur.by_name, out, dev)
            landing = plan_landing(mf.entries, mf.data_start, mf.size - mf.data_start, dev,
                                   {k: v for k, v in dests.items() if v.numel()})
            if dev.type == "cuda":
                copy_in_pieces(mf.bytes, landing, dev, cur.pieces)
            else:
                landing.land(0, mf.bytes)
            got = landing.tensors()
        got.update(dests)
        return got

    def close(self) -> None:
        """Unpin the file, unmap it and close its descriptor (idempotent). The memory of an
        unlinked file goes back to the system here."""
        with self._mu:
            self._finalizer.detach()
            _release(self._held)

    @property
    def closed(self) -> bool:
        with self._mu:
            return not self._held

    def __enter__(self) -> PinnedWeights:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"PinnedWeights({self.path!r}{', closed' if not self._held else ''})"


def _checked_out(mf: MappedFile, by_name: dict[str, Entry], out: dict[str, torch.Tensor] | None,
                 device: torch.device) -> dict[str, torch.Tensor]:
    """``out`` when every tensor of it can take its stored tensor's bytes as it is."""
    if not out:
        return {}
    problems: list[str] = []
    seen: dict[int, str] = {}
    for name, t in out.items():
        e = by_name.get(name)
        if e is None:
            problems.append(f"out[{name!r:.100}]: {mf.path} holds no tensor of that name")
            continue
        if not isinstance(t, torch.Tensor):  # (callers pass anything)
            problems.append(f"out[{name!r:.100}]: a {type(t).__name__}, not a tensor")  # type: ignore[unreachable]
            continue
        if t.dtype != e.dtype or tuple(t.shape) != e.shape:
            problems.append(f"out[{name!r:.100}]: {_what(t.dtype, tuple(t.shape))}, but the file holds "
                            f"{_what(e.dtype, e.shape)}")
        if t.device != device:
            problems.append(f"out[{name!r:.100}]: on {t.device}, but the load is to {device}")
        if not t.is_contiguous() or t.is_conj() or t.is_neg():
            problems.append(f"out[{name!r:.100}]: not contiguous memory that holds its values as shown "
                            "(pass a contiguous tensor, then copy from it)")
        if t.numel():
            other = seen.setdefault(t.data_ptr(), name)
            if other != name:
                problems.append(f"out[{name!r:.100}]: shares its memory with out[{other!r:.100}]")
    if problems:
        raise StateMismatchError(problems)
    return dict(out)


def _what(dtype: torch.dtype, shape: tuple[int, ...]) -> str:
    return f"{str(dtype).removeprefix('torch.')}{list(shape)}"


def pin_file(path: str | os.PathLike[str]) -> PinnedWeights:
    """Pin a safetensors file in place for repeated loads to the GPU.

    The file is mapped (no copy in host memory), its header validated, its step's checksums
    verified where it is a data file of a ckptmgr step, and the mapping pinned once
    (without CUDA: mapped only; loads then copy to the CPU). Each :meth:`PinnedWeights.load`
    then copies straight from the pinned pages at the host-to-device link's speed. The file
    may be unlinked afterwards; a file rewritten at the path is picked up at the next load.

    Args:
        path: the ``.safetensors`` file (best in /dev/shm or another RAM filesystem: pinning
            a file on disk pins its page cache, read in first).

    Returns:
        The handle; close it (or use it as a context manager) to release the memory.

    Raises:
        CheckpointCorruptError: not a valid safetensors file, or it fails its step's checksums.
        FileNotFoundError: no such file.

    Example:
        >>> with ckptmgr.pin_file("/dev/shm/weights.safetensors") as weights:  # doctest: +SKIP
        ...     params = weights.load("cuda")            # fresh tensors
        ...     weights.load("cuda", out=params)         # later: into the same tensors
    """
    return PinnedWeights(path)
