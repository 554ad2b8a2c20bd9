"""Holding a real subprocess at a chosen file-system operation and SIGKILLing it there.

Child side (:func:`install`, called by the test's child script when ``KILL_POINTS`` is set):
a ``sys.addaudithook`` hook reports every open, rename, removal and ``shutil.rmtree`` whose
path lies under a watched root, as one JSON line on a pipe, *before* the operation runs, and
blocks until the parent answers ``g`` (go on). Removals that ``shutil.rmtree`` makes relative
to a directory descriptor are resolved through ``/proc/self/fd``. The product has no test
hook: the audit events are Python's own. (ctypes calls such as ``renameat2`` raise no audit
event; the opens that fsync the directories on either side of one serve as its kill points.)

Parent side (:func:`run`): starts the child with the pipes, answers each event, and SIGKILLs
the child at the event its ``kill`` predicate picks; the child is then stopped *at* that
operation, which has not run yet. Every wait has a timeout; no sleeps.
"""

from __future__ import annotations

import json
import os
import re
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

ENV_NAME = "KILL_POINTS"
_WATCHED = ("open", "os.rename", "os.remove", "os.rmdir", "shutil.rmtree")


# ------------------------------------------------------------------------------ child side


def install() -> None:
    """Report and hold the watched operations (no-op unless ``KILL_POINTS`` is set)."""
    spec = os.environ.get(ENV_NAME)
    if not spec:
        return
    wfd_s, rfd_s, root = spec.split(",", 2)
    wfd, rfd, root = int(wfd_s), int(rfd_s), os.path.abspath(root)
    lock = threading.Lock()
    local = threading.local()

    def under(p: object, dir_fd: object) -> str | None:
        if not isinstance(p, (str, bytes)):
            return None
        s = os.fsdecode(p)
        if not os.path.isabs(s) and isinstance(dir_fd, int):
            s = os.path.join(os.readlink(f"/proc/self/fd/{dir_fd}"), s)
        s = os.path.abspath(s)
        return s if s == root or s.startswith(root + os.sep) else None

    def hook(event: str, args: tuple[object, ...]) -> None:
        if event not in _WATCHED or getattr(local, "busy", False):
            return
        local.busy = True
        try:
            mode: object = None
            if event == "os.rename":
                paths = [under(args[0], args[2]), under(args[1], args[3])]
            elif event == "open":  # (path, mode, flags): mode is None for os.open
                paths = [under(args[0], None)]
                mode = args[1] if isinstance(args[1], str) else args[2]
            else:
                paths = [under(args[0], args[1] if len(args) > 1 else None)]
            rel = [os.path.relpath(p, root) for p in paths if p is not None]
            if not rel:
                return
            with lock:
                os.write(wfd, (json.dumps([event, rel, mode]) + "\n").encode())
                ready, _, _ = select.select([rfd], [], [], 120.0)
                if not ready or os.read(rfd, 1) != b"g":
                    os._exit(70)
        finally:
            local.busy = False

    sys.addaudithook(hook)


# ----------------------------------------------------------------------------- parent side


_TEMP = re.compile(r"\.ckptmgr-\d+-[0-9a-f]+")
Event = tuple[str, list[str], object]  # (audit event, paths under the root, open's mode)


def key(event: Event) -> tuple[object, ...]:
    """An event with ckptmgr's temporary names (which hold a pid and a random part) blanked:
    the same operation of two runs has the same key."""
    name, paths, mode = event
    return (name, tuple(_TEMP.sub(".ckptmgr-*", p) for p in paths), mode)


def same_as(events: list[Event], index: int) -> Callable[[int, list[Event]], bool]:
    """A ``kill`` predicate for :func:`run`: the operation that was ``events[index]`` in
    another run of the same child (the same key, the same occurrence of it), wherever other
    threads' operations put it."""
    want = key(events[index])
    nth = sum(1 for e in events[: index + 1] if key(e) == want)

    def kill(i: int, seen: list[Event]) -> bool:
        return key(seen[i]) == want and sum(1 for e in seen if key(e) == want) == nth

    return kill


@dataclass
class Outcome:
    events: list[Event] = field(default_factory=list)
    killed_at: int | None = None  # index into events; None when the child ran to its end
    returncode: int | None = None
    stderr: str = ""


def run(cmd: list[str], root: str, *, kill: Callable[[int, list[Event]], bool],
        env: dict[str, str] | None = None, timeout: float = 240.0, log_path: str | None = None,
        template: str | None = None) -> Outcome:
    """Run ``cmd`` (a child that calls :func:`install`) watching ``root``; SIGKILL it at the
    first event for which ``kill(index, events_so_far)`` is true (the event is the last).
    With ``template`` (``cmd`` a ``sys.executable`` command), the child is forked from that
    pre-imported template (tests/zygote.py) instead of started afresh."""
    ev_r, ev_w = os.pipe()
    go_r, go_w = os.pipe()
    log_path = log_path or os.path.join(os.path.dirname(os.path.abspath(root)), "child.log")
    out = Outcome()
    os.makedirs(os.path.dirname(log_path), exist_ok=True)
    child_env = {**(env if env is not None else os.environ), ENV_NAME: f"{ev_w},{go_r},{os.path.abspath(root)}"}
    with open(log_path, "wb") as log:
        if template is None:
            proc = subprocess.Popen(cmd, env=child_env, pass_fds=(ev_w, go_r), stdout=log, stderr=subprocess.STDOUT)
        else:
            import zygote  # here: the children import this module too

            proc = zygote.Popen(cmd, template=template, env=child_env, pass_fds=(ev_w, go_r), stdout=log,
                                stderr=subprocess.STDOUT)
    os.close(ev_w)
    os.close(go_r)
    deadline = time.monotonic() + timeout
    buf = b""
    try:
        with os.fdopen(ev_r, "rb", buffering=0) as events, os.fdopen(go_w, "wb", buffering=0) as go:
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"the child ran past {timeout} s; events so far: {out.events[-5:]}")
                ready, _, _ = select.select([events], [], [], left)
                if not ready:
                    continue
                chunk = events.read(65536)
                if not chunk:  # the child closed the pipe: it has ended
                    break
                buf += chunk
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    name, paths, mode = json.loads(line)
                    out.events.append((name, paths, mode))
                    if out.killed_at is None and kill(len(out.events) - 1, out.events):
                        os.kill(proc.pid, signal.SIGKILL)
                        out.killed_at = len(out.events) - 1
                    elif out.killed_at is None:
                        go.write(b"g")
                if out.killed_at is not None:
                    break
    finally:
        try:
            out.returncode = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            out.returncode = proc.wait(timeout=60)
        with open(log_path, "rb") as f:
            out.stderr = f.read()[-4000:].decode(errors="replace")
    return out
