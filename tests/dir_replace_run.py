"""Saves checkpoint directory ``step-5`` twice through the HF integrations' DirectoryWriter
(run as a subprocess by tests/test_dir_replace_crash.py):

    python dir_replace_run.py PARENT {exchange,fallback}

The first save ("old") commits; then the kill-point hook is installed (tests/kill_points.py)
and the second save ("new") replaces it: the test SIGKILLs the process at one of the
replace's file-system operations. ``fallback`` makes the exchange unavailable, as on a file
system without ``renameat2(RENAME_EXCHANGE)``.
"""

from __future__ import annotations

import os
import sys

import kill_points

from ckptmgr.integrations._session import DirectoryWriter


def save(writer: DirectoryWriter, parent: str, version: str) -> None:
    fs = writer.begin(parent)
    with open(os.path.join(fs.directory, "version.txt"), "w") as f:
        f.write(version)
    os.makedirs(os.path.join(fs.directory, "sub"))
    with open(os.path.join(fs.directory, "sub", "data.bin"), "wb") as f:
        f.write(version.encode() * 40000)
    writer.commit(fs, os.path.join(parent, "step-5"), step=5, metadata={"version": version}).result(120)


def main() -> None:
    parent, mode = sys.argv[1], sys.argv[2]
    if mode == "fallback":
        try:
            from ckptmgr.storage.commit import directory as _dirreplace
        except ImportError:  # a version without the exchange: nothing to turn off
            pass
        else:
            _dirreplace._exchange_fn = False  # as where renameat2 has no RENAME_EXCHANGE
    writer = DirectoryWriter(chunk_size=1 << 16)
    save(writer, parent, "old")
    kill_points.install()
    save(writer, parent, "new")
    writer.close(120)
    print("done", file=sys.stderr)


if __name__ == "__main__":
    main()
