"""The body of the Lightning budget checkpoint callbacks, shared by the ``lightning.pytorch`` and
the ``pytorch_lightning`` classes (each a ``ModelCheckpoint`` of its own namespace).

Lightning decides when to save in its ``ModelCheckpoint`` callback (``every_n_train_steps``,
``train_time_interval``, ``every_n_epochs``). The budget callback is that callback with the
"when" asked of a :class:`ckptmgr.extend.BudgetPlanner` instead: after every optimizer step it
tells the planner the step was reached (the spacing of those calls is the step time it
measures), and when the planner says so it saves exactly as ``ModelCheckpoint`` does for
``every_n_train_steps`` (top-k, ``last.ckpt``, through ``trainer.save_checkpoint`` and the
Trainer's CheckpointIO). Every save the callback makes is reported back to the planner, which
charges what the next steps took beyond the step time to it.

There is no :class:`~ckptmgr.CheckpointManager` here to ask: the files are the Trainer's, written
by its CheckpointIO (ckptmgr's plugin or any other), so the callback owns a planner of its own,
made at the start of each fit, and nothing else. Every ``.ckpt`` is a durable file: the
planner runs without a local tier.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from ckptmgr import ConfigError, Schedule
from ckptmgr.extend import BudgetPlanner

__all__ = ["BudgetCheckpointMixin"]

log = logging.getLogger("ckptmgr")

_WHEN = ("every_n_train_steps", "train_time_interval")  # the step triggers the budget replaces


class BudgetCheckpointMixin:
    """See :class:`ckptmgr.integrations.lightning.CkptmgrBudgetCheckpoint`."""

    def __init__(self, *, max_overhead: float | None = None, clock: Callable[[], float] = time.perf_counter,
                 **kwargs: Any) -> None:
        given = [name for name in _WHEN if kwargs.get(name) not in (None, 0)]
        if given:
            raise ConfigError(f"CkptmgrBudgetCheckpoint picks the steps to save from its budget; "
                              f"{' and '.join(given)} would pick them too: use a plain ModelCheckpoint for that")
        if max_overhead is None:
            raise ConfigError("CkptmgrBudgetCheckpoint needs a budget: max_overhead (e.g. 0.01: saves add at most "
                              "1% to the step time)")
        if not callable(clock):
            raise ConfigError(f"clock must be a callable returning seconds, got {clock!r}")
        self.schedule = Schedule(max_overhead=max_overhead)  # refuses bad values
        self.clock = clock
        kwargs.setdefault("every_n_epochs", 0)  # no saves but the budget's unless asked
        kwargs["every_n_train_steps"], kwargs["train_time_interval"] = 0, None
        super().__init__(**kwargs)
        # the planner belongs to the training thread (it has its own lock); made per fit
        self._planner: BudgetPlanner | None = None
        self._asked_step = 0  # the last step the planner was asked about (none before the first step)

    def __getstate__(self) -> dict[str, Any]:  # ddp_spawn, deepcopy: a fresh planner at the next fit
        state = dict(self.__dict__)
        state["_planner"] = None
        return state

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        super().setup(trainer, pl_module, stage)  # type: ignore[misc]
        if stage == "fit":
            self._planner = BudgetPlanner(self.schedule, clock=self.clock, tiered=False)
            self._asked_step = 0

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        """Ask the budget whether to save the step just done; save as ``every_n_train_steps`` would."""
        planner, step = self._planner, trainer.global_step
        if planner is None or step == self._asked_step:
            return  # (several batches to one optimizer step: the planner measures whole steps)
        self._asked_step = step
        # every rank measures its own clock: rank 0's answer is the one (as ModelCheckpoint's
        # train_time_interval does), so that all ranks save the same steps
        due = bool(trainer.strategy.broadcast(planner.should_save(step)))
        if not due:
            return
        candidates = self._monitor_candidates(trainer)  # type: ignore[attr-defined]
        if self.monitor is not None and self.monitor not in candidates:  # type: ignore[attr-defined]
            self._defer_save_until_validation = True  # as ModelCheckpoint: saved when validation has it
            return
        if self._should_skip_saving_checkpoint(trainer):  # type: ignore[attr-defined]
            return
        self._save_topk_checkpoint(trainer, candidates)  # type: ignore[attr-defined]
        self._save_last_checkpoint(trainer, candidates)  # type: ignore[attr-defined]

    def _save_checkpoint(self, trainer: Any, filepath: str) -> None:
        super()._save_checkpoint(trainer, filepath)  # type: ignore[misc]
        if self._planner is not None:  # (top-k and last.ckpt of one step: one save)
            self._planner.saved_once(trainer.global_step)

    def stats(self) -> dict[str, float]:
        """The intervals planned and achieved so far in this fit (keys present once measured):
        ``interval_steps`` (planned), ``interval_s`` (achieved: mean seconds between saves),
        ``overhead`` (achieved: the share of the loop's time saves added), ``step_s``,
        ``save_cost_s``. Empty before the first fit."""
        return {} if self._planner is None else self._planner.stats()

