"""The extension API: what ckptmgr's integrations are built on, and yours can be too.

.. warning::
   Experimental. These names are a declared, tested surface (``tests/test_exported_members.py``
   pins ``__all__``), but their signatures may still change in a minor release, with a line in
   the CHANGELOG. The stable API is :mod:`ckptmgr`'s own ``__all__``.

The integrations under ``ckptmgr.integrations`` (Lightning, Hugging Face, accelerate,
torchtitan, the callbacks) import only :mod:`ckptmgr` and this module; a test walks their
imports to keep it so. What is here, by job:

* The save engine (:mod:`ckptmgr.save.engine`): :class:`AsyncWriter` stages a save's
  :class:`Image` s into reused (pinned) host memory and runs its :class:`Commit` on one worker
  thread, in order; each save has a :class:`Pending`. Example::

      writer = AsyncWriter(slots=2, copy_threads=4, io_threads=8)
      pending = writer.submit([image], FileCommit(path, None, Destinations(), chunk_size=64 << 20,
                                                  direct_io=True))
      pending.wait_staged()  # the tensors may change now
      pending.result()  # the file is committed
      writer.close()

* Commit strategies (:mod:`ckptmgr.storage.commit`): :class:`FileCommit` (one file at a
  user's path, with the :class:`Destinations` its writer shares) and :class:`DirectoryCommit`
  (a checkpoint directory in a library's naming), with the directory helpers
  :func:`delete_dir`, :func:`recover`, :func:`remove_stale_temps`, :func:`replace_dir`,
  :func:`scratch_dir` and the temporary's name :func:`dir_temp_name`.
* The directory record (:mod:`ckptmgr.format.dirrecord`): :data:`RECORD_NAME`,
  :class:`FileRecord`, :func:`read_record`, :func:`write_record`, :func:`committed_dirs`; its
  check (:mod:`ckptmgr.restore.dircheck`): :func:`verify_dir`, :func:`newest_verified`.
* Torch checkpoint files (:mod:`ckptmgr.format.torchzip`): :class:`TorchZipImage`,
  :func:`plan_image`, :func:`seal`, :func:`verify_file`.
* What the stager copies (:mod:`ckptmgr.format.layout`): :class:`FilePlan`,
  :class:`StoredTensor`, :func:`header_bytes`, :data:`DTYPE_TO_ST`; checksums:
  :func:`chunk_ranges`, :func:`crc32c_hex`.
* Multi-rank jobs: :func:`coordinator_for`. Options: :func:`option_or_default`.
* Budget schedules (:mod:`ckptmgr.save.budget`): :class:`BudgetPlanner`, the decisions behind
  ``Schedule(max_overhead=..., max_lost_s=...)`` for a loop whose saves are not the manager's
  (a framework's own checkpoint callback): ``should_save`` every step, ``saved`` after each save.
"""

from __future__ import annotations

from .distributed.coordinator import coordinator_for
from .format.checksum import chunk_ranges, crc32c_hex
from .format.dirrecord import RECORD_NAME, FileRecord, committed_dirs, read_record, write_record
from .format.layout import DTYPE_TO_ST, FilePlan, StoredTensor, header_bytes
from .format.naming import dir_temp_name
from .format.torchzip import TorchZipImage, plan_image, seal, verify_file
from .options import option_or_default
from .restore.dircheck import newest_verified, verify_dir
from .save.budget import BudgetPlanner
from .save.engine import AsyncWriter, Commit, Fifo, Image, JobPicker
from .save.outcome import Pending
from .storage.commit.directory import (
    DirectoryCommit,
    delete_dir,
    recover,
    remove_stale_temps,
    replace_dir,
    scratch_dir,
)
from .storage.commit.file import Destinations, FileCommit

__all__ = [
    "DTYPE_TO_ST",
    "RECORD_NAME",
    "AsyncWriter",
    "BudgetPlanner",
    "Commit",
    "Destinations",
    "DirectoryCommit",
    "Fifo",
    "FileCommit",
    "FilePlan",
    "FileRecord",
    "Image",
    "JobPicker",
    "Pending",
    "StoredTensor",
    "TorchZipImage",
    "chunk_ranges",
    "committed_dirs",
    "coordinator_for",
    "crc32c_hex",
    "delete_dir",
    "dir_temp_name",
    "header_bytes",
    "newest_verified",
    "option_or_default",
    "plan_image",
    "read_record",
    "recover",
    "remove_stale_temps",
    "replace_dir",
    "scratch_dir",
    "seal",
    "verify_dir",
    "verify_file",
    "write_record",
]
