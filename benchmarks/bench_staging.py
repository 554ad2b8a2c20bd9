"""What a save costs the training loop: ckptmgr against its peers, on one GPU state.

    python benchmarks/bench_staging.py --gib 4 --gib 16 --disk-dir /path/on/disk

For each state size (fp32/bf16 tensors on the GPU, ~150 of them) and each target (/dev/shm
and disk), every tool saves the same state ``--saves`` times in a process of its own (a fresh
process per tool, so no tool inherits another's warm caches or pinned memory), for
``--rounds`` rounds with the tool order rotated each round:

* ``blocked_s``: how long the save call held the caller;
* ``safe_s``: time until the state may be changed (the copy is off the tensors);
* ``durable_s``: time until the checkpoint is written (fsync'd) on the target;
* ``extra_gpu_mib``: peak GPU memory the save added.

The first save of each process (which pays for allocating and pinning buffers, for every tool
alike) is reported apart from the later ones. Peers: torch.save, safetensors.save_file,
Lightning's AsyncCheckpointIO, torch.distributed.checkpoint.async_save with one pinned
DefaultStager reused across saves (where the installed torch fails to reuse it, the error is
recorded and a fresh stager is made), and ckptmgr with ``block=True`` and ``block=False``
(+ ``wait_staged``; ``ckptmgr overlap slots=1`` with one configured slot, where the default adds a
second beside the first write). The ceilings measured in the same run: pinned device-to-host bandwidth,
and parallel write bandwidth of the disk. Prints tables (median and range) and writes JSON
(default benchmarks/out/staging.json). Numbers are not pass/fail.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
from common import commit, fsync_tree, make_state, nbytes, sync

from ckptmgr import CheckpointManager, StagingOptions

Result = dict[str, Any]


class GpuPeak:
    """Peak GPU memory allocated above the level at entry."""

    def __init__(self, device: str) -> None:
        self.cuda = device.startswith("cuda")
        self.extra = 0

    def __enter__(self) -> GpuPeak:
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            self.extra = torch.cuda.max_memory_allocated() - self.base


# ------------------------------------------------------------------ ceilings

def d2h_ceiling(state: dict[str, torch.Tensor], device: str) -> float:
    """GB/s of copying every tensor into one preallocated pinned buffer (best of 3)."""
    if not device.startswith("cuda"):
        return float("nan")
    buf = torch.empty(nbytes(state) + 4096 * len(state), dtype=torch.uint8, pin_memory=True)
    best = float("inf")
    for _ in range(3):
        sync(device)
        t = time.perf_counter()
        pos = 0
        for v in state.values():
            n = v.numel() * v.element_size()
            buf[pos:pos + n].view(v.dtype).copy_(v.reshape(-1), non_blocking=True)
            pos += -(-n // 4096) * 4096
        sync(device)
        best = min(best, time.perf_counter() - t)
    del buf
    return nbytes(state) / best / 1e9


def write_ceiling(directory: str, size: int, files: int = 8) -> dict[str, float]:
    """GB/s of writing ``size`` bytes from memory to ``directory``: ``files`` files in
    parallel (each thread its own file), with fsync."""
    os.makedirs(directory, exist_ok=True)
    chunk = 16 << 20
    buf = memoryview(bytearray(os.urandom(1 << 20)) * 16)
    per = size // files // chunk * chunk
    out = {}
    for name, direct in (("buffered", False), ("o_direct", True)):
        paths = [os.path.join(directory, f"ceiling-{i}") for i in range(files)]
        import mmap

        aligned = mmap.mmap(-1, chunk)
        aligned.write(bytes(buf[:chunk]))

        def write(p: str, direct: bool = direct, aligned: mmap.mmap = aligned) -> None:
            flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0)
            fd = os.open(p, flags, 0o644)
            try:
                for off in range(0, per, chunk):
                    os.pwrite(fd, aligned if direct else buf, off)
                os.fsync(fd)
            finally:
                os.close(fd)

        os.sync()
        t = time.perf_counter()
        try:
            threads = [threading.Thread(target=write, args=(p,)) for p in paths]
            for th in threads:
                th.start()
            for th in threads:
                th.join()
            out[name] = per * files / (time.perf_counter() - t) / 1e9
        except OSError:
            out[name] = float("nan")
        for p in paths:
            if os.path.exists(p):
                os.unlink(p)
    return out


# --------------------------------------------------------------------- peers

def run_torch_save(state: dict[str, torch.Tensor], work: str, i: int, device: str) -> Result:
    p = os.path.join(work, f"s{i}.pt")
    with GpuPeak(device) as peak:
        t = time.perf_counter()
        torch.save(state, p)
        blocked = time.perf_counter() - t
        fsync_tree(p)
        durable = time.perf_counter() - t
    return {"blocked_s": blocked, "safe_s": blocked, "durable_s": durable, "extra_gpu_mib": peak.extra / 2**20}


def run_safetensors(state: dict[str, torch.Tensor], work: str, i: int, device: str) -> Result:
    from safetensors.torch import save_file

    p = os.path.join(work, f"s{i}.safetensors")
    with GpuPeak(device) as peak:
        t = time.perf_counter()
        save_file(state, p)
        blocked = time.perf_counter() - t
        fsync_tree(p)
        durable = time.perf_counter() - t
    return {"blocked_s": blocked, "safe_s": blocked, "durable_s": durable, "extra_gpu_mib": peak.extra / 2**20}


class LightningAsync:
    def __init__(self) -> None:
        try:
            from lightning.pytorch.plugins.io import AsyncCheckpointIO, TorchCheckpointIO
        except ImportError:
            from pytorch_lightning.plugins.io import AsyncCheckpointIO, TorchCheckpointIO  # type: ignore[no-redef]
        self.io = AsyncCheckpointIO(TorchCheckpointIO())

    def __call__(self, state: dict[str, torch.Tensor], work: str, i: int, device: str) -> Result:
        p = os.path.join(work, f"s{i}.ckpt")
        with GpuPeak(device) as peak:
            t = time.perf_counter()
            self.io.save_checkpoint(state, p)
            blocked = time.perf_counter() - t
            self.io.teardown()  # waits for the background write
            fsync_tree(p)
            durable = time.perf_counter() - t
        return {"blocked_s": blocked, "safe_s": blocked, "durable_s": durable, "extra_gpu_mib": peak.extra / 2**20}


class DcpAsync:
    """torch.distributed.checkpoint.async_save with one pinned DefaultStager, reused; when
    reuse fails, the error is recorded and a fresh stager is made for the next save."""

    def __init__(self, device: str) -> None:
        self.pinned = device.startswith("cuda")
        self.stager = self._new()
        self.errors: list[str] = []

    def _new(self) -> Any:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        return DefaultStager(StagingOptions(use_pinned_memory=self.pinned, use_shared_memory=False,
                                            use_async_staging=True, use_non_blocking_copy=self.pinned))

    def __call__(self, state: dict[str, torch.Tensor], work: str, i: int, device: str) -> Result:
        import torch.distributed.checkpoint as dcp

        p = os.path.join(work, f"s{i}.dcp")
        res: Result = {}
        for attempt in range(2):
            try:
                with GpuPeak(device) as peak:
                    t = time.perf_counter()
                    resp = dcp.async_save(state, checkpoint_id=p, async_stager=self.stager)
                    blocked = time.perf_counter() - t
                    resp.staging_completion.result()
                    safe = time.perf_counter() - t
                    resp.upload_completion.result()
                    fsync_tree(p)
                    durable = time.perf_counter() - t
                res = {"blocked_s": blocked, "safe_s": safe, "durable_s": durable,
                       "extra_gpu_mib": peak.extra / 2**20, "fresh_stager": attempt > 0}
                break
            except Exception as exc:
                self.errors.append(f"save {i}: {type(exc).__name__}: {exc}")
                shutil.rmtree(p, ignore_errors=True)
                self.stager = self._new()
        return res

    def close(self) -> None:
        self.stager.close()


class Ckptmgr:
    def __init__(self, work: str, block: bool, local_tier: bool, slots: int | None = None) -> None:
        opts = StagingOptions(local_tier=local_tier) if slots is None else StagingOptions(local_tier=local_tier,
                                                                                            slots=slots)
        self.mgr = CheckpointManager(os.path.join(work, "root"), staging=opts)
        self.block = block

    def __call__(self, state: dict[str, torch.Tensor], work: str, i: int, device: str) -> Result:
        with GpuPeak(device) as peak:
            t = time.perf_counter()
            h = self.mgr.save(i, state, block=self.block)
            blocked = time.perf_counter() - t
            h.wait_staged()
            safe = time.perf_counter() - t
            info = h.result()
            durable = time.perf_counter() - t
        return {"blocked_s": blocked, "safe_s": safe, "durable_s": durable, "extra_gpu_mib": peak.extra / 2**20,
                "local_s": info.local_s, "slot_allocations": self.mgr.stats()["slot_allocations"],
                "slot_registrations": self.mgr.stats()["slot_registrations"]}

    def close(self) -> None:
        self.mgr.close()


MAKERS: dict[str, Callable[[str, str], Any]] = {
    "torch.save": lambda w, d: run_torch_save,
    "safetensors.save_file": lambda w, d: run_safetensors,
    "Lightning AsyncCheckpointIO": lambda w, d: LightningAsync(),
    "DCP async_save (pinned stager)": lambda w, d: DcpAsync(d),
    "ckptmgr block": lambda w, d: Ckptmgr(w, True, local_tier=True),
    "ckptmgr overlap": lambda w, d: Ckptmgr(w, False, local_tier=True),
    # one slot, as the defaults before slots=None: the engine alike, without the second slot made beside the first write
    "ckptmgr overlap slots=1": lambda w, d: Ckptmgr(w, False, local_tier=True, slots=1),
}


def _clear(work: str) -> None:
    """Keep the target from filling up: remove what the last save wrote (ckptmgr's root stays)."""
    for entry in os.listdir(work):
        p = os.path.join(work, entry)
        if entry == "root":
            for step in os.listdir(p):
                shutil.rmtree(os.path.join(p, step), ignore_errors=True)
        elif os.path.isdir(p):
            shutil.rmtree(p)
        else:
            os.unlink(p)


def child(name: str, target_dir: str, gib: float, device: str, saves: int) -> dict[str, Any]:
    """One tool in this (fresh) process: ``saves`` saves of the same state."""
    state = make_state(gib, device)
    sync(device)
    work = os.path.join(target_dir, "work")
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    runs = []
    tool = MAKERS[name](work, device)
    try:
        for i in range(1, saves + 1):
            os.sync()
            runs.append(tool(state, work, i, device))
            _clear(work)
    finally:
        if hasattr(tool, "close"):
            tool.close()
        shutil.rmtree(work, ignore_errors=True)
    return {"runs": runs, "errors": getattr(tool, "errors", [])}


def bench(gib: float, target_dir: str, device: str, saves: int, rounds: int, tools: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {name: {"processes": [], "errors": []} for name in tools}
    for r in range(rounds):
        for name in tools[r % len(tools):] + tools[:r % len(tools)]:
            p = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", name, target_dir, str(gib),
                                device, str(saves)], capture_output=True, text=True, timeout=1800)
            line = next((x for x in p.stdout.splitlines() if x.startswith("RESULT ")), None)
            if line is None:
                out[name]["errors"].append((p.stderr.strip().splitlines() or ["no output"])[-1])
                print(f"  {name}: FAILED {out[name]['errors'][-1]}", flush=True)
                continue
            res = json.loads(line[7:])
            out[name]["processes"].append(res["runs"])
            out[name]["errors"] += res["errors"]
            shown = [f"{x.get('safe_s', float('nan')):.3f}/{x.get('durable_s', float('nan')):.3f}" for x in res["runs"]]
            print(f"  {name}: {', '.join(shown)}", flush=True)
    return out


