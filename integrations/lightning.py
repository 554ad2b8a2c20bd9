"""PyTorch Lightning (``lightning.pytorch``): checkpoints through ckptmgr.

Example:
    >>> import lightning.pytorch as pl
    >>> from ckptmgr.integrations.lightning import CkptmgrCheckpointIO
    >>> trainer = pl.Trainer(plugins=[CkptmgrCheckpointIO()],  # doctest: +SKIP
    ...                      callbacks=[pl.callbacks.ModelCheckpoint(every_n_train_steps=500, save_last=True)])
    >>> trainer.fit(model, ckpt_path="last")  # resumes from the newest complete checkpoint  # doctest: +SKIP

For the ``pytorch_lightning`` package use :mod:`ckptmgr.integrations.pytorch_lightning`.
"""

from __future__ import annotations

try:
    from lightning.pytorch.plugins.io import TorchCheckpointIO
except ImportError as exc:  # pragma: no cover - exercised where lightning is absent
    raise ImportError(f"ckptmgr.integrations.lightning needs lightning ({exc}): "
                      "pip install 'ckptmgr[lightning]'") from exc

from ._lightning_io import CkptmgrIOMixin

__all__ = ["CkptmgrCheckpointIO"]


class CkptmgrCheckpointIO(CkptmgrIOMixin, TorchCheckpointIO):
    """A Lightning ``CheckpointIO`` that saves through ckptmgr: the training step pays for a
    copy into reused pinned host memory (no GPU clone), the write and the commit run in the
    background, and a checkpoint path appears only once its checkpoint is complete.

    Each directory Lightning writes to gets a :class:`~ckptmgr.CheckpointManager` rooted in
    ``<dir>/.ckptmgr``; the ``.ckpt`` paths are small pointer files naming a committed step.
    ModelCheckpoint decides what to keep (``save_top_k``, ``save_last``): a removed path's
    step is deleted after the saves queued before the removal have committed.
    ``trainer.fit(..., ckpt_path="last")`` resumes from the newest complete checkpoint;
    files saved earlier by Lightning's own ``torch.save`` still load.

    Args:
        overlap: True (the default) lets the copy off the training tensors run on into the
            next step; it is waited for right before the next ``optimizer.step()`` or the
            next forward of a layer with running statistics (BatchNorm), whichever comes
            first. False waits inside ``save_checkpoint``.
        **manager_options: passed to each :class:`~ckptmgr.CheckpointManager`
            (``write_options``, ``staging``, ``storage_options``, ``s3_options``).

    Raises:
        ConfigError: ``retention`` or ``allow_pickle`` was passed (the plugin sets both:
            Lightning decides what to keep, and its checkpoints hold pickled
            hyper-parameters, trusted as Lightning trusts them).
    """
