"""Hugging Face ``accelerate``: ``Accelerator.save_state``/``load_state`` through ckptmgr.

accelerate has no pluggable writer: ``save_state`` writes its fixed files
(``model.safetensors``, ``optimizer.bin``, ``scheduler.bin``, ``sampler.bin``,
``random_states_<rank>.pkl``, ``custom_checkpoint_<i>.pkl``, ...) synchronously into the
directory, and with automatic checkpoint naming ``load_state()`` picks the highest-numbered
folder, complete or not. :class:`AsyncStateSaver` runs accelerate's own ``save_state`` with its
big writes captured (see :mod:`ckptmgr.integrations.transformers` for how): the tensors are
copied into reused host memory, the files written in the background, and the directory
appears under its name only once complete, with the checksums of every file in
``ckptmgr.json``; saving into an existing directory exchanges the two, never leaving the name
empty. With automatic naming, temporaries live beside ``checkpoints/``, not in it, so that
accelerate's own ``load_state()`` (which takes the entry with the highest first number in its
name) never sees them. Loading goes through accelerate's ``load_state`` after the directory has
been verified; the hook accelerate does have, ``register_load_state_pre_hook``, verifies
directories that ``accelerator.load_state`` is called on directly.

Example:
    >>> from accelerate import Accelerator
    >>> from ckptmgr.integrations.accelerate import AsyncStateSaver
    >>> accelerator = Accelerator(project_dir="run", project_config=...)  # doctest: +SKIP
    >>> saver = AsyncStateSaver(accelerator)  # doctest: +SKIP
    >>> saver.load_state()  # the newest complete checkpoint, if any  # doctest: +SKIP
    >>> for step, batch in enumerate(loader):  # doctest: +SKIP
    ...     ...
    ...     if step % 500 == 0:
    ...         saver.save_state()  # returns once the copies are enqueued
    >>> saver.close()  # every save committed  # doctest: +SKIP
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from typing import Any

try:
    import accelerate
except ImportError as exc:  # pragma: no cover - exercised where accelerate is absent
    raise ImportError(f"ckptmgr.integrations.accelerate needs accelerate ({exc}): "
                      "pip install 'ckptmgr[accelerate]'") from exc

from ckptmgr import ConfigError, StepNotFoundError
from ckptmgr.extend import recover, scratch_dir

from ._capture import capturing
from ._session import (
    AsyncSaveOptions,
    Pending,
    Session,
    apply_retention,
    check_checkpoint,
    default_policy,
    latest_checkpoint,
)

__all__ = ["AsyncSaveOptions", "AsyncStateSaver"]

log = logging.getLogger("ckptmgr")
AUTO_RE = re.compile(r"checkpoint_(\d+)")  # accelerate's automatic checkpoint naming


class AsyncStateSaver:
    """Saves and loads an ``Accelerator``'s state through ckptmgr.

    Args:
        accelerator: the job's ``accelerate.Accelerator`` (create the saver on every process).
        checkpointing: :class:`AsyncSaveOptions`; ``retention=None`` keeps what
            ``ProjectConfiguration.total_limit`` says.
        verify_hook: also verify directories passed to ``accelerator.load_state`` directly
            (through its ``register_load_state_pre_hook``).
    """

    def __init__(self, accelerator: Any, *, checkpointing: AsyncSaveOptions | None = None,
                 verify_hook: bool = True) -> None:
        if not isinstance(accelerator, accelerate.Accelerator):
            raise ConfigError(f"AsyncStateSaver needs an accelerate.Accelerator, got {type(accelerator).__name__}")
        if checkpointing is not None and not isinstance(checkpointing, AsyncSaveOptions):
            raise ConfigError(f"checkpointing must be AsyncSaveOptions, got {type(checkpointing).__name__}")
        self.accelerator = accelerator
        self._ckpt = Session(checkpointing or AsyncSaveOptions())
        self._hook = None
        if verify_hook:
            verify = self._ckpt.options.verify_on_resume
            self._hook = accelerator.register_load_state_pre_hook(
                lambda models, input_dir: check_checkpoint(os.fspath(input_dir), verify=verify))

    @property
    def _auto(self) -> bool:
        return bool(self.accelerator.project_configuration.automatic_checkpoint_naming)

    def _auto_dir(self) -> str:
        return os.path.join(self.accelerator.project_dir, "checkpoints")

    def _scratch(self, parent: str) -> str:
        """Where temporaries go: accelerate's automatic naming sorts every entry of
        ``checkpoints/`` by the first number in its name (a temporary's pid would win), so
        they go beside that directory, not in it."""
        auto = self._auto and os.path.abspath(parent) == os.path.abspath(self._auto_dir())
        return scratch_dir(parent, outside=auto)

    def save_state(self, output_dir: str | os.PathLike[str] | None = None, safe_serialization: bool = True,
                   **save_model_func_kwargs: Any) -> Pending[str]:
        """``Accelerator.save_state``, with the files written in the background.

        Returns once the copies are enqueued (with ``AsyncSaveOptions(overlap=True)``, they
        are waited for before the next ``optimizer.step()``). The returned handle's
        ``result()`` gives the committed directory.

        Raises:
            ConfigError: no ``output_dir`` and no automatic checkpoint naming.
            SaveError: an earlier background save failed.
        """
        acc = self.accelerator
        if output_dir is None and not self._auto:
            raise ConfigError("save_state needs an output_dir unless automatic checkpoint naming is on")
        iteration = acc.save_iteration
        if self._auto:  # accelerate's own naming and total_limit are done here, after the commit
            final = os.path.join(self._auto_dir(), f"checkpoint_{iteration}")
            policy = self._ckpt.options.retention or default_policy(acc.project_configuration.total_limit)
            pattern: re.Pattern[str] | None = AUTO_RE
        else:
            assert output_dir is not None
            final = os.path.abspath(os.fspath(output_dir))
            policy, pattern = self._ckpt.options.retention, None
        parent = os.path.dirname(final)
        scratch = self._scratch(parent)
        writer = self._ckpt.start()
        fs = writer.begin(parent, *self._ckpt.token(iteration), scratch=scratch)
        self._ckpt.fence.wait()
        cfg = acc.project_configuration
        auto = cfg.automatic_checkpoint_naming
        try:
            cfg.automatic_checkpoint_naming = False
            with capturing(fs):
                acc.save_state(fs.directory, safe_serialization=safe_serialization, **save_model_func_kwargs)
        except BaseException:
            shutil.rmtree(fs.directory, ignore_errors=True)
            raise
        finally:
            cfg.automatic_checkpoint_naming = auto
        after = None
        if pattern is not None and policy is not None and acc.is_main_process:
            def after() -> None:
                protect = {s for p, s in writer.in_flight().items() if os.path.dirname(p) == parent}
                apply_retention(parent, pattern, policy, protect, scratch)
        pending = writer.commit(fs, final, step=iteration, metadata={"iteration": iteration, "step": acc.step},
                                after=after, timeout=self._ckpt.options.timeout)
        self._ckpt.guard(pending)
        return pending

    def latest(self) -> str | None:
        """The newest complete (and verified) automatically named checkpoint, or None."""
        parent = self._auto_dir()
        return latest_checkpoint(parent, AUTO_RE, verify=self._ckpt.options.verify_on_resume,
                                 scratch=self._scratch(parent))

    def load_state(self, input_dir: str | os.PathLike[str] | None = None, **kwargs: Any) -> str:
        """``Accelerator.load_state`` of ``input_dir``, or (automatic naming) of the newest
        complete checkpoint; the directory is verified first. Returns the directory loaded.

        Raises:
            StepNotFoundError: nothing to load.
            CheckpointCorruptError: ``input_dir`` fails its checksums.
        """
        self._ckpt.wait(self._ckpt.options.timeout)
        if input_dir is None:
            if not self._auto:
                raise ConfigError("load_state needs an input_dir unless automatic checkpoint naming is on")
            found = self.latest()
            if found is None:
                raise StepNotFoundError(f"no complete checkpoint in {self._auto_dir()}")
            path = found
            m = AUTO_RE.fullmatch(os.path.basename(found))
            assert m is not None
            self.accelerator.project_configuration.iteration = int(m.group(1)) + 1
        else:
            path = os.path.abspath(os.fspath(input_dir))
            recover(self._scratch(os.path.dirname(path)))  # a replacement of it a crash interrupted
        if self._hook is None:
            check_checkpoint(path, verify=self._ckpt.options.verify_on_resume)
        self.accelerator.load_state(path, **kwargs)
        return path

    def wait(self, timeout: float | None = None) -> None:
        """Block until every save so far is committed; raise a failed save's error."""
        self._ckpt.wait(timeout)

    def close(self, timeout: float | None = None) -> None:
        """Wait for every save, stop the threads, free the staging memory, remove the hook."""
        try:
            self._ckpt.close(timeout if timeout is not None else self._ckpt.options.timeout)
        finally:
            if self._hook is not None:
                self._hook.remove()
                self._hook = None

    def __enter__(self) -> AsyncStateSaver:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
