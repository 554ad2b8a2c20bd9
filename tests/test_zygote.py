"""The children that tests/zygote.py forks from a pre-imported template behave as ``python``
started afresh would, where the tests that use them look: argv, cwd, environment, stdio, exit
status, a signal's death, descriptors passed, sessions; and a template without ckptmgr has
not imported it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
import zygote


def test_a_child_gets_its_argv_cwd_environment_and_exit_status(tmp_path):
    script = tmp_path / "child.py"
    script.write_text("import os, sys\n"
                      "print(sys.argv[1:], os.getcwd(), os.environ['ZYGOTE_X'], sys.path[0], __name__)\n"
                      "print('to stderr', file=sys.stderr)\n"
                      "sys.exit(int(sys.argv[1]))\n")
    r = zygote.run([sys.executable, str(script), "7", "b"], capture_output=True, text=True, cwd=str(tmp_path),
                   env={**os.environ, "ZYGOTE_X": "y"}, timeout=60)
    assert r.returncode == 7
    assert r.stdout == f"['7', 'b'] {tmp_path} y {tmp_path} __main__\n" and r.stderr == "to stderr\n"
    r = zygote.run([sys.executable, "-c", "import sys; print(sys.argv); raise ValueError('boom')", "a"],
                   capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and r.stdout == "['-c', 'a']\n"
    assert r.stderr.startswith("Traceback") and r.stderr.rstrip().endswith("ValueError: boom")
    assert "zygote" not in r.stderr  # the traceback starts in the child's code
    r = zygote.run([sys.executable, "-m", "ckptmgr", "--version"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip()


def test_a_child_is_a_process_of_its_own_that_a_signal_ends(tmp_path):
    proc = zygote.Popen([sys.executable, "-c", "import os, time; print(os.getpid(), os.getsid(0), flush=True); "
                         "time.sleep(300)"], stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        pid, sid = map(int, proc.stdout.readline().split())
        assert pid == proc.pid != os.getpid() and sid == pid  # its own session, as start_new_session asks
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(timeout=0.2)
        assert proc.poll() is None
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=60) == -signal.SIGKILL
        assert proc.stdout.read() == ""  # its end of the pipe closed with it
    finally:
        proc.kill()
        proc.wait(timeout=60)
        proc.stdout.close()


def test_passed_descriptors_arrive_under_their_numbers_and_nothing_else_leaks(tmp_path):
    r, w = os.pipe()
    try:
        code = (f"import fcntl, os\nos.write({w}, b'through')\nopen_fds = []\n"
                "for fd in sorted(int(n) for n in os.listdir('/proc/self/fd')):\n"
                "    try:\n        fcntl.fcntl(fd, fcntl.F_GETFD)\n        open_fds.append(fd)\n"
                "    except OSError:\n        pass\n"  # listdir's own, closed by now
                "print(open_fds)\n")
        out = zygote.run([sys.executable, "-c", code], pass_fds=(w,), capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == str([0, 1, 2, w])
        assert os.read(r, 100) == b"through"
    finally:
        os.close(r)
        os.close(w)


def test_a_child_waits_for_its_threads_and_runs_its_exit_handlers():
    code = ("import atexit, threading, time\n"
            "atexit.register(lambda: print('atexit', flush=True))\n"
            "threading.Thread(target=lambda: (time.sleep(0.3), print('thread', flush=True))).start()\n")
    r = zygote.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout == "thread\natexit\n", r.stdout + r.stderr


def test_the_lightning_template_has_not_imported_ckptmgr():
    code = "import sys; print('lightning' in sys.modules, 'transformers' in sys.modules, 'ckptmgr' in sys.modules)"
    r = zygote.run([sys.executable, "-c", code], template="lightning", capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.split() == ["True", "True", "False"], r.stderr


def test_a_child_asking_for_other_import_time_settings_is_refused():
    with pytest.raises(ValueError, match="HF_HOME"):
        zygote.run([sys.executable, "-c", "pass"], env={**os.environ, "HF_HOME": "/nonexistent/elsewhere"})
