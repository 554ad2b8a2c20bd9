"""A multi-rank restore at the saved layout reads each byte once: real gloo processes on the CPU,
one per rank, this file being the rank's program too::

    python tests/test_dist_read_once.py SCENARIO ROOT OUT_JSON   (RANK, WORLD_SIZE, MASTER_ADDR/PORT set)

Scenario ``layout`` (2 ranks): an FSDP2 model with AdamW moments, a bf16 DTensor holding NaNs of
several payloads and a PerRank tensor are saved; then each rank restores them at the same layout
into a target (a stepped model and optimizer, other values), and without one, counting the bytes
it reads from storage; then a copy of the step with one flipped byte in rank 1's file is restored
into a target. Each case reports what went wrong, or True.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import traceback
from collections.abc import Callable
from typing import Any

import dist_launch
import pytest
import torch

from ckptmgr import CheckpointCorruptError, CheckpointManager, PerRank, WriteOptions

WRITE = WriteOptions(chunk_size=1 << 16)  # 64 KiB checksum chunks: many per file
STEP = 1


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    work = tmp_path_factory.mktemp("read-once")
    root = work / "ckpt"
    rcs, reports = dist_launch.launch(os.path.abspath(__file__), "layout", str(root), work, 2)
    return root, rcs, reports


def test_at_the_saved_layout_each_rank_reads_its_own_files_once(launched):
    _, rcs, reports = launched
    failed = {f"rank {r.get('rank')}: {name}": result for r in reports for name, result in r.get("checks", {}).items()
              if result is not True}
    assert not failed, "\n".join(f"{k}: {v}" for k, v in failed.items())
    assert rcs == [0, 0]
    for r in reports:
        own = r["own_bytes"]
        assert own > 1 << 20  # (the shard is large enough for a header read to be small beside it)
        for case in ("target", "device"):
            got = r["bytes_read"][case]
            # every byte of the rank's own files, once; beyond that, only their headers' checks
            assert own <= got <= own * 1.05, f"rank {r['rank']}, restore({case}): read {got} bytes of {own}"


class _NoDeviceRoom:
    """The restorer's read (:class:`ckptmgr.distributed.restore.Restorer`) on a GPU that has
    no room for a rank's files beside its target: a read into fresh memory fails as the
    allocator does; reads into the target are not expected here."""

    def __init__(self) -> None:
        self.fresh = 0

    def read(self, source: Any, step: int, manifest: Any, device: torch.device, loader: str, images: Any,
             dests: Any, verified: bool = False) -> dict[str, torch.Tensor]:
        assert dests is None and not verified
        self.fresh += 1
        raise torch.OutOfMemoryError("CUDA out of memory (no room beside the target)")


@pytest.mark.parametrize("damaged", [False, True])
def test_without_room_on_the_gpu_a_rank_verifies_its_files_before_anything_lands(launched, tmp_path, damaged):
    from ckptmgr.distributed.restore import _own_files, _Plan, _read_own
    from ckptmgr.format.manifest import Manifest
    from ckptmgr.storage import open_target

    root = launched[0]
    if damaged:
        shutil.copytree(root, tmp_path / "ckpt")
        root = tmp_path / "ckpt"
        _flip(str(root / f"step_{STEP:012d}" / "data-r00001-00000.safetensors"), 200_000)
    target = open_target(str(root))
    try:
        m = Manifest.from_bytes(target.read_manifest(STEP), where=str(root))
        plan = _Plan(m.rank_states[1] if m.rank_states else m.state, [], {}, [], [], {},
                     touches=True)  # a target: the files must verify first
        own = _own_files(m, plan, 1)
        restorer = _NoDeviceRoom()
        counted = _counting_target(target)
        where = f"{root}: step {STEP}"
        if damaged:
            with pytest.raises(CheckpointCorruptError, match=r"data-r00001-00000\.safetensors"):
                _read_own(restorer, target, STEP, own, plan, torch.device("cuda", 0), "auto", where)
        else:
            assert _read_own(restorer, target, STEP, own, plan, torch.device("cuda", 0), "auto", where) is None
            assert counted[0] >= sum(r.size for r in own.files.values())  # every byte read, to verify it
        assert restorer.fresh == 1
        # without a target there is nowhere else to land: the allocator's error stands
        with pytest.raises(torch.OutOfMemoryError):
            _read_own(restorer, target, STEP, own, _Plan(plan.skeleton, [], {}, [], [], {}),
                      torch.device("cuda", 0), "auto", where)
    finally:
        target.close()


# ---------------------------------------------------------------------------------------- the rank


def _fsdp(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256))
    for module in (model[0], model[2], model):
        fully_shard(module)
        module.set_force_sum_reduction_for_comms(True)  # (gloo has no PREMUL_SUM)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    model(torch.randn(8, 256, generator=g)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def _nans(mesh: Any, rank: int, zeros: bool) -> Any:
    """A bf16 DTensor, Shard(0), whose values include NaNs of several payloads and -0.0."""
    from torch.distributed.tensor import Shard, distribute_tensor

    bits = torch.arange(128 * 64, dtype=torch.int32).reshape(128, 64) * 7919 % 65536
    whole = torch.zeros(128, 64, dtype=torch.bfloat16) if zeros else bits.to(torch.int16).view(torch.bfloat16)
    return distribute_tensor(whole, mesh, [Shard(0)])


def _state(model: torch.nn.Module, opt: torch.optim.Optimizer, mesh: Any, rank: int, zeros: bool) -> dict[str, Any]:
    return {"model": model, "optim": opt, "nans": _nans(mesh, rank, zeros),
            "rank": PerRank(torch.zeros(1000) if zeros else torch.arange(1000, dtype=torch.float32) + rank),
            "step": 0 if zeros else STEP}


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _tensors(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Every tensor of ``state``'s model, optimizer and the rest, by name: this rank's local shards."""
    out = {f"model.{k}": _local(v) for k, v in state["model"].state_dict().items()}
    for i, s in state["optim"].state_dict()["state"].items():
        out.update({f"optim.{i}.{k}": _local(v) for k, v in s.items()})
    out["nans"] = _local(state["nans"])
    out["rank"] = state["rank"].value if isinstance(state["rank"], PerRank) else state["rank"]
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _differ(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> list[str]:
    if sorted(got) != sorted(want):
        return [f"names {sorted(got)} != {sorted(want)}"]
    return [k for k in want if got[k].dtype != want[k].dtype or not torch.equal(_bits(got[k]), _bits(want[k]))]


def _counting(mgr: CheckpointManager) -> list[int]:
    """Count the bytes this rank reads from the manager's storage (every read method it has)."""
    return _counting_target(mgr._target)


def _counting_target(target: Any) -> list[int]:
    """Count the bytes read from ``target`` (every read method it has)."""
    box = [0]
    read_into, read_chunk = target.read_into, getattr(target, "read_chunk", None)

    def counted_into(step: int, name: str, offset: int, out: list[Any]) -> None:
        box[0] += sum(a.size for a in out)
        read_into(step, name, offset, out)

    def counted_chunk(step: int, name: str, offset: int, buf: Any, length: int) -> str:
        box[0] += length
        assert read_chunk is not None
        return read_chunk(step, name, offset, buf, length)

    target.read_into = counted_into  # type: ignore[method-assign]
    if read_chunk is not None:
        target.read_chunk = counted_chunk  # type: ignore[method-assign]
    return box


def _flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


def _layout(root: str, rank: int, report: dict[str, Any], run: Callable[[str, Callable[[], Any]], None]) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2,))
    model, opt = _fsdp(0)
    _train(model, opt, 1)
    saved = _state(model, opt, mesh, rank, zeros=False)
    want = {k: v.clone() for k, v in _tensors(saved).items()}
    with CheckpointManager(root, write_options=WRITE) as mgr:
        mgr.save(STEP, saved).result()
    step_dir = os.path.join(root, f"step_{STEP:012d}")
    report["own_bytes"] = sum(os.path.getsize(os.path.join(step_dir, f)) for f in os.listdir(step_dir)
                              if f.startswith(f"data-r{rank:05d}-"))
    reads: dict[str, int] = {}
    report["bytes_read"] = reads

    def stepped_target() -> dict[str, Any]:
        m, o = _fsdp(5)
        _train(m, o, 50)  # moments exist, with other values
        return _state(m, o, mesh, rank, zeros=True)

    with CheckpointManager(root) as mgr:
        counted = _counting(mgr)

        def into_target() -> Any:
            target = stepped_target()
            memory = {k: v.data_ptr() for k, v in _tensors(target).items()}
            counted[0] = 0
            out = mgr.restore(STEP, target=target)
            reads["target"] = counted[0]
            got = _tensors(out)
            moved = [k for k, v in got.items() if k != "rank" and v.data_ptr() != memory[k]]
            problems = [f"other bits: {k}" for k in _differ(got, want)] + [f"not in the target: {k}" for k in moved]
            if out["step"] != STEP or out["nans"] is not target["nans"]:
                problems.append("the plain value or the DTensor's identity")
            return problems or None

        def fresh() -> Any:
            counted[0] = 0
            out = mgr.restore(STEP, device="cpu")
            reads["device"] = counted[0]
            got = {f"model.{k}": _local(v) for k, v in out["model"].items()}
            for i, s in out["optim"]["state"].items():
                got.update({f"optim.{i}.{k}": _local(v) for k, v in s.items()})
            got["nans"], got["rank"] = _local(out["nans"]), out["rank"]
            return [f"other bits: {k}" for k in _differ(got, want)] or None

        run("restore(target) at the saved layout: bit-exact, in the target's memory", into_target)
        run("restore(device) at the saved layout: bit-exact", fresh)

    def damaged() -> Any:
        copy = root + "-damaged"
        if rank == 0:  # a byte of rank 1's file, past its first chunk: only rank 1 reads it
            shutil.copytree(root, copy)
            _flip(os.path.join(copy, f"step_{STEP:012d}", "data-r00001-00000.safetensors"), 200_000)
        dist.barrier()
        target = stepped_target()
        before = {k: v.clone() for k, v in _tensors(target).items()}
        with CheckpointManager(copy) as mgr:
            try:
                mgr.restore(STEP, target=target)
            except CheckpointCorruptError as exc:
                if "data-r00001-00000.safetensors" not in str(exc):
                    return f"the error does not name the file: {exc}"
            else:
                return "no error"
        changed = _differ(_tensors(target), before)
        return f"the target changed: {changed}" if changed else None

    run("one rank's damaged chunk: every rank fails, no rank's target changes", damaged)


def main() -> None:
    import torch.distributed as dist

    scenario, root, out_path = sys.argv[1], sys.argv[2], sys.argv[3]
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    checks: dict[str, Any] = {}
    report: dict[str, Any] = {"rank": rank, "checks": checks}

    def run(name: str, fn: Callable[[], Any]) -> None:
        try:
            out = fn()
            checks[name] = True if out is None else out
        except Exception as exc:
            checks[name] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"

    try:
        if scenario == "layout":
            run("save", lambda: _layout(root, rank, report, run))
    finally:
        with open(out_path, "w") as f:
            json.dump(report, f)
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
