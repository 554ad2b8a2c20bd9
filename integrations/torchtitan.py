"""torchtitan: a checkpoint manager backed by ckptmgr, chosen in the job's config.

torchtitan's trainer talks to its checkpointer through ``BaseCheckpointManager``:
``load(step)`` before training, ``save(step, last_step)`` after every step,
``maybe_wait_for_staging()`` right before ``optimizers.step()``, ``maybe_wait_for_saving()``
and ``close()``. :class:`CkptmgrCheckpointManager` implements it over
:class:`ckptmgr.CheckpointManager`: a save copies the state into reused pinned host memory on
a side stream while the next step's forward and backward run (the copy is waited for in
``maybe_wait_for_staging``), and writes and commits it in the background. With FSDP2 or TP
the model and optimizer hold DTensors: each rank stores its own shards and the ranks commit
together (ckptmgr's multi-rank path); each rank's data-loader position is saved for that
rank. ``keep_latest_k`` becomes a :class:`~ckptmgr.KeepLatest` retention policy.

Select it in a config function (torchtitan's configs are Python)::

    from ckptmgr.integrations.torchtitan import CkptmgrCheckpointManager

    def my_config():
        config = llama3_debugmodel()  # any torchtitan Trainer.Config
        config.checkpoint = CkptmgrCheckpointManager.Config(enable=True, folder="checkpoint",
                                                            interval=500, keep_latest_k=3)
        return config

and run ``torchrun ... -m torchtitan.train --module my_module --config my_config``.

Not supported (a ConfigError at construction names the option): Hugging Face safetensors
export and import (``last_save_in_hf``, ``initial_load_in_hf``): use torchtitan's DCP manager
for those. ``initial_load_path`` may name a ckptmgr root or a DCP checkpoint directory.
"""

from __future__ import annotations

import logging
import os
import pickle
from dataclasses import dataclass
from typing import Any

import torch

try:
    from torchtitan.components.checkpointer.base import (
        DATALOADER,
        LR_SCHEDULER,
        MODEL,
        OPTIMIZER,
        BaseCheckpointManager,
        ModelWrapper,
    )
    from torchtitan.config import TORCH_DTYPE_MAP
    from torchtitan.tools import filesystem
except ImportError as exc:  # pragma: no cover - exercised where torchtitan is absent
    raise ImportError(f"ckptmgr.integrations.torchtitan needs torchtitan ({exc}): "
                      "pip install 'ckptmgr[torchtitan]'") from exc

from ckptmgr import CheckpointManager, ConfigError, KeepLatest, PerRank, SaveHandle, Schedule, StagingOptions

__all__ = ["CkptmgrCheckpointManager"]

log = logging.getLogger("ckptmgr")