def _cell(values: list[float], fmt: str = "{:.3f}") -> str:
    if not values:
        return "-"
    med = fmt.format(statistics.median(values))
    return med if len(values) == 1 else f"{med} ({fmt.format(min(values))}-{fmt.format(max(values))})"


def table(title: str, size: int, res: dict[str, Any], ceiling_gbps: float) -> str:
    lines = [f"### {title}", "",
             "| tool | saves | blocked s | safe-to-mutate s | durable s | durable GB/s | extra GPU MiB |",
             "|---|---|---|---|---|---|---|"]
    for name, r in res.items():
        procs = r["processes"]
        for label, sel in (("first", [p[:1] for p in procs]), ("later", [p[1:] for p in procs])):
            runs = [x for p in sel for x in p if x]
            if not runs:
                continue
            dur = [x["durable_s"] for x in runs]
            lines.append(f"| {name} | {label} ({len(runs)}) | {_cell([x['blocked_s'] for x in runs])} | "
                         f"{_cell([x['safe_s'] for x in runs])} | {_cell(dur)} | "
                         f"{size / statistics.median(dur) / 1e9:.2f} | "
                         f"{_cell([x['extra_gpu_mib'] for x in runs], '{:.0f}')} |")
        for e in sorted(set(r["errors"])):
            lines.append(f"| {name} | error | {e[:120]} | | | | |")
    lines.append("")
    if ceiling_gbps == ceiling_gbps:
        lines.append(f"Goal for safe-to-mutate: 1.15 x bytes / pinned D2H = {1.15 * size / ceiling_gbps / 1e9:.3f} s")
    return "\n".join(lines)


