"""Python child processes forked from a pre-imported template, for the tests that start many.

A fresh interpreter that imports torch takes about 3 s of CPU here, one that imports Lightning
or the Hugging Face Trainer 10-13 s; a test suite that starts a few hundred such children
spends most of its time importing. A *template* ("zygote") is a server process that has
imported those modules once (import only: no torch op has run, so no thread pool exists) and
forks a real child per request. The child runs the requested script, ``-m`` module or ``-c``
code with the request's argv, environment, working directory and standard streams, as
``python`` would, and exits with its status. It is a real separate process: it can be sent
SIGKILL or SIGSTOP, its pipes close when it dies, its exit status is the signal that ended it.

:class:`Popen` is :class:`subprocess.Popen` with the fork done by the template (the standard
class handles the pipes, ``text``, ``communicate`` and timeouts); :func:`run` is
:func:`subprocess.run` over it. Both take ``[sys.executable, ...]`` argument lists.

Not for a test whose promise is about a fresh interpreter: what a process imports, its peak
memory, its start-up time, an environment variable read at import time, ``pass_fds``. Those
start ``python`` with :mod:`subprocess` as before.

Templates (``template=``): ``"torch"`` has imported numpy, torch and ckptmgr; ``"lightning"``
numpy, torch, Lightning, transformers' Trainer and accelerate, but not ckptmgr (a child that
blocks ckptmgr's import finds it not imported; the others import it, in milliseconds). One
server of each kind per test process, started on first use, ended when that process exits (or,
should it be killed, within a second of noticing it is gone). Variables that the templates'
imports read (Hugging Face's offline switches and caches, ...) must be the template's in the
child too: a child asking for other values is refused.

Protocol: one Unix-socket connection per child. The request (JSON, length-prefixed) carries
argv, cwd, env, session flags; the three stdio descriptors travel with it (SCM_RIGHTS). The
template forks a monitor, which forks the child, sends ``pid N``, waits for it and sends
``status S`` (the raw wait status), then exits.
"""

from __future__ import annotations

import array
import atexit
import json
import os
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

_PRELOAD = {
    "torch": ["numpy", "torch", "safetensors.torch", "ckptmgr"],
    # no ckptmgr: a child may block its import (a reader "without ckptmgr"), and imports it itself otherwise
    "lightning": ["numpy", "torch", "safetensors.torch", "lightning.pytorch", "transformers", "transformers.trainer",
                  "accelerate"],
}


# ---------------------------------------------------------------------------------------------
# The client side (the test process)
# ---------------------------------------------------------------------------------------------

class _Server:
    """One running template: its process and socket path."""

    def __init__(self, template: str) -> None:
        self.dir = tempfile.mkdtemp(prefix="ckptmgr-zygote-")
        self.path = os.path.join(self.dir, "sock")
        env = _template_env()
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), self.path, str(os.getpid()),
                                      *_PRELOAD[template]],
                                     stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, env=env, text=True)
        line = self.proc.stdout.readline() if self.proc.stdout else ""
        if line.strip() != "ready":
            self.proc.kill()
            self.proc.wait()
            raise RuntimeError(f"the {template} template did not start (said {line!r})")

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()
        if self.proc.stdout:
            self.proc.stdout.close()
        try:
            os.unlink(self.path)
            os.rmdir(self.dir)
        except OSError:
            pass


# Read when the template imports its modules: a child must see the template's values.
_IMPORT_TIME_ENV = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE", "HF_HOME", "HF_HUB_CACHE",
                    "TRANSFORMERS_CACHE", "TORCH_HOME", "PYTHONHASHSEED", "PYTHONDONTWRITEBYTECODE",
                    "PYTHONSAFEPATH", "PYTHONNOUSERSITE", "LD_PRELOAD", "LD_LIBRARY_PATH")
_TEMPLATE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


def _template_env() -> dict[str, str]:
    # PYTHONPATH stays: the template imports ckptmgr from where this process does (an installed package, or
    # a tree put on PYTHONPATH, as gpu_suite.sh does); a child's own PYTHONPATH comes first in its sys.path
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}  # (a child's own)
    env.update(_TEMPLATE_ENV)
    return env


