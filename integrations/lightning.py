"""PyTorch Lightning (``lightning.pytorch``): checkpoints through ckptmgr.

Example:
    >>> import lightning.pytorch as pl
    >>> from ckptmgr.integrations.lightning import CkptmgrCheckpointIO
    >>> trainer = pl.Trainer(plugins=[CkptmgrCheckpointIO()],  # doctest: +SKIP
    ...                      callbacks=[pl.callbacks.ModelCheckpoint(every_n_train_steps=500, save_last=True)])
    >>> trainer.fit(model, ckpt_path="last")  # resumes from the newest complete checkpoint  # doctest: +SKIP

Saving as often as a budget allows rather than every N steps: :class:`CkptmgrBudgetCheckpoint`
in place of the ModelCheckpoint (docs/LIGHTNING.md, "Saving by a budget").

For the ``pytorch_lightning`` package use :mod:`ckptmgr.integrations.pytorch_lightning`.
"""

from __future__ import annotations

try:
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.plugins.io import TorchCheckpointIO
except ImportError as exc:  # pragma: no cover - exercised where lightning is absent
    raise ImportError(f"ckptmgr.integrations.lightning needs lightning ({exc}): "
                      "pip install 'ckptmgr[lightning]'") from exc

from ._lightning_budget import BudgetCheckpointMixin
from ._lightning_io import CkptmgrIOMixin

__all__ = ["CkptmgrBudgetCheckpoint", "CkptmgrCheckpointIO"]


class CkptmgrCheckpointIO(CkptmgrIOMixin, TorchCheckpointIO):
    """A Lightning ``CheckpointIO`` that writes standard PyTorch checkpoint files without
    stalling training: the step pays for a copy into reused pinned host memory (no GPU clone);
    a background thread writes the file beside its destination, fsyncs it and renames it into
    place, so a ``.ckpt`` that exists is always complete.

    Each ``.ckpt`` is the file ``torch.save`` would write for the same dict, plus a record of
    CRC32C checksums that torch ignores: ``torch.load(path, weights_only=True)``,
    ``Model.load_from_checkpoint`` and LightningCLI read it with no ckptmgr installed, and
    ``load_checkpoint`` verifies the checksums first. Saves by a ``Checkpoint`` callback
    (ModelCheckpoint) of a running Trainer run in the background and are waited for at
    teardown; any other ``trainer.save_checkpoint(path)`` returns once ``path`` is on disk.
    Removals run after the saves before them; ModelCheckpoint never gives a save in flight's
    name to another save. Local paths, fsspec URLs (``memory://``, ...) and ``s3://`` (through
    ckptmgr's multipart uploader) are supported. The plugin pickles at any time (``ddp_spawn``).
    docs/LIGHTNING.md has the details.

    Args:
        overlap: True (the default) lets the device-to-host copy run on into the next step; it
            is waited for right before the next ``optimizer.step()`` or the next forward of a
            layer with running statistics (BatchNorm), whichever comes first. CPU tensors, and
            modules with manual optimization, are always copied before the save returns.
        async_direct_saves: also run saves that no Checkpoint callback made in the background.
        write_options: ``chunk_size`` (checksum chunk and write task), ``io_threads``,
            ``direct_io``.
        staging: ``slots`` (default 2), ``copy_threads``, ``max_host_bytes``, ``busy_timeout``.
        storage_options: fsspec options for URL paths (credentials, endpoints).
        s3_options: multipart part size, concurrency and retries for ``s3://`` paths.

    Raises:
        ConfigError: a bad option (``StagingOptions.on_busy="skip"``: Lightning's saves are
            never skipped; ``local_tier``: does not apply to ``.ckpt`` files).
    """


class CkptmgrBudgetCheckpoint(BudgetCheckpointMixin, ModelCheckpoint):
    """A ``ModelCheckpoint`` that saves as often as a budget allows instead of every N steps.

    After every optimizer step it asks ckptmgr's budget schedule (``Schedule(max_overhead=...)``,
    :class:`ckptmgr.extend.BudgetPlanner`) whether to save the step just
    done; the planner measures the step time from the spacing of those calls and what each
    save added to the next steps, and picks the interval. A save is the one ``ModelCheckpoint``
    makes for ``every_n_train_steps``: top-k by ``monitor``, ``last.ckpt`` with ``save_last``,
    through ``trainer.save_checkpoint`` and the Trainer's CheckpointIO (with
    :class:`CkptmgrCheckpointIO`: in the background, atomic), so ``ckpt_path="last"`` resumes
    as before. The first save comes after 3 measured steps; the planner starts afresh at each
    ``fit`` (a resumed fit measures again).

    Example:
        >>> trainer = pl.Trainer(plugins=[CkptmgrCheckpointIO()],  # doctest: +SKIP
        ...                      callbacks=[CkptmgrBudgetCheckpoint(max_overhead=0.01, dirpath="ckpts",
        ...                                                         save_last=True)])
        >>> trainer.fit(model, ckpt_path="last")  # doctest: +SKIP

    Args:
        max_overhead: saves add at most this share of the step time (0.01: 1%); the callback
            saves as often as that allows.
        clock: seconds, monotonic, for the measurements (tests pass a simulated clock).
        **kwargs: ``ModelCheckpoint``'s own (``dirpath``, ``filename``, ``monitor``,
            ``save_top_k``, ``save_last``, ``every_n_epochs``, ...).

    Raises:
        ConfigError: no budget, a bad budget value, or ``every_n_train_steps`` /
            ``train_time_interval`` (the budget picks the steps).
    """
