"""Runs Lightning's own checkpoint tests with another CheckpointIO as the default one.

Not part of Lightning's suite (see ../README.md): ckptmgr's conftest line imports this
module. Every Trainer whose strategy gets no CheckpointIO of its own creates the default one
in one place, the getter of ``Strategy.checkpoint_io``; this module patches that getter for
the whole session. Which plugin it creates is chosen by the environment variable
``CKPTMGR_LIGHTNING_SUITE_IO``:

- ``ckptmgr`` (the default): ``ckptmgr.integrations.lightning.CkptmgrCheckpointIO()``;
- ``torch``: Lightning's stock ``TorchCheckpointIO()`` (the getter left as it is);
- ``async``: ``AsyncCheckpointIO(TorchCheckpointIO())``, Lightning's own asynchronous plugin.

It also builds the ``local`` legacy checkpoint that ``checkpointing/test_legacy_checkpoints.py``
reads (Lightning's CI generates it with ``legacy/generate_checkpoints.sh``), in a subprocess
whose Trainer gets the same default CheckpointIO, so the file under test was written by the
plugin under test.
"""

from __future__ import annotations

import glob
import os
import subprocess
import sys
from pathlib import Path

import pytest

MODE = os.environ.get("CKPTMGR_LIGHTNING_SUITE_IO", "ckptmgr")
# Tests that fail with ckptmgr's plugin, and why (docs/LIGHTNING.md has the details); tests/conftest.py
# marks them xfail(strict=True), so one that starts passing is reported.
KNOWN_FAILURES = {
    "checkpointing/test_model_checkpoint.py::test_none_monitor_not_alternating":
        "lists the directory while the previous epoch's save is still being written (any asynchronous "
        "save fails it; AsyncCheckpointIO too)",
    "checkpointing/test_trainer_checkpoint.py::test_trainer_save_checkpoint_storage_options":
        "asserts that TorchCheckpointIO.save_checkpoint itself is called (AsyncCheckpointIO fails it too)",
}
_SUITE = Path(__file__).resolve().parent.parent  # tests/lightning_suite


def _make_default():
    if MODE == "ckptmgr":
        from ckptmgr.integrations.lightning import CkptmgrCheckpointIO

        return CkptmgrCheckpointIO()
    from lightning.pytorch.plugins.io import AsyncCheckpointIO, TorchCheckpointIO

    if MODE == "async":
        return AsyncCheckpointIO(TorchCheckpointIO())
    if MODE == "torch":
        return TorchCheckpointIO()
    raise ValueError(f"CKPTMGR_LIGHTNING_SUITE_IO must be ckptmgr, torch or async, got {MODE!r}")


def install() -> None:
    """Patch ``Strategy.checkpoint_io`` so that the default CheckpointIO is ``MODE``'s."""
    if MODE == "torch":
        return
    from lightning.pytorch.plugins.io.wrapper import _WrappingCheckpointIO
    from lightning.pytorch.strategies.strategy import Strategy

    def checkpoint_io(self):
        if self._checkpoint_io is None:
            self._checkpoint_io = _make_default()
        elif isinstance(self._checkpoint_io, _WrappingCheckpointIO):
            inner = _make_default()
            if isinstance(inner, _WrappingCheckpointIO):  # async: wrap the stock plugin, as Lightning does
                inner = inner.checkpoint_io
            self._checkpoint_io.checkpoint_io = inner
        return self._checkpoint_io

    Strategy.checkpoint_io = property(checkpoint_io, Strategy.checkpoint_io.fset)


install()


@pytest.fixture(scope="session", autouse=True)
def _local_legacy_checkpoint():
    """``legacy/checkpoints/local/*.ckpt``, written once per session by a Trainer with the
    default CheckpointIO under test (removed again at the end of the session)."""
    out = _SUITE / "legacy" / "checkpoints" / "local"
    if glob.glob(str(out / "*.ckpt")):
        yield
        return
    code = (
        "import sys, runpy; sys.argv = ['simple_classif_training.py', 'local'];"
        "import tests_pytorch._ckptmgr_harness;"
        f"runpy.run_path({str(_SUITE / 'legacy' / 'simple_classif_training.py')!r}, run_name='__main__')"
    )
    # one intra-op thread: the model is tiny, and CI's two cores are shared with the test process
    env = {**os.environ, "PYTHONPATH": str(_SUITE), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=str(_SUITE), env=env, capture_output=True, text=True,
                          timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"generating the local legacy checkpoint failed:\n{proc.stdout}\n{proc.stderr}")
    for ckpt in glob.glob(str(out / "lightning_logs" / "version_0" / "checkpoints" / "*.ckpt")):
        os.replace(ckpt, out / os.path.basename(ckpt))
    import shutil

    shutil.rmtree(out / "lightning_logs", ignore_errors=True)
    yield
    shutil.rmtree(_SUITE / "legacy" / "checkpoints", ignore_errors=True)