def _check_import_time_env(env: dict, template: str) -> None:
    base = _template_env()
    differ = [k for k in _IMPORT_TIME_ENV if env.get(k) != base.get(k) and not (k in _TEMPLATE_ENV and k not in env)]
    if differ:
        raise ValueError(f"the {template} template read {differ} at import with other values than this child's: "
                         "start this child with subprocess")


_servers: dict[str, _Server] = {}
_servers_lock = threading.Lock()  # guards _servers


def _server(template: str) -> _Server:
    with _servers_lock:
        if template not in _servers:
            _servers[template] = _Server(template)
        return _servers[template]


@atexit.register
def _stop_all() -> None:
    with _servers_lock:
        for s in _servers.values():
            s.stop()
        _servers.clear()


def _send(sock: socket.socket, obj: Any, fds: list[int]) -> None:
    data = json.dumps(obj).encode()
    sock.sendmsg([struct.pack("!I", len(data)) + data],
                 [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])


class Popen(subprocess.Popen):
    """:class:`subprocess.Popen` of ``[sys.executable, ...]`` whose child is forked by a template.

    Args:
        args: ``[sys.executable, SCRIPT | -m MODULE | -c CODE, *argv]`` (``-u`` may come first).
        template: ``"torch"`` or ``"lightning"`` (see the module's docstring).
        **kwargs: as :class:`subprocess.Popen`; ``preexec_fn``, ``shell``,
            ``executable``, ``user``/``group`` and a ``close_fds=False`` are refused.
    """

    def __init__(self, args: list[str], *, template: str = "torch", **kwargs: Any) -> None:
        for k in ("preexec_fn", "shell", "executable", "user", "group", "extra_groups"):
            if kwargs.get(k):
                raise ValueError(f"zygote.Popen does not support {k}")
        if kwargs.get("close_fds") is False:
            raise ValueError("zygote.Popen always closes the descriptors beyond 0-2")
        args = [os.fspath(a) for a in args]
        if not args or args[0] != sys.executable:
            raise ValueError(f"zygote.Popen starts {sys.executable} only, not {args[:1]}")
        self._template = template
        self._sock: socket.socket | None = None
        self._buf = b""
        super().__init__(args, **kwargs)

    def _execute_child(self, args, executable, preexec_fn, close_fds, pass_fds, cwd, env,  # type: ignore[override]
                       startupinfo, creationflags, shell, p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite,
                       restore_signals, gid, gids, uid, umask, start_new_session, *rest):
        process_group = rest[0] if rest else -1
        stdio = [p2cread if p2cread != -1 else 0, c2pwrite if c2pwrite != -1 else 1,
                 errwrite if errwrite != -1 else 2]
        env = dict(os.environ if env is None else env)
        stdio += list(pass_fds)
        _check_import_time_env(env, self._template)
        request = {"argv": list(args[1:]), "cwd": os.fspath(cwd) if cwd is not None else os.getcwd(),
                   "env": {os.fsdecode(k): os.fsdecode(v) for k, v in env.items()},
                   "start_new_session": bool(start_new_session),
                   "process_group": process_group if process_group is not None else -1,
                   "umask": umask, "pass_fds": list(pass_fds)}
        try:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(_server(self._template).path)
            self._sock = sock
            _send(sock, request, stdio)
            line = self._line(timeout=60)
            if line is None or not line.startswith("pid "):
                raise OSError(f"the {self._template} template did not start the child (said {line!r})")
            self.pid = int(line.split()[1])
        finally:
            # as subprocess.Popen does: the child's ends of the pipes made for it are closed here
            if p2cread != -1 and p2cwrite != -1 and p2cread != getattr(self, "_devnull", None):
                os.close(p2cread)
            if c2pwrite != -1 and c2pread != -1 and c2pwrite != getattr(self, "_devnull", None):
                os.close(c2pwrite)
            if errwrite != -1 and errread != -1 and errwrite != getattr(self, "_devnull", None):
                os.close(errwrite)
            if hasattr(self, "_devnull"):
                os.close(self._devnull)
        self._closed_child_pipe_fds = True

    def _line(self, timeout: float | None) -> str | None:
        """The next line from the template (None: none within ``timeout`` s, or the connection ended)."""
        assert self._sock is not None
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._buf:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            self._sock.settimeout(left)
            try:
                chunk = self._sock.recv(4096)
            except (TimeoutError, BlockingIOError):
                return None
            if not chunk:
                return None
            self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        return line.decode()

    def _status(self, timeout: float | None) -> bool:
        """Reads the child's exit status if it comes within ``timeout`` s; True once it is known."""
        if self.returncode is not None:
            return True
        if self._sock is None:
            return False
        line = self._line(timeout)
        if line is None:
            if timeout is not None and self._sock is not None:
                try:  # a connection that ended, not a timeout: the template itself is gone
                    self._sock.settimeout(0)
                    if self._sock.recv(1, socket.MSG_PEEK) == b"":
                        self.returncode = -9
                except (BlockingIOError, TimeoutError):
                    pass
            else:
                self.returncode = -9
            return self.returncode is not None
        if not line.startswith("status "):
            raise OSError(f"unexpected message from the {self._template} template: {line!r}")
        self.returncode = os.waitstatus_to_exitcode(int(line.split()[1]))
        self._sock.close()
        self._sock = None
        return True

    def _internal_poll(self, _deadstate=None, **_ignored):  # type: ignore[override]
        with self._waitpid_lock:
            self._status(timeout=0)
        return self.returncode

    def _wait(self, timeout):  # type: ignore[override]
        with self._waitpid_lock:
            if not self._status(timeout=timeout):
                raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode


