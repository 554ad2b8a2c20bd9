"""What the product benchmarks share: the state they save, how they drop caches, how they
check that bytes came back, how they order and summarize rounds.

Benchmarks import this module as ``common`` (each runs with ``benchmarks/`` as its script
directory). Like the benchmarks themselves it uses only ckptmgr's public API; one-off probes
that need internals live in ``benchmarks/probes/``.
"""

from __future__ import annotations

import math
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

import crc32c
import torch

HERE = os.path.dirname(os.path.abspath(__file__))


# ---------------------------------------------------------------------------- the state

def make_state(gib: float, device: str = "cpu", n_tensors: int = 150,
               dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """``n_tensors`` tensors of mixed sizes adding up to ``gib`` GiB on ``device``: every third
    one bf16 and the rest fp32 (``dtype`` None), or all of ``dtype``. Seeded: the same
    arguments give the same bytes."""
    g = torch.Generator(device=device).manual_seed(0)
    total = int(gib * (1 << 30))
    weights = [1 + (i % 7) for i in range(n_tensors)]
    state = {}
    for i, w in enumerate(weights):
        dt = dtype or (torch.bfloat16 if i % 3 == 0 else torch.float32)
        n = total * w // sum(weights) // torch.empty(0, dtype=dt).element_size()
        state[f"layers.{i}.weight"] = torch.randn(n, device=device, generator=g).to(dt)
    return state


def nbytes(state: dict[str, torch.Tensor]) -> int:
    """Bytes of the tensors of ``state``."""
    return sum(t.numel() * t.element_size() for t in state.values())


def sync(device: str) -> None:
    """Wait for the device's queued work (a no-op on the CPU)."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()


# ---------------------------------------------------------------------------- files and caches

def fsync_tree(path: str) -> None:
    """fsync ``path`` (a file) or every file under it (a directory)."""
    paths = [path] if os.path.isfile(path) else [os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs]
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def drop_cache(paths: Sequence[str]) -> None:
    """Evict ``paths`` from the page cache (written back first): the next read is cold."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def evict(directory: str) -> None:
    """:func:`drop_cache` for every file under ``directory``, however it was written (O_DIRECT
    or through the cache)."""
    drop_cache([os.path.join(base, n) for base, _, names in os.walk(directory) for n in names])


def proc_io() -> dict[str, int]:
    """This process's I/O counters from /proc/self/io (every thread's): ``read_bytes`` is what
    it had the storage read for it (page-cache misses and direct reads alike), ``rchar`` what
    its read calls returned (empty elsewhere)."""
    try:
        with open("/proc/self/io") as f:
            return {k: int(v) for k, v in (line.split(":") for line in f)}
    except OSError:
        return {}


# ---------------------------------------------------------------------------- host memory

def proc_status(field: str) -> int:
    """A byte count from /proc/self/status (``RssAnon``, ``VmRSS``, ``VmHWM``; 0 elsewhere)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


_SAMPLER = r"""
import select, sys
pid, interval = sys.argv[1], float(sys.argv[2])
def read():
    got = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(("RssAnon:", "VmRSS:")):
                got[line.split(":")[0]] = int(line.split()[1]) * 1024
    return got.get("RssAnon", 0), got.get("VmRSS", 0)
peak = list(read())
print("ready", flush=True)
while not select.select([sys.stdin], [], [], interval)[0]:
    a, t = read()
    peak = [max(peak[0], a), max(peak[1], t)]
a, t = read()
print(max(peak[0], a), max(peak[1], t), flush=True)
"""


class PeakRss:
    """Peak growth of the process's private (``RssAnon``) and total (``VmRSS``) resident
    memory while the ``with`` block runs, sampled every ``interval`` seconds by a process of
    its own (a sampling thread would take the GIL from the loader it measures every few
    milliseconds: a tax on loaders that run Python threads, none on those that run C++)."""

    def __init__(self, interval: float = 0.002) -> None:
        self.interval = interval
        self.anon = self.total = 0  # peak growth in bytes, set on exit

    def __enter__(self) -> PeakRss:
        self._base = (proc_status("RssAnon"), proc_status("VmRSS"))
        self._proc = subprocess.Popen([sys.executable, "-c", _SAMPLER, str(os.getpid()), str(self.interval)],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self._proc.stdout is not None
        if self._proc.stdout.readline().strip() != "ready":
            raise RuntimeError("the memory sampler did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        out, _ = self._proc.communicate("stop\n", timeout=30)
        anon, total = (int(x) for x in out.split())
        anon, total = max(anon, proc_status("RssAnon")), max(total, proc_status("VmRSS"))
        self.anon, self.total = anon - self._base[0], total - self._base[1]


# ---------------------------------------------------------------------------- did the bytes come back

def fingerprint(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    """name -> CRC32C of the tensor's bytes (moved to the host first)."""
    out = {}
    for k, v in tensors.items():
        b = v.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
        out[k] = f"{crc32c.crc32c(memoryview(b)):08x}"
    return out


def global_fingerprint(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, list[int]]:
    """Per parameter and optimizer moment: (sum of the raw 32-bit words, sum weighted by global
    position), int64 with wrap-around, reduced over the ranks for DTensors: exact and
    independent of the layout (FSDP2's Shard(0) at any world size)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        for key, t in [(name, p), *((f"{name}.{k}", v) for k, v in opt.state[p].items())]:
            if isinstance(t, DTensor):
                local = t.to_local().detach()
                _, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
                start = int(offset[0]) * math.prod(t.shape[1:]) if t.dim() else 0  # FSDP2: Shard(0)
            else:
                local, start = t.detach(), 0
            words = local.contiguous().reshape(-1).view(torch.int32).to(torch.int64)
            pos = torch.arange(start, start + words.numel(), device=words.device, dtype=torch.int64) % 65521 + 1
            s = torch.stack([words.sum(), (words * pos).sum()])
            if isinstance(t, DTensor):
                dist.all_reduce(s)
            out[key] = s
    return {k: [int(x) for x in v.tolist()] for k, v in out.items()}


# ---------------------------------------------------------------------------- rounds

def round_order(tools: Sequence[str], r: int) -> list[str]:
    """Round ``r``'s order of ``tools``: row ``r`` of a balanced Latin square (Williams design).
    Each tool runs first in turn, as in a rotation, and also after a different tool each round:
    with an even number of tools, over as many rounds every tool follows every other once (odd
    rounds are mirrored for an odd number). A plain rotation keeps every tool behind the same
    one, so whatever a tool leaves behind (a disk's own cache holding other files, pages being
    freed) would always weigh on the same neighbour."""
    n = len(tools)
    first, lo, hi = [0], 1, n - 1
    while len(first) < n:
        first.append(lo)
        lo += 1
        if len(first) < n:
            first.append(hi)
            hi -= 1
    row = [tools[(i + r) % n] for i in first]
    return row[::-1] if n % 2 and r % 2 else row


def median_range(values: Sequence[float], scale: float = 1.0, fmt: str = "{:.1f}") -> str:
    """``median (min to max)`` of ``values`` times ``scale``; the value alone for one round."""
    med = fmt.format(statistics.median(values) * scale)
    if len(values) == 1:
        return med
    return f"{med} ({fmt.format(min(values) * scale)} to {fmt.format(max(values) * scale)})"


def commit() -> str:
    """The commit measured: ``$CKPTMGR_COMMIT`` (the GPU machine's copy has no git HEAD), else
    the checkout's HEAD, else ``unknown``."""
    env = os.environ.get("CKPTMGR_COMMIT")
    if env:
        return env
    try:
        r = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=HERE,
                           timeout=30)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return r.stdout.strip() or "unknown"


def machine() -> dict[str, Any]:
    """Where a result was measured: date, device, torch and the commit."""
    cuda = torch.cuda.is_available()
    return {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name() if cuda else "cpu",
            "torch": torch.__version__, "commit": commit()}