class _LoaderState:
    """A torchtitan data loader's state as plain values (its ``state_dict`` pickles the
    loader's position into bytes; stored as bytes it would have to be unpickled from the
    checkpoint, which runs code). Saved per rank."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def state_dict(self) -> dict[str, Any]:
        sd = dict(self.loader.state_dict())
        return {k: ({"$pickled": pickle.loads(v)} if isinstance(v, bytes) else v) for k, v in sd.items()}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.loader.load_state_dict({k: (pickle.dumps(v["$pickled"]) if isinstance(v, dict) and "$pickled" in v
                                         else v) for k, v in sd.items()})


class CkptmgrCheckpointManager(BaseCheckpointManager):  # type: ignore[misc]  # torchtitan has no type information
    """torchtitan's checkpoint manager over :class:`ckptmgr.CheckpointManager`.

    Built by torchtitan from its ``Config`` (``config.checkpoint.build(...)``), with the
    arguments its trainer passes to every checkpoint manager.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(BaseCheckpointManager.Config):  # type: ignore[misc]
        """torchtitan's checkpoint options, plus ckptmgr's."""

        overlap: bool = True
        """Let the copy off the GPU run during the next forward and backward (waited for in
        maybe_wait_for_staging, before the optimizer step); False waits inside save."""

        staging_slots: int = 2
        """Checkpoints staged or being written at once (each slot holds one whole checkpoint
        of this rank's shards in pinned host memory)."""

        coordination_timeout: float = 600.0
        """Seconds the ranks may take to agree on a commit or a restore."""

        max_overhead: float | None = None
        """Checkpoint as often as this share of the step time allows (e.g. 0.01: 1%), in place of
        ``interval``: ckptmgr's ``Schedule(max_overhead=...)`` measures the step time and each
        save's cost and picks the interval (docs/SCHEDULES.md); the last step is still saved."""

    def __init__(self, config: Config, *, dataloader: Any, model_parts: list[torch.nn.Module], optimizers: Any,
                 lr_schedulers: Any, states: dict[str, Any], sd_adapter: Any, base_folder: str = "") -> None:
        self.enable = config.enable
        if not self.enable:
            return
        self.save_future: Any = None
        for bad in ("last_save_in_hf", "initial_load_in_hf", "initial_load_in_hf_quantized"):
            if getattr(config, bad):
                raise ConfigError(f"checkpoint.{bad} is not supported by CkptmgrCheckpointManager; use "
                                  "torchtitan's DCP CheckpointManager to import or export Hugging Face weights")
        self.folder = filesystem.join(base_folder, config.folder)
        self.interval = config.interval
        self.states = states
        self.states.update({MODEL: ModelWrapper(model_parts), OPTIMIZER: optimizers, DATALOADER: dataloader,
                            LR_SCHEDULER: lr_schedulers})
        self.load_only = config.load_only
        self.exclude_from_loading = list(config.exclude_from_loading)
        for key in self.exclude_from_loading:
            if key not in self.states:
                raise ConfigError(f"checkpoint.exclude_from_loading names {key!r}, which is not in the state")
        self.initial_load_path = config.initial_load_path
        self.initial_load_model_only = config.initial_load_model_only
        self.enable_first_step_checkpoint = config.enable_first_step_checkpoint
        self.last_save_model_only = config.last_save_model_only
        self.export_dtype = TORCH_DTYPE_MAP[config.export_dtype]
        self.overlap = bool(config.overlap)
        self._staging: SaveHandle | None = None
        retention = KeepLatest(config.keep_latest_k) if config.keep_latest_k > 0 else None
        schedule = Schedule(max_overhead=config.max_overhead) if config.max_overhead is not None else None
        self.manager = CheckpointManager(self.folder, retention=retention,
                                         staging=StagingOptions(slots=config.staging_slots),
                                         coordination_timeout=config.coordination_timeout, schedule=schedule)
        log.info("ckptmgr checkpointing active: %s", self.folder)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception as exc:  # never raise from __del__
            log.error("closing the checkpoint manager: %s", exc)

    # ---------------------------------------------------------------- state

    def _state(self, keys: list[str] | None = None) -> dict[str, Any]:
        """The state tree ckptmgr saves: every component under its name, the data loader's
        position per rank."""
        out: dict[str, Any] = {}
        for k, v in self.states.items():
            if keys is not None and k not in keys:
                continue
            if k == DATALOADER:
                if v is not None:
                    out[k] = PerRank(_LoaderState(v))
            else:
                out[k] = v
        return out

    def _model_only(self) -> dict[str, Any]:
        sd = self.states[MODEL].state_dict()
        return {MODEL: {k: v.to(self.export_dtype) if isinstance(v, torch.Tensor) and v.is_floating_point()
                        and v.dtype != self.export_dtype else v for k, v in sd.items()}}

    # --------------------------------------------------------------- contract

    def _should_save(self, curr_step: int, last_step: bool) -> bool:
        if self.load_only:
            return False
        if curr_step == 1 and self.enable_first_step_checkpoint:
            return True
        if self.manager.schedule.budget:  # asked every step: the spacing is the step time
            return self.manager.should_save(curr_step) or last_step
        return last_step or curr_step % self.interval == 0

    @torch.no_grad()
    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        if not self._should_save(curr_step, last_step):
            return False
        self._maybe_wait_for_staging()
        if curr_step in self.manager.steps():
            log.warning("step %d is already checkpointed in %s; not saving it again", curr_step, self.folder)
            return False
        if last_step and self.last_save_model_only:
            state, meta = self._model_only(), {"model_only": True, "keys": [MODEL]}
            block = True  # the last save: nothing to overlap with
        else:
            state = self._state()
            meta = {"model_only": False, "keys": list(state)}
            block = not self.overlap
        handle = self.manager.save(curr_step, state, metadata=meta, block=block)
        self._staging = None if block else handle
        self.save_future = handle
        if last_step:
            self._wait_for_saving()
        return True

    def _maybe_wait_for_staging(self) -> None:
        handle, self._staging = self._staging, None
        if handle is not None:
            handle.wait_staged()

    def _wait_for_saving(self) -> None:
        handle, self.save_future = self.save_future, None
        self._maybe_wait_for_staging()
        if handle is not None:
            handle.result()

    @torch.no_grad()
    def _load(self, step: int = -1) -> bool:
        steps = self.manager.steps()
        if step != -1 and step not in steps:
            raise FileNotFoundError(f"--checkpoint.load_step={step} not found in {self.folder} "
                                    f"(committed: {steps or 'none'})")
        if not steps:
            return self._initial_load()
        load_step = steps[-1] if step == -1 else step
        model_only = load_step == 0 or bool(self.manager.metadata(load_step).get("model_only"))
        keys = [MODEL] if model_only else [k for k in self.states if k not in self.exclude_from_loading]
        log.info("loading checkpoint step %d from %s%s", load_step, self.folder, " (model only)" if model_only else "")
        self._restore(self.manager, load_step, keys)
        return True

    def _restore(self, manager: CheckpointManager, step: int, keys: list[str]) -> None:
        """Restore ``keys`` of ``step`` in place; the checkpoint's other parts are read and
        dropped (a target of ``{}`` takes whatever the checkpoint holds)."""
        saved = manager.metadata(step).get("keys")
        if not isinstance(saved, list) or MODEL not in saved:
            raise FileNotFoundError(f"step {step} in {manager.root} is not a torchtitan checkpoint "
                                    "saved by CkptmgrCheckpointManager")
        state = self._state([k for k in keys if k in saved])
        if self.states.get(DATALOADER) is None and DATALOADER in saved:
            state.pop(DATALOADER, None)
        manager.restore(step, target={k: state.get(k, {}) for k in saved})

    def _initial_load(self) -> bool:
        path = self.initial_load_path
        if not path:
            log.info("no checkpoint in %s: a fresh start", self.folder)
            return False
        if filesystem.isfile(os.path.join(path, ".metadata")):  # a DCP checkpoint (torchtitan's own)
            from torch.distributed.checkpoint import state_dict_loader as dcp

            log.info("initial load of the DCP checkpoint %s%s", path, " (model only)" if self.initial_load_model_only
                     else "")
            model = self.states[MODEL]
            if self.initial_load_model_only:
                sd = model.state_dict()
                dcp.load(sd, checkpoint_id=path)
                model.load_state_dict(sd)
            else:
                sd = {k: v for k, v in self.states.items() if k not in (MODEL, *self.exclude_from_loading)}
                sd.update(model.state_dict())
                dcp.load(sd, checkpoint_id=path)
                model.load_state_dict(sd)
            return True
        with CheckpointManager(path) as src:
            steps = src.steps()
            if not steps:
                raise ValueError(f"checkpoint.initial_load_path {path} holds no committed checkpoint")
            keys = [MODEL] if self.initial_load_model_only else [
                k for k in self.states if k not in self.exclude_from_loading]
            log.info("initial load of step %d from %s", steps[-1], path)
            self._restore(src, steps[-1], keys)
        return True

    def _close(self) -> None:
        mgr = getattr(self, "manager", None)
        if mgr is None:
            return
        try:
            self._wait_for_saving()
        finally:
            mgr.close()
            self.manager = None  # type: ignore[assignment]  # closed

