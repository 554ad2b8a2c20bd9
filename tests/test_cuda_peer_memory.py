"""A peer restore's shard fetched into GPU memory, on a real GPU (``pytest -m cuda``): checked
where it landed after whatever the caller queued that writes it, pieces across files placed by
device copies, and the restore's tensors views of it. Skipped elsewhere; the CPU side of the
same code is tests/test_peer_fetch_memory.py."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from test_peer_fetch_memory import CHUNK, _shard

from ckptmgr.distributed import peer_memory, peer_mover
from ckptmgr.distributed.peer_restore import PeerSource
from ckptmgr.restore.loaders import bounce
from ckptmgr.restore.read import ChecksumMismatchError, plan_check, run
from ckptmgr.restore.transports.memory import MemoryTransport

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _pinned(n: int) -> list[list[torch.Tensor]]:
    return bounce.buffers(n, True)


def _on_gpu(data: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    return {n: torch.from_numpy(a.copy()).cuda() for n, a in data.items()}


def test_the_check_reads_back_what_the_callers_stream_wrote_after_a_delay():
    """The files' bytes are written on the caller's current stream (a side stream, not the
    default one the workers' threads would see) behind a long kernel and not synchronized:
    the copies back wait for them (else they would read the zeros before)."""
    rec, data = _shard()
    good = _on_gpu(data)
    files = {n: torch.zeros_like(t) for n, t in good.items()}
    torch.cuda.synchronize()
    with torch.cuda.stream(torch.cuda.Stream()):
        torch.cuda._sleep(200_000_000)  # (about 0.1 s of GPU time on the current stream)
        for n, t in files.items():
            t.copy_(good[n], non_blocking=True)
        with ThreadPoolExecutor(4) as pool:
            run(plan_check(rec.manifest, "here"), MemoryTransport(files, pool, timeout_s=60.0, pinned=_pinned))


def test_a_changed_byte_in_gpu_memory_fails_its_chunk_naming_the_file_and_range():
    rec, data = _shard()
    files = _on_gpu(data)
    name = sorted(files)[0]
    files[name][2 * CHUNK + 7] ^= 1
    with ThreadPoolExecutor(4) as pool, pytest.raises(ChecksumMismatchError) as info:
        run(plan_check(rec.manifest, "here"), MemoryTransport(files, pool, timeout_s=60.0, pinned=_pinned))
    assert info.value.mismatch.file == name and info.value.mismatch.begin == 2 * CHUNK


def test_pieces_across_files_are_placed_by_device_copies_and_the_tensors_are_views_of_the_gpu_memory():
    rec, data = _shard((3 * CHUNK + 203, 2 * CHUNK + 72))
    sizes = [f.size for f in rec.manifest.files.values()]
    bases, total = peer_memory.layout(sizes)
    image = torch.zeros(total + CHUNK, dtype=torch.uint8, device="cuda")  # (the scratch piece at the end)
    landing = peer_memory.InMemory(image, bases, CHUNK, total)
    stream = np.concatenate([data[n] for n in rec.manifest.files])
    at = 0
    for cut in peer_mover._cut(sizes, CHUNK):
        n = sum(p[2] for p in cut)
        buf = landing.into(cut)
        assert buf.is_cuda and buf.numel() == n
        buf.copy_(torch.from_numpy(stream[at:at + n].copy()).cuda(), non_blocking=True)
        landing.place(cut)
        at += n
    landing.settle()
    files = peer_memory.split(image, rec, bases)
    assert {n: t.cpu().numpy().tobytes() for n, t in files.items()} == {n: a.tobytes() for n, a in data.items()}
    staged = PeerSource({}, None, "peer tier", None, files).staged(3, rec.manifest, image.device, "here")
    assert staged is not None
    for i in range(len(sizes)):
        t = staged[f"rank00000/t{i}"]
        assert t.is_cuda and t.untyped_storage().data_ptr() == image.untyped_storage().data_ptr()
