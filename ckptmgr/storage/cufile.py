"""GPUDirect Storage through kvikio: a probe that cannot hang, and the cuFile writer.

kvikio is an optional extra (``pip install 'ckptmgr[gds]'``) and is imported only when GDS is
asked for. Whether it can do I/O on a machine is found out once per directory in a child
process with a time limit: without an NVIDIA driver every kvikio read fails, and with cuFile
forced on a machine without GDS opening a file can hang, which must never stall training.
When the probe fails, callers fall back to POSIX I/O and say why.

The probe also tells real GDS (the nvidia-fs driver, data moved by DMA between the disk and
GPU memory) from kvikio's compatibility mode (POSIX reads through a bounce buffer): only the
first is faster than the pinned ring, so ``loader="auto"`` picks GDS only then.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import subprocess
import sys
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from ..errors import ConfigError

__all__ = ["INSTALL_HINT", "GdsStatus", "enable_writer", "installed", "kvikio_module", "probe",
           "pwrite_all"]

log = logging.getLogger("ckptmgr")
INSTALL_HINT = "pip install 'ckptmgr[gds]'"
T = TypeVar("T")
PROBE_TIMEOUT_S = 60.0

_PROBE = r"""
import json, os, sys
import numpy as np
import kvikio
path = sys.argv[1]
data = np.arange(8192, dtype=np.uint8)
back = np.zeros_like(data)
compat = None
try:
    f = kvikio.CuFile(path, "w")
    try:
        wrote = f.write(data)
        if hasattr(f, "is_compat_mode_preferred"):
            compat = bool(f.is_compat_mode_preferred())
    finally:
        f.close()
    f = kvikio.CuFile(path, "r")
    try:
        read = f.read(back)
    finally:
        f.close()
finally:
    if os.path.exists(path):
        os.unlink(path)
ok = wrote == read == data.size and bool((back == data).all())
print(json.dumps({"ok": ok, "compat": compat, "nvidia_fs": os.path.exists("/proc/driver/nvidia-fs")}))
"""


@dataclass(frozen=True)
class GdsStatus:
    """What kvikio can do for files in one directory."""

    usable: bool  # reads and writes work
    compat: bool  # through POSIX (no nvidia-fs): no faster than ckptmgr's own paths
    reason: str  # why not usable, or how it runs

    def __str__(self) -> str:
        return self.reason


def installed() -> bool:
    """True when kvikio can be imported (without importing it)."""
    return importlib.util.find_spec("kvikio") is not None


def kvikio_module() -> Any:
    """The kvikio module.

    Raises:
        ConfigError: kvikio is not installed; the message says how to install it.
    """
    try:
        import kvikio
    except ImportError as exc:
        raise ConfigError(f"GPUDirect Storage needs kvikio, which cannot be imported ({exc}): {INSTALL_HINT}") from None
    return kvikio


_probed: dict[str, GdsStatus] = {}
_probe_lock = threading.Lock()


def probe(directory: str, timeout: float | None = None) -> GdsStatus:
    """Whether kvikio can read and write files in ``directory``, found out once per directory
    in a child process that is killed after ``timeout`` seconds (default PROBE_TIMEOUT_S)."""
    directory = os.path.abspath(directory)
    with _probe_lock:
        if directory in _probed:
            return _probed[directory]
        status = _run_probe(directory, PROBE_TIMEOUT_S if timeout is None else timeout)
        _probed[directory] = status
    log.info("GPUDirect Storage in %s: %s", directory, status)
    return status


def _run_probe(directory: str, timeout: float) -> GdsStatus:
    if not installed():
        return GdsStatus(False, True, f"kvikio is not installed ({INSTALL_HINT})")
    path = os.path.join(directory, f".ckptmgr-gds-probe-{os.getpid()}")
    try:
        done = subprocess.run([sys.executable, "-c", _PROBE, path], capture_output=True, text=True,
                              timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(OSError):
            os.unlink(path)
        return GdsStatus(False, True, f"kvikio did not finish a test read in {timeout:.0f} s (cuFile forced "
                                      "without GDS hangs; KVIKIO_COMPAT_MODE=ON or AUTO avoids that)")
    last = (done.stdout.strip().splitlines() or [""])[-1]
    try:
        info = json.loads(last) if done.returncode == 0 else None
    except ValueError:
        info = None
    if not isinstance(info, dict) or not info.get("ok"):
        err = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return GdsStatus(False, True, f"kvikio cannot do I/O here: {err}")
    compat = info["compat"] if isinstance(info.get("compat"), bool) else not info.get("nvidia_fs")
    return GdsStatus(True, compat, "kvikio in compatibility mode (POSIX, no nvidia-fs)" if compat
                     else "kvikio with GPUDirect Storage")


def pwrite_all(path: str, data: Any, ranges: list[tuple[int, int]], meanwhile: Callable[[], T]) -> T:
    """Write ``data[b:e]`` at offset ``b`` of ``path`` for each range, in parallel through
    kvikio; run ``meanwhile`` (checksums) while the writes are in flight and return its result.

    Raises:
        OSError: a write came up short.
    """
    kvikio = kvikio_module()
    f = kvikio.CuFile(path, "r+")
    try:
        futures = [(b, e, f.pwrite(data[b:e], e - b, b)) for b, e in ranges]
        result = meanwhile()
        for b, e, fut in futures:
            n = fut.get()
            if n != e - b:
                raise OSError(f"{path}: kvikio wrote {n} of {e - b} bytes at offset {b}")
    finally:
        f.close()
    return result


def enable_writer(target: object, root: str) -> str:
    """Make the local ``target`` write through cuFile when kvikio can do I/O under ``root``;
    return how it writes.

    Raises:
        ConfigError: ``target`` is not on a local filesystem, or kvikio is not installed.
    """
    if not isinstance(getattr(target, "gds", None), bool) or not isinstance(getattr(target, "path", None), str):
        raise ConfigError(f"WriteOptions.gds=True needs a local or NFS root; {root} is not one")
    kvikio_module()
    status = probe(target.path)  # type: ignore[attr-defined]
    if not status.usable:
        warnings.warn(f"WriteOptions.gds: {status}; writing with POSIX I/O", RuntimeWarning, stacklevel=3)
        return f"posix ({status})"
    target.gds = True  # type: ignore[attr-defined]
    return str(status)
