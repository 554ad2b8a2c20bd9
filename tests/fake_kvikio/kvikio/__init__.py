"""A stand-in for kvikio on machines without a GPU: the same CuFile calls, done with POSIX.

CKPTMGR_FAKE_KVIKIO selects how it behaves, like the real one on different machines:
``ok`` (the default; compatibility mode, as on a GPU machine without nvidia-fs), ``gds``
(reports real GPUDirect Storage), ``nodriver`` (every I/O fails, as without an NVIDIA
driver) and ``hang`` (opening a file never returns, as with cuFile forced and no GDS).
Each read and write is appended to the file named by CKPTMGR_FAKE_KVIKIO_LOG, if set.
"""

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from . import defaults  # noqa: F401

_pool = ThreadPoolExecutor(4)
_log_lock = threading.Lock()


def _mode():
    return os.environ.get("CKPTMGR_FAKE_KVIKIO", "ok")


def _log(what, path, n):
    log = os.environ.get("CKPTMGR_FAKE_KVIKIO_LOG")
    if log:
        with _log_lock, open(log, "a") as f:
            f.write(f"{what} {os.path.basename(path)} {n}\n")


class IOFuture:
    def __init__(self, fut):
        self._fut = fut

    def get(self):
        return self._fut.result()

    def done(self):
        return self._fut.done()


def _mv(buf, size):
    return memoryview(buf).cast("B")[:size]


class CuFile:
    def __init__(self, path, flags="r"):
        if _mode() == "hang":
            while True:
                time.sleep(60)
        self._path = str(path)
        os_flags = {"r": os.O_RDONLY, "r+": os.O_RDWR, "w": os.O_WRONLY | os.O_CREAT | os.O_TRUNC,
                    "w+": os.O_RDWR | os.O_CREAT | os.O_TRUNC}[flags]
        self._fd = os.open(self._path, os_flags, 0o644)

    def close(self):
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def is_compat_mode_preferred(self):
        return _mode() != "gds"

    def _check(self):
        if _mode() == "nodriver":
            raise RuntimeError("cuInit failed: libcuda.so.1: cannot open shared object file")

    def _pread(self, buf, size, offset):
        self._check()
        view, done = _mv(buf, size), 0
        while done < size:
            n = os.preadv(self._fd, [view[done:]], offset + done)
            if n == 0:
                break
            done += n
        _log("read", self._path, done)
        return done

    def _pwrite(self, buf, size, offset):
        self._check()
        view, done = _mv(buf, size), 0
        while done < size:
            done += os.pwrite(self._fd, view[done:], offset + done)
        _log("write", self._path, done)
        return done

    def pread(self, buf, size=None, file_offset=0):
        size = memoryview(buf).nbytes if size is None else size
        return IOFuture(_pool.submit(self._pread, buf, size, file_offset))

    def pwrite(self, buf, size=None, file_offset=0):
        size = memoryview(buf).nbytes if size is None else size
        return IOFuture(_pool.submit(self._pwrite, buf, size, file_offset))

    def read(self, buf, size=None, file_offset=0):
        return self.pread(buf, size, file_offset).get()

    def write(self, buf, size=None, file_offset=0):
        return self.pwrite(buf, size, file_offset).get()