def _merged(path: str, report: dict[str, Any]) -> dict[str, Any]:
    """``report``'s targets added to those of the report in ``path`` (same commit, rounds and
    saves; anything else is refused rather than mixed)."""
    with open(path) as f:
        old = json.load(f)
    for key in ("device", "rounds", "saves_per_process"):
        if old.get(key) != report[key]:
            raise SystemExit(f"--merge: {path} has {key} {old.get(key)!r}, this run {report[key]!r}")
    for gib, entry in report["sizes"].items():
        into = old["sizes"].setdefault(gib, entry)
        if into is not entry:
            into["targets"].update(entry["targets"])
    old["target_commits"] = {**old.get("target_commits", {}), **report["target_commits"]}
    return old


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, action="append", help="state size (repeatable); default 4 and 16")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--shm-dir", default="/dev/shm/ckptmgr-bench")
    ap.add_argument("--disk-dir", default=os.path.join(os.path.dirname(__file__), "out", "disk"))
    ap.add_argument("--saves", type=int, default=3, help="saves per process: the first, then the later ones")
    ap.add_argument("--rounds", type=int, default=2, help="processes per tool and target, tool order rotated")
    ap.add_argument("--tools", default=None, help="comma-separated subset of the tools (default: all)")
    ap.add_argument("--big-tools", default="ckptmgr block,ckptmgr overlap,DCP async_save (pinned stager),torch.save",
                    help="tools for sizes over 8 GiB")
    ap.add_argument("--targets", default="shm,disk", help="where to save: shm (/dev/shm), disk, or both")
    ap.add_argument("--merge", action="store_true",
                    help="add these targets to an existing --out of the same commit (a run split over calls)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "out", "staging.json"))
    ap.add_argument("--child", nargs=5, metavar=("TOOL", "DIR", "GIB", "DEVICE", "SAVES"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        tool, d, gib, device, saves = args.child
        print("RESULT " + json.dumps(child(tool, d, float(gib), device, int(saves))), flush=True)
        return
    sizes = args.gib or [4.0, 16.0]
    all_tools = ["ckptmgr block", "ckptmgr overlap", "torch.save", "safetensors.save_file",
                 "Lightning AsyncCheckpointIO", "DCP async_save (pinned stager)"]
    report: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name() if args.device != "cpu" else "cpu",
        "torch": torch.__version__, "host": platform.node(), "cpus": os.cpu_count(),
        "commit": commit(),
        "rounds": args.rounds, "saves_per_process": args.saves, "sizes": {},
    }
    text = []
    for gib in sizes:
        state = make_state(gib, args.device)
        size, count = nbytes(state), len(state)
        d2h = d2h_ceiling(state, args.device)
        del state
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
        disk = write_ceiling(args.disk_dir, min(size, 8 << 30))
        entry: dict[str, Any] = {"bytes": size, "tensors": count, "d2h_pinned_gbps": d2h,
                                 "disk_write_ceiling_gbps": disk, "targets": {}}
        print(f"{gib} GiB: {count} tensors, pinned D2H {d2h:.1f} GB/s, disk write {disk}", flush=True)
        chosen = args.tools.split(",") if args.tools else all_tools
        tools = chosen if gib <= 8 else [t for t in chosen if t in args.big_tools.split(",")]
        wanted = set(args.targets.split(","))
        for tname, tdir in (("/dev/shm", args.shm_dir), ("disk", args.disk_dir)):
            if ("shm" if tname == "/dev/shm" else "disk") not in wanted:
                continue
            print(f" target {tname}", flush=True)
            use = tools if tname == "disk" or gib <= 8 else [t for t in tools if t.startswith("ckptmgr")]
            report.setdefault("target_commits", {})[tname] = report["commit"]
            entry["targets"][tname] = bench(gib, tdir, args.device, args.saves if gib <= 8 else 2, args.rounds, use)
            text.append(table(f"{gib:g} GiB ({count} tensors) to {tname}", size, entry["targets"][tname], d2h))
        report["sizes"][f"{gib:g}"] = entry
    shutil.rmtree(args.shm_dir, ignore_errors=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    if args.merge and os.path.exists(args.out):
        report = _merged(args.out, report)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print("\n\n".join(text))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
