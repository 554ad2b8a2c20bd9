"""What every command shares: the opened root, step resolution, output mode, exit codes."""

from __future__ import annotations

import argparse
import json
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError, StepNotFoundError
from ..format.manifest import Manifest
from ..restore.verify import file_url
from ..storage import Target, open_target

__all__ = ["EXIT", "CorruptFound", "Ctx", "manifests"]

EXIT = {
    "ok": 0,
    "corrupt": 1,  # verify found a fault, or a read failed its checksum
    "usage": 2,  # bad arguments or input (argparse uses 2 as well)
    "not_found": 3,  # no such root, step or file
    "exists": 4,  # the step or export directory already exists
    "storage": 5,  # the storage failed (I/O, permissions, network)
    "interrupted": 130,
}


class CorruptFound(Exception):
    """Verification found faults; they have been reported already."""


def _storage_options(text: str | None) -> dict[str, Any] | None:
    text = text if text is not None else os.environ.get("CKPTMGR_STORAGE_OPTIONS")
    if not text:
        return None
    try:
        opts = json.loads(text)
    except ValueError as exc:
        raise ConfigError(f"--storage-options is not valid JSON: {exc}") from exc
    if not isinstance(opts, dict):
        raise ConfigError("--storage-options must be a JSON object, e.g. "
                          '\'{"client_kwargs": {"endpoint_url": "http://127.0.0.1:9000"}}\'')
    return opts


@dataclass
class Ctx:
    """One command's view of its checkpoint root."""

    args: argparse.Namespace
    _target: Target | None = field(default=None, repr=False)

    @property
    def json(self) -> bool:
        return bool(self.args.json)

    @property
    def show_progress(self) -> bool:
        return not (self.args.quiet or self.args.json)

    def storage_options(self) -> dict[str, Any] | None:
        return _storage_options(self.args.storage_options)

    def target(self, root: str, *, must_exist: bool = True, read_only: bool = True) -> Target:
        """Open ``root``, for reading only unless ``read_only=False`` (a reading command
        creates nothing, not even a bucket); a local root that does not exist is an error."""
        if "://" not in root and must_exist and not os.path.isdir(root):
            raise StepNotFoundError(f"no checkpoint root at {root!r} (not a directory)")
        self._target = open_target(root, self.storage_options(), read_only=read_only)
        return self._target

    def step(self, target: Target, text: str | None) -> int:
        """``None``/``'latest'`` -> the newest committed step; else the step number, which
        must be committed."""
        steps = target.list_steps()
        if text is None or text == "latest":
            if not steps:
                raise StepNotFoundError(f"no committed checkpoint under {target.url}")
            return steps[-1]
        try:
            step = int(text)
        except ValueError:
            raise ConfigError(f"STEP must be a step number or 'latest', got {text!r}") from None
        if step not in steps:
            near = ", ".join(map(str, steps[-5:])) or "none"
            raise StepNotFoundError(f"step {step} is not a committed checkpoint under {target.url} "
                                    f"(newest: {near})")
        return step

    def manifest(self, target: Target, step: int) -> Manifest:
        return Manifest.from_bytes(target.read_manifest(step), where=file_url(target, step, "manifest.json"))

    def close(self) -> None:
        if self._target is not None:
            self._target.close()
            self._target = None


def manifests(ctx: Ctx, target: Target, steps: list[int]) -> dict[int, Manifest]:
    """The manifests of ``steps``, read in parallel (one request each on object stores)."""
    with ThreadPoolExecutor(8, thread_name_prefix="ckptmgr-cli") as pool:
        return dict(zip(steps, pool.map(lambda s: ctx.manifest(target, s), steps), strict=True))
