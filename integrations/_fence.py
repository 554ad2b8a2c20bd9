"""A fence between a save's copy in flight and the next change to the saved tensors.

After ``save(..., block=False)`` the copy off the training tensors runs on while the next
step's forward and backward pass begin; the tensors must not change until it has landed.
In ordinary training two things change them in place: the optimizer step, and the forward
pass of normalization layers that track running statistics (BatchNorm and friends, in
training mode). While a copy is in flight, the fence holds two process-wide hooks, one
before every ``optimizer.step()`` and one before the forward of such layers; the first to
fire waits for the copy, and both are removed at once. Nothing is hooked between saves.
"""

from __future__ import annotations

import threading
from typing import Any, Protocol

import torch
from torch.nn.modules.batchnorm import _NormBase
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.optim.optimizer import register_optimizer_step_pre_hook

__all__ = ["StagingFence"]


class Staged(Protocol):
    """A save's copies in flight (a :class:`~ckptmgr.SaveHandle` is one)."""

    def staged(self) -> bool: ...

    def wait_staged(self, timeout: float | None = None) -> None: ...


class StagingFence:
    """Waits for the pending copy right before the saved tensors can change."""

    def __init__(self) -> None:
        self._handle: Staged | None = None
        self._hooks: list[Any] = []
        self._mu = threading.Lock()

    def arm(self, handle: Staged) -> None:
        """Guard ``handle``'s copy until it has landed (a previous one is waited for first)."""
        self.wait()
        if handle.staged():
            return
        with self._mu:
            self._handle = handle
            self._hooks = [
                register_optimizer_step_pre_hook(self._before_step),
                register_module_forward_pre_hook(self._before_forward),
            ]

    def _before_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.wait()

    def _before_forward(self, module: torch.nn.Module, args: Any) -> None:
        if isinstance(module, _NormBase) and module.training and module.track_running_stats:
            self.wait()

    def wait(self) -> None:
        """Block until the guarded copy has landed; then unhook. Raises the copy's error."""
        with self._mu:
            handle, self._handle = self._handle, None
            hooks, self._hooks = self._hooks, []
        for h in hooks:
            h.remove()
        if handle is not None:
            handle.wait_staged()