def run(args: list[str], *, template: str = "torch", input: Any = None, capture_output: bool = False,
        timeout: float | None = None, check: bool = False, **kwargs: Any) -> subprocess.CompletedProcess:
    """:func:`subprocess.run` with the child forked by a template (see :class:`Popen`)."""
    if input is not None:
        kwargs["stdin"] = subprocess.PIPE
    if capture_output:
        kwargs["stdout"] = kwargs["stderr"] = subprocess.PIPE
    with Popen(args, template=template, **kwargs) as proc:
        try:
            stdout, stderr = proc.communicate(input, timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            proc.kill()
            exc.stdout, exc.stderr = proc.communicate()
            raise
        except BaseException:
            proc.kill()
            raise
        retcode = proc.poll()
        if check and retcode:
            raise subprocess.CalledProcessError(retcode, proc.args, output=stdout, stderr=stderr)
    return subprocess.CompletedProcess(proc.args, retcode, stdout, stderr)


# ---------------------------------------------------------------------------------------------
# The template (run as a script: zygote.py SOCKET PARENT_PID MODULE...)
# ---------------------------------------------------------------------------------------------

def _recv_request(conn: socket.socket) -> tuple[dict, list[int]]:
    fds = array.array("i")
    data, ancdata, _, _ = conn.recvmsg(1 << 20, socket.CMSG_LEN(16 * fds.itemsize))
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
    (n,) = struct.unpack("!I", data[:4])
    body = data[4:]
    while len(body) < n:
        more = conn.recv(n - len(body))
        if not more:
            raise EOFError("request cut short")
        body += more
    return json.loads(body), list(fds)


def _close_all_but(keep: set[int]) -> None:
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd not in keep:
            try:
                os.close(fd)
            except OSError:
                pass


def _child(req: dict, base_path: list[str]) -> None:
    """In the forked child: become the requested ``python`` process, run it, exit."""
    code = 1
    try:
        if req["start_new_session"]:
            os.setsid()
        if req["process_group"] >= 0:
            os.setpgid(0, req["process_group"])
        os.chdir(req["cwd"])
        if req["umask"] >= 0:
            os.umask(req["umask"])
        os.environ.clear()
        os.environ.update(req["env"])
        argv = list(req["argv"])
        unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
        while argv and argv[0] == "-u":
            unbuffered = True
            argv.pop(0)
        if unbuffered:
            sys.stdout.reconfigure(write_through=True)
            sys.stderr.reconfigure(write_through=True)
        if os.environ.get("PYTHONWARNINGS"):
            import warnings

            sys.warnoptions[:] = os.environ["PYTHONWARNINGS"].split(",")
            warnings._processoptions(sys.warnoptions)  # type: ignore[attr-defined]  # as python's start-up
        if os.environ.get("PYTHONFAULTHANDLER"):
            import faulthandler

            faulthandler.enable()
        extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        if argv[:1] == ["-m"]:
            first, mode, target, sys.argv = os.getcwd(), "module", argv[1], [argv[1], *argv[2:]]
        elif argv[:1] == ["-c"]:
            first, mode, target, sys.argv = "", "code", argv[1], ["-c", *argv[2:]]
        else:
            first, mode, target, sys.argv = os.path.dirname(os.path.abspath(argv[0])), "path", argv[0], argv
        sys.path[:] = [first, *[os.path.abspath(p) for p in extra], *base_path]
        import numpy as np

        np.random.seed()  # as a fresh process: numpy's global generator seeded from the OS
        if os.environ.get("OMP_NUM_THREADS", "").isdigit():
            import torch

            torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
        import runpy

        try:
            if mode == "module":
                runpy.run_module(target, run_name="__main__", alter_sys=True)
            elif mode == "code":
                import types

                main = sys.modules["__main__"] = types.ModuleType("__main__")
                exec(compile(target, "<string>", "exec"), main.__dict__)
            else:
                runpy.run_path(target, run_name="__main__")
            code = 0
        except SystemExit as e:
            if e.code is None:
                code = 0
            elif isinstance(e.code, int):
                code = e.code
            else:
                print(e.code, file=sys.stderr)
                code = 1
        except BaseException:
            kind, value, tb = sys.exc_info()
            while tb is not None and tb.tb_frame.f_code.co_filename in (__file__, runpy.__file__):
                tb = tb.tb_next  # the traceback starts in the child's own code, as python's does
            sys.excepthook(kind, value.with_traceback(tb), tb)  # type: ignore[arg-type,union-attr]
            code = 1
        import threading as _threading

        _threading._shutdown()  # type: ignore[attr-defined]  # as the interpreter's exit: non-daemon threads end first
        atexit._run_exitfuncs()
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        for f in (sys.stdout, sys.stderr):
            try:
                f.flush()
            except BaseException:
                pass
        os._exit(code & 0xFF)


def _serve(path: str, parent: int, modules: list[str]) -> None:
    import fcntl
    import importlib

    for m in modules:
        importlib.import_module(m)
    if "ckptmgr" not in modules and "ckptmgr" in sys.modules:
        raise RuntimeError("a template without ckptmgr imported it")
    base_path = sys.path[1:]  # what follows the script's directory
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    listener.settimeout(1.0)
    print("ready", flush=True)
    while True:
        while True:  # reap the monitors that ended
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
        if os.getppid() != parent:
            return
        try:
            conn, _ = listener.accept()
        except TimeoutError:
            continue
        conn.settimeout(None)
        try:
            req, fds = _recv_request(conn)
        except (OSError, EOFError, ValueError):
            conn.close()
            continue
        if os.fork() == 0:  # the monitor
            try:
                listener.close()
                child = os.fork()
                if child == 0:
                    conn.close()
                    wanted = [0, 1, 2, *req["pass_fds"]]
                    high = [fcntl.fcntl(fd, fcntl.F_DUPFD, 1024) for fd in fds]  # out of the targets' way
                    for target, fd in zip(wanted, high, strict=True):
                        os.dup2(fd, target)
                    _close_all_but(set(wanted))
                    _child(req, base_path)
                for fd in fds:
                    os.close(fd)
                conn.sendall(f"pid {child}\n".encode())
                _, status = os.waitpid(child, 0)
                try:
                    conn.sendall(f"status {status}\n".encode())
                except OSError:
                    pass
            finally:
                os._exit(0)
        for fd in fds:
            os.close(fd)
        conn.close()


if __name__ == "__main__":
    sys.stdout.flush()
    _serve(sys.argv[1], int(sys.argv[2]), sys.argv[3:])
