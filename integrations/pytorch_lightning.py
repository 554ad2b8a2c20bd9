"""PyTorch Lightning (the ``pytorch_lightning`` package): checkpoints through ckptmgr.

Example:
    >>> import pytorch_lightning as pl
    >>> from ckptmgr.integrations.pytorch_lightning import CkptmgrCheckpointIO
    >>> trainer = pl.Trainer(plugins=[CkptmgrCheckpointIO()],  # doctest: +SKIP
    ...                      callbacks=[pl.callbacks.ModelCheckpoint(every_n_train_steps=500, save_last=True)])
    >>> trainer.fit(model, ckpt_path="last")  # resumes from the newest complete checkpoint  # doctest: +SKIP

For ``lightning.pytorch`` use :mod:`ckptmgr.integrations.lightning`.
"""

from __future__ import annotations

try:
    from pytorch_lightning.callbacks import ModelCheckpoint
    from pytorch_lightning.plugins.io import TorchCheckpointIO
except ImportError as exc:  # pragma: no cover - exercised where lightning is absent
    raise ImportError(f"ckptmgr.integrations.pytorch_lightning needs pytorch_lightning ({exc}): "
                      "pip install pytorch-lightning") from exc

from ._lightning_budget import BudgetCheckpointMixin
from ._lightning_io import CkptmgrIOMixin

__all__ = ["CkptmgrBudgetCheckpoint", "CkptmgrCheckpointIO"]


class CkptmgrCheckpointIO(CkptmgrIOMixin, TorchCheckpointIO):
    """:class:`ckptmgr.integrations.lightning.CkptmgrCheckpointIO` for ``pytorch_lightning``
    Trainers: the same plugin, arguments and behaviour."""

    _namespace = "pytorch_lightning"


class CkptmgrBudgetCheckpoint(BudgetCheckpointMixin, ModelCheckpoint):
    """:class:`ckptmgr.integrations.lightning.CkptmgrBudgetCheckpoint` for ``pytorch_lightning``
    Trainers: the same callback, arguments and behaviour."""
