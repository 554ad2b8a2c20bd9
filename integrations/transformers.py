"""Hugging Face ``transformers.Trainer``: checkpoints saved in the background, committed atomically.

The Trainer writes each checkpoint synchronously (``torch.save`` of the optimizer, scheduler
and RNG states, ``save_pretrained`` of the weights) straight into ``checkpoint-<step>/``, and
resumes with ``get_last_checkpoint``, which takes the highest ``checkpoint-<step>`` whether
it is complete or not. With :class:`CkptmgrTrainer` (or :class:`CkptmgrTrainerMixin` in
front of any Trainer subclass):

* the Trainer's own code still decides what a checkpoint holds; its big writes are captured
  and their tensors copied into reused host memory (pinned where CUDA is), and the files
  are written in the background by ckptmgr's writer threads, while training goes on. The
  copy is waited for right before the next ``optimizer.step()``;
* files go to ``.ckptmgr-<pid>-<hex>.partial/`` beside the checkpoints, which becomes
  ``checkpoint-<step>/`` by one rename once every file is written, fsynced and listed with
  its checksums in ``ckptmgr.json``. A checkpoint under its final name is complete, so the
  stock Trainer's ``resume_from_checkpoint=True`` is safe too; the files are the ones it
  writes (``model.safetensors``, ``optimizer.pt``, ``scheduler.pt``, ``rng_state.pth``,
  ``trainer_state.json``, ...) and it loads them unchanged, ``weights_only=True``;
* ``train(resume_from_checkpoint=True)`` picks the newest checkpoint whose checksums match
  and skips damaged ones;
* ``save_total_limit`` is applied after each commit (or a ckptmgr retention policy instead),
  never to the newest or the best checkpoint, nor to one still being written; a deleted
  checkpoint is renamed away before it is removed. The stock end-of-training cleanup (with
  ``save_total_limit=1`` and a best checkpoint, delete all but the best) is left out: the
  newest checkpoint stays;
* saving a step whose directory exists (training resumed from an earlier checkpoint) swaps
  the new directory in atomically: the old or the new one is under the name at any instant.

DDP and FSDP through accelerate: every rank writes its files (``rng_state_<rank>.pth``,
FSDP shards) into one temporary directory; the ranks agree that all are durable and rank 0
commits. DeepSpeed, XLA and SageMaker model parallelism keep the stock synchronous save.

Example:
    >>> from ckptmgr import KeepLatest
    >>> from ckptmgr.integrations.transformers import AsyncSaveOptions, CkptmgrTrainer
    >>> trainer = CkptmgrTrainer(model=model, args=args, train_dataset=ds,  # doctest: +SKIP
    ...                          checkpointing=AsyncSaveOptions(retention=KeepLatest(3)))
    >>> trainer.train(resume_from_checkpoint=True)  # doctest: +SKIP

Saving as often as a budget allows rather than every ``save_steps``: pass
:class:`CkptmgrBudgetCallback` (``callbacks=[CkptmgrBudgetCallback(max_overhead=0.01)]``) to
this Trainer or the stock one.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

try:
    import transformers
    from transformers.trainer_callback import ExportableState, TrainerCallback
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
    from transformers.utils.import_utils import is_sagemaker_mp_enabled, is_torch_xla_available
except ImportError as exc:  # pragma: no cover - exercised where transformers is absent
    raise ImportError(f"ckptmgr.integrations.transformers needs transformers ({exc}): "
                      "pip install 'ckptmgr[transformers]'") from exc

from ckptmgr import ConfigError, Schedule
from ckptmgr.extend import BudgetPlanner, recover

from ._capture import capturing
from ._session import (
    AsyncSaveOptions,
    Session,
    apply_retention,
    check_checkpoint,
    default_policy,
    latest_checkpoint,
)

__all__ = ["AsyncSaveOptions", "CkptmgrBudgetCallback", "CkptmgrTrainer", "CkptmgrTrainerMixin", "get_last_checkpoint"]

log = logging.getLogger("ckptmgr")
TRAINER_STATE_NAME = "trainer_state.json"
CHECKPOINT_RE = re.compile(rf"{PREFIX_CHECKPOINT_DIR}-(\d+)")


def get_last_checkpoint(folder: str, *, verify: bool = True) -> str | None:
    """The newest complete ``checkpoint-<step>`` in ``folder``: like transformers'
    ``get_last_checkpoint``, but a checkpoint ckptmgr wrote is checked against its checksums
    first, and a damaged one is skipped (with a warning) for the one before."""
    return latest_checkpoint(folder, CHECKPOINT_RE, verify=verify)


def _metrics(trainer: Any) -> dict[str, Any]:
    """What retention policies may use: the step, the epoch, the newest evaluation metrics."""
    out: dict[str, Any] = {"global_step": trainer.state.global_step}
    if trainer.state.epoch is not None:
        out["epoch"] = float(trainer.state.epoch)
    for entry in reversed(trainer.state.log_history):
        evals = {k: v for k, v in entry.items() if k.startswith("eval_") and isinstance(v, (int, float))}
        if evals:
            out.update(evals)
            break
    return out


if TYPE_CHECKING:  # the mixin goes in front of a Trainer: type-check it as one
    _TrainerBase = transformers.Trainer
else:
    _TrainerBase = object


class CkptmgrTrainerMixin(_TrainerBase):
    """Put in front of ``transformers.Trainer`` (or a subclass such as TRL's ``SFTTrainer``):
    ``class MyTrainer(CkptmgrTrainerMixin, SFTTrainer): ...``.

    Args:
        checkpointing: how checkpoints are saved (:class:`AsyncSaveOptions`); the defaults
            overlap the copy with the next step and keep what ``save_total_limit`` says.
        *args, **kwargs: the Trainer's own.
    """

    def __init__(self, *args: Any, checkpointing: AsyncSaveOptions | None = None, **kwargs: Any) -> None:
        if checkpointing is not None and not isinstance(checkpointing, AsyncSaveOptions):
            raise ConfigError(f"checkpointing must be AsyncSaveOptions, got {type(checkpointing).__name__}")
        super().__init__(*args, **kwargs)
        self._ckpt = Session(checkpointing or AsyncSaveOptions())

    # ------------------------------------------------------------------ public

    def wait_for_checkpoints(self, timeout: float | None = None) -> None:
        """Block until every checkpoint saved so far is committed; raise a failed save's error."""
        self._ckpt.wait(timeout)

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> Any:
        """``Trainer.train``; ``resume_from_checkpoint=True`` resumes from the newest complete,
        verified checkpoint. Every checkpoint is committed when it returns."""
        opts = self._ckpt.options
        if resume_from_checkpoint is True:
            found = get_last_checkpoint(str(self.args.output_dir), verify=opts.verify_on_resume)
            if found is None:
                raise ValueError(f"No valid checkpoint found in output directory ({self.args.output_dir})")
            log.info("resuming from %s", found)
            resume_from_checkpoint = found
        elif isinstance(resume_from_checkpoint, (str, os.PathLike)):
            path = os.path.abspath(os.fspath(resume_from_checkpoint))
            recover(os.path.dirname(path))  # a replacement of it that a crash interrupted
            check_checkpoint(path, verify=opts.verify_on_resume)
        ok = False
        try:
            out = super().train(resume_from_checkpoint, *args, **kwargs)
            ok = True
            return out
        finally:
            if ok:
                self._ckpt.close(opts.timeout)
            else:  # the training error is the one to see; a save's failure is logged
                try:
                    self._ckpt.close(opts.timeout)
                except Exception as exc:
                    log.error("while stopping after a training error: %s", exc)

    # -------------------------------------------------------- Trainer overrides

    def _ckptmgr_stock(self) -> bool:
        """Setups whose checkpoints only their own engine can write."""
        return bool(getattr(self, "is_deepspeed_enabled", False) or getattr(self, "is_fsdp_xla_v1_enabled", False)
                    or is_torch_xla_available() or is_sagemaker_mp_enabled())

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        if self._ckptmgr_stock():
            self._ckpt.wait(self._ckpt.options.timeout)
            super()._save_checkpoint(model, trial)
            return
        state, args = self.state, self.args
        step = state.global_step
        if self.hp_search_backend is None and trial is None:
            self.store_flos()
        run_dir = self._get_output_dir(trial=trial)
        final = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{step}")
        writer = self._ckpt.start()
        fs = writer.begin(run_dir, *self._ckpt.token(step))
        tmp = fs.directory
        self._ckpt.fence.wait()  # the previous save's copies have landed before this one starts
        try:
            with capturing(fs):
                self.save_model(tmp, _internal_call=True)
                if args.save_strategy in ("steps", "epoch", "best") and state.best_global_step:
                    best = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.best_global_step}")
                    if state.best_global_step == step or os.path.exists(best) or best in writer.in_flight():
                        state.best_model_checkpoint = best
                if not args.save_only_model:
                    self._save_optimizer_and_scheduler(tmp)
                    self._save_scaler(tmp)
                    self._save_rng_state(tmp)
            if args.should_save:
                exportable = [*self.callback_handler.callbacks, self.control]
                for cb in [c for c in exportable if isinstance(c, ExportableState)]:
                    name = cb.__class__.__name__
                    saved: Any = state.stateful_callbacks  # a dict by name (annotated otherwise upstream)
                    if isinstance(saved[name], list):
                        saved[name].append(cb.state())
                    else:
                        saved[name] = cb.state()
                state.save_to_json(os.path.join(tmp, TRAINER_STATE_NAME))
        except BaseException:
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
            raise
        best_step = None
        if state.best_model_checkpoint:
            m = CHECKPOINT_RE.fullmatch(os.path.basename(state.best_model_checkpoint))
            best_step = int(m.group(1)) if m else None
        policy = self._ckpt.options.retention or default_policy(args.save_total_limit)
        after = functools.partial(self._ckptmgr_retention, run_dir, policy, best_step) if args.should_save else None
        pending = writer.commit(fs, final, step=step, metadata=_metrics(self), after=after,
                                timeout=self._ckpt.options.timeout)
        self._ckpt.guard(pending)
        if args.push_to_hub:  # the hub upload reads the files: only once they are committed
            pending.result(self._ckpt.options.timeout)
            self._push_from_checkpoint(final)

    def _ckptmgr_retention(self, run_dir: str, policy: Any, best_step: int | None) -> None:
        protect = {best_step} if best_step is not None else set()
        writer = self._ckpt.writer
        if writer is not None:
            protect |= {s for p, s in writer.in_flight().items() if os.path.dirname(p) == run_dir}
        apply_retention(run_dir, CHECKPOINT_RE, policy, protect)

    def _finalize_training(self, *args: Any, **kwargs: Any) -> Any:
        # With save_total_limit=1 and a best checkpoint, the stock end of training deletes
        # every checkpoint but the best with shutil.rmtree under its final name: the newest
        # too, and a kill mid-delete leaves it torn where discovery finds it. Retention has
        # run after each commit already, through delete_dir (renamed away first) and never
        # on the newest nor the best: the stock cleanup is left out (its condition is
        # save_total_limit == 1, so the limit reads None while the stock code runs).
        args_ = self.args
        limit = args_.save_total_limit
        skip = limit == 1 and not self._ckptmgr_stock()
        if skip:
            args_.save_total_limit = None
        try:
            return super()._finalize_training(*args, **kwargs)  # type: ignore[no-untyped-call]
        finally:
            if skip:
                args_.save_total_limit = limit

    def _load_best_model(self) -> None:
        self._ckpt.wait(self._ckpt.options.timeout)  # the best checkpoint may still be in flight
        super()._load_best_model()


