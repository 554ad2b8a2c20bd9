"""Rewrite a committed step's manifest the way a damaged disk, a careless editor or an
attacker would: with its own checksum made valid again (so the schema itself is what is
tested), without a checksum (as written before the field existed), or byte for byte."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

import crc32c


def manifest_path(root: str, step: int) -> str:
    return os.path.join(root, f"step_{step:012d}", "manifest.json")


def load(root: str, step: int) -> dict[str, Any]:
    with open(manifest_path(root, step), "rb") as f:
        return json.loads(f.read())


def signed_bytes(obj: dict[str, Any]) -> bytes:
    """``obj`` serialized as ckptmgr writes manifests, ending with a valid checksum member."""
    obj = {k: v for k, v in obj.items() if k != "manifest_crc32c"}
    return sign_head(json.dumps(obj, indent=1, ensure_ascii=False).encode("utf-8")[:-2])


def rewrite(root: str, step: int, mutate: Callable[[dict[str, Any]], Any], *, signed: bool = True) -> None:
    """Apply ``mutate`` to the manifest object and write it back, re-signed (or unsigned)."""
    obj = load(root, step)
    mutate(obj)
    if signed:
        data = signed_bytes(obj)
    else:
        obj.pop("manifest_crc32c", None)
        data = json.dumps(obj, indent=1).encode()
    with open(manifest_path(root, step), "wb") as f:
        f.write(data)


def sign_head(head: bytes) -> bytes:
    """Raw manifest text without its closing ``\\n}``, ended with a valid checksum member."""
    return head + f',\n "manifest_crc32c": "{crc32c.crc32c(head):08x}"\n}}'.encode()


def write_raw(root: str, step: int, data: bytes) -> None:
    with open(manifest_path(root, step), "wb") as f:
        f.write(data)
