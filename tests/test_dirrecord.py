"""The directory record's check (``verify_dir``): what it returns and the exact messages it
raises for each way a checkpoint directory can differ from its ``ckptmgr.json``, on real
files. These are the results any reader of such directories (the CLI's ``verify``, the Hugging
Face/accelerate resume) must keep."""

from __future__ import annotations

import os

import numpy as np
import pytest

from ckptmgr import CheckpointCorruptError
from ckptmgr.format.checksum import chunk_ranges, crc32c_hex
from ckptmgr.format.dirrecord import RECORD_NAME, FileRecord, write_record
from ckptmgr.restore.dircheck import newest_verified, verify_dir

CHUNK = 4096


def _write(directory, files: dict[str, bytes], step: int = 1) -> None:
    """``files`` written under ``directory`` (names may have one level of subdirectory), then
    the record that lists them."""
    records = {}
    for name, data in files.items():
        path = os.path.join(directory, *name.split("/"))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)
        arr = np.frombuffer(data, dtype=np.uint8)
        records[name] = FileRecord(len(data), tuple(crc32c_hex(arr[b:e]) for b, e in chunk_ranges(len(data), CHUNK)))
    write_record(str(directory), step=step, files=records, chunk_size=CHUNK)


def _files() -> dict[str, bytes]:
    rng = np.random.default_rng(1)
    return {"model.safetensors": rng.integers(0, 256, 5 * CHUNK + 123, dtype=np.uint8).tobytes(),
            "optimizer.pt": rng.integers(0, 256, 2 * CHUNK, dtype=np.uint8).tobytes(),
            "sub/rng_state.pth": b"x" * 10, "empty.json": b""}


def _flip(path, at: int) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x08]))


def test_an_intact_directory_verifies_and_one_without_a_record_is_not_ours(tmp_path):
    d = tmp_path / "checkpoint-1"
    d.mkdir()
    assert verify_dir(str(d)) is False  # no record: written without ckptmgr
    _write(d, _files())
    assert verify_dir(str(d)) is True


def test_a_flipped_byte_is_named_by_file_and_chunk_with_both_checksums(tmp_path):
    d = tmp_path / "checkpoint-1"
    d.mkdir()
    files = _files()
    _write(d, files)
    at = 3 * CHUNK + 17
    _flip(d / "model.safetensors", at)
    data = bytearray(files["model.safetensors"])
    data[at] ^= 0x08
    want = crc32c_hex(np.frombuffer(files["model.safetensors"], np.uint8)[3 * CHUNK:4 * CHUNK])
    got = crc32c_hex(np.frombuffer(bytes(data), np.uint8)[3 * CHUNK:4 * CHUNK])
    with pytest.raises(CheckpointCorruptError) as err:
        verify_dir(str(d))
    assert str(err.value) == (f"{d}: model.safetensors bytes {3 * CHUNK}-{4 * CHUNK} fail their CRC32C "
                              f"(stored {want}, computed {got}); the file is damaged")


def test_a_file_of_another_size_is_named_before_its_bytes_are_read(tmp_path):
    d = tmp_path / "checkpoint-1"
    d.mkdir()
    _write(d, _files())
    with open(d / "optimizer.pt", "ab") as f:
        f.write(b"\0")
    with pytest.raises(CheckpointCorruptError) as err:
        verify_dir(str(d))
    assert str(err.value) == f"{d}: optimizer.pt has {2 * CHUNK + 1} bytes, the record says {2 * CHUNK}"


def test_a_missing_file_is_named(tmp_path):
    d = tmp_path / "checkpoint-1"
    d.mkdir()
    _write(d, _files())
    os.unlink(d / "sub" / "rng_state.pth")
    with pytest.raises(CheckpointCorruptError, match=rf"^{d}: sub/rng_state.pth is listed in {RECORD_NAME} but "
                                                     r"cannot be read \(.*\); the checkpoint is damaged$"):
        verify_dir(str(d))


def test_links_are_never_followed(tmp_path):
    """A listed file that is a link out of the directory is refused without being opened; one
    that is a link inside it is refused too (opened without following links)."""
    (tmp_path / "secret").write_bytes(b"s" * 10)
    d = tmp_path / "checkpoint-1"
    d.mkdir()
    _write(d, _files())
    os.unlink(d / "sub" / "rng_state.pth")
    os.symlink(tmp_path / "secret", d / "sub" / "rng_state.pth")
    with pytest.raises(CheckpointCorruptError, match=rf"^{d}: sub/rng_state.pth leads outside the checkpoint$"):
        verify_dir(str(d))
    os.unlink(d / "sub" / "rng_state.pth")
    os.rename(d / "optimizer.pt", d / "sub" / "real.pt")
    os.symlink("sub/real.pt", d / "optimizer.pt")
    with pytest.raises(CheckpointCorruptError, match=rf"^{d}: optimizer.pt is listed in {RECORD_NAME} but cannot be"):
        verify_dir(str(d))


def test_the_first_fault_in_record_order_is_the_one_raised(tmp_path):
    """Several faults: the one of the first file the record lists (names sorted) is raised,
    whatever kind each is."""
    d = tmp_path / "checkpoint-1"
    d.mkdir()
    _write(d, _files())
    _flip(d / "model.safetensors", 5)  # "model.safetensors" < "optimizer.pt" < "sub/..."
    os.unlink(d / "optimizer.pt")
    with pytest.raises(CheckpointCorruptError, match=r"model.safetensors bytes 0-4096 fail their CRC32C"):
        verify_dir(str(d))
    os.unlink(d / "model.safetensors")
    with pytest.raises(CheckpointCorruptError, match=r"model.safetensors is listed"):
        verify_dir(str(d))


def test_the_newest_directory_that_verifies_is_chosen(tmp_path):
    class Log:
        def __init__(self) -> None:
            self.lines: list[str] = []

        def warning(self, fmt: str, *args: object) -> None:
            self.lines.append(fmt % args)

    dirs = {}
    for step in (1, 2, 3):
        d = tmp_path / f"checkpoint-{step}"
        d.mkdir()
        _write(d, _files(), step=step)
        dirs[step] = str(d)
    _flip(tmp_path / "checkpoint-3" / "optimizer.pt", CHUNK + 1)
    log = Log()
    assert newest_verified(dirs, log) == (2, dirs[2])
    assert len(log.lines) == 1 and log.lines[0].startswith(f"skipping damaged checkpoint {dirs[3]}: ")