class CkptmgrTrainer(CkptmgrTrainerMixin, transformers.Trainer):
    """``transformers.Trainer`` with checkpoints saved by ckptmgr (see the module docstring).

    Args:
        checkpointing: :class:`AsyncSaveOptions` (keyword only); everything else as
            ``transformers.Trainer``.
    """


class CkptmgrBudgetCallback(TrainerCallback):
    """Saves as often as a budget allows: sets ``control.should_save`` from ckptmgr's budget
    schedule (``Schedule(max_overhead=...)``, :class:`ckptmgr.extend.BudgetPlanner`) instead of
    ``save_steps``.

    At the end of every step it tells the planner the step was reached (the spacing of those
    calls is the step time it measures) and asks whether to save it; after each save it tells
    the planner, which charges what the next steps took beyond the step time to the save and
    picks the interval: a save every ``ceil(save cost / (max_overhead x step time))`` steps,
    the most often that allows. The save is the Trainer's own (``checkpoint-<step>``, with
    ``CkptmgrTrainer`` in the background and committed atomically), and everything else about
    ``save_strategy="steps"`` is unchanged: retention (``save_total_limit``), the save at the
    last step, ``resume_from_checkpoint``. The first save comes after 3 measured steps; the
    planner starts afresh at each ``train()`` (a resumed run measures again).

    Example:
        >>> args = TrainingArguments("run1", save_strategy="steps")  # doctest: +SKIP
        >>> trainer = CkptmgrTrainer(model=model, args=args, train_dataset=ds,  # doctest: +SKIP
        ...                          callbacks=[CkptmgrBudgetCallback(max_overhead=0.01)])
        >>> trainer.train(resume_from_checkpoint=True)  # doctest: +SKIP

    Args:
        max_overhead: saves add at most this share of the step time (0.01: 1%).
        clock: seconds, monotonic, for the measurements (tests pass a simulated clock).

    Raises:
        ConfigError: a bad budget or clock; at the Trainer's start, a ``save_strategy`` other
            than ``"steps"`` (the budget picks steps), or several processes (every rank must
            save the same steps: not supported yet).
    """

    def __init__(self, *, max_overhead: float, clock: Callable[[], float] = time.perf_counter) -> None:
        if not callable(clock):
            raise ConfigError(f"clock must be a callable returning seconds, got {clock!r}")
        self.schedule = Schedule(max_overhead=max_overhead)  # refuses bad values
        if not self.schedule.budget:
            raise ConfigError("CkptmgrBudgetCallback needs max_overhead (e.g. 0.01: saves add at most 1% to the step "
                              "time)")
        self.clock = clock
        # both belong to the training thread (the planner has its own lock); made per train()
        self._planner: BudgetPlanner | None = None

    @staticmethod
    def _check(args: Any) -> None:
        if args.save_strategy != "steps":
            raise ConfigError(f"CkptmgrBudgetCallback picks the steps to save: it needs save_strategy=\"steps\", "
                              f"got {str(args.save_strategy)!r}")
        if args.world_size > 1:
            raise ConfigError(f"CkptmgrBudgetCallback runs in one process for now (world size {args.world_size}): "
                              "each rank would measure its own steps and pick its own saves")

    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._check(args)

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._check(args)
        self._planner = BudgetPlanner(self.schedule, clock=self.clock, tiered=False)
        log.info("checkpoint schedule: saves picked by Schedule(max_overhead=%g); save_steps=%s does not apply",
                 self.schedule.max_overhead, args.save_steps)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._planner is None:
            return
        due = self._planner.should_save(state.global_step)
        last = state.global_step >= state.max_steps  # the steps strategy's save at the end stays
        control.should_save = due or (last and bool(control.should_save))

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._planner is not None:
            self._planner.saved_once(state.global_step)

    def stats(self) -> dict[str, float]:
        """The intervals planned and achieved so far (keys present once measured):
        ``interval_steps`` (planned), ``interval_s`` (achieved: mean seconds between saves),
        ``overhead`` (achieved: the share of the loop's time saves added), ``step_s``,
        ``save_cost_s``. Empty before the first ``train()``."""
        return {} if self._planner is None else self._planner.stats()
