"""One rank of a resharding job on gloo (CPU), for tests/test_distributed_reshard.py.

    python tests/reshard_worker.py SCENARIO WORKDIR OUT_JSON   (RANK, WORLD_SIZE, MASTER_ADDR/PORT set)

Every scenario runs several cases in one launch (process start-up dominates the test time)
and reports ``checks``: case name -> True, or what went wrong.

Scenarios:
  save     (2 ranks) save the DTensor mix (WORKDIR/mix) and an FSDP2 model + AdamW trained
           3 steps (WORKDIR/fsdp), the same with an optimizer of its own state_dict format
           (WORKDIR/flat); at the same world size: a fresh optimizer gets DTensor moments and
           trains on bit-identically, a dict target gets its DTensors back, one rank's damaged
           file changes no rank's target
  restore  (any world) restore WORKDIR/mix into DTensors of every placement, PerRank with and
           without rank_map, the FSDP2 model into a fresh model and AdamW trained on against
           a single-process reference, the golden checkpoint (WORKDIR/golden) when present;
           WORKDIR/flat likewise, (3 ranks) a damaged piece only one rank reads changes no
           rank's target; save the mix again at this world size (WORKDIR/mix<world>)
  from3    (2 ranks) restore WORKDIR/mix3 (saved at 3)
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

T0 = time.perf_counter()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor  # noqa: E402

from ckptmgr import (  # noqa: E402
    CheckpointCorruptError,
    CheckpointManager,
    ConfigError,
    PerRank,
    StateMismatchError,
    WriteOptions,
)

KEEP_STEPS, MORE_STEPS = 3, 3
WRITE = WriteOptions(chunk_size=4096)  # small checksum chunks: ranged reads split files


def global_mix() -> dict[str, torch.Tensor]:
    """Every DTensor of the mix, whole; exact values."""
    return {
        "w": torch.arange(40, dtype=torch.float32).reshape(10, 4) / 4,       # even at 2
        "u": torch.arange(15, dtype=torch.float64).reshape(5, 3) - 7,        # uneven everywhere
        "c": torch.arange(24, dtype=torch.int32).reshape(4, 6),
        "e": torch.tensor([[1.5, -2.5]], dtype=torch.bfloat16),              # empty shards
        "r": torch.arange(3, dtype=torch.float32) * 3,
        "x": torch.arange(67 * 130, dtype=torch.float32).reshape(67, 130),  # 9 checksum chunks
    }


SAVED = {"w": Shard(0), "u": Shard(0), "c": Shard(1), "e": Shard(0), "r": Replicate(), "x": Shard(1)}
LAYOUTS: dict[str, Callable[[str], Any]] = {  # restored placement of each tensor, by name
    "as saved": lambda k: SAVED[k],
    "swapped": lambda k: {"w": Shard(1), "u": Shard(1), "c": Shard(0), "e": Shard(1), "r": Shard(0), "x": Shard(0)}[k],
    "replicated": lambda k: Replicate(),
}
LAYOUTS_2D: dict[str, Callable[[str], Any]] = {  # on a 2 x 2 mesh
    "2-D": lambda k: {"w": [Shard(0), Shard(1)], "u": [Shard(1), Shard(0)], "c": [Replicate(), Shard(1)],
                      "e": [Shard(0), Shard(0)], "r": [Shard(0), Replicate()], "x": [Shard(1), Shard(1)]}[k],
}


def _placements(p: Any) -> list[Any]:
    return p if isinstance(p, list) else [p]


def replicated() -> dict[str, torch.Tensor]:
    """Plain tensors, the same on every rank (a DDP model): dealt to the saving ranks."""
    return {f"p{i}": torch.arange(n, dtype=torch.float32) * (i + 1) for i, n in enumerate((700, 300, 1100, 50, 90))}


def mix_state(mesh: Any, place: Callable[[str], Any], rank: int, *, zeros: bool) -> dict[str, Any]:
    g = global_mix()
    b = torch.zeros(6) if zeros else torch.arange(6, dtype=torch.float32) - 1
    return {
        "model": {k: distribute_tensor(torch.zeros_like(v) if zeros else v, mesh, _placements(place(k)))
                  for k, v in g.items()},
        "ddp": {k: torch.zeros_like(v) if zeros else v for k, v in replicated().items()},
        "b": b, "tied": b,
        "rank": PerRank({"pos": -1 if zeros else 10 + rank, "rng": torch.zeros(4, dtype=torch.uint8) if zeros
                         else torch.arange(4, dtype=torch.uint8) + rank}),
        "step": 0 if zeros else 1,
    }


def fsdp_model(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 37), torch.nn.ReLU(), torch.nn.Linear(37, 5))
    for module in (model[0], model[2], model):
        fully_shard(module)
        module.set_force_sum_reduction_for_comms(True)  # a plain sum (gloo has no PREMUL_SUM) ...
        module.set_gradient_divide_factor(1.0)  # ... undivided: rank 0's gradient + exact zeros is rank 0's gradient
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


class FlatContainer(torch.optim.Optimizer):
    """An optimizer whose ``state_dict`` is its own format (like torchtitan's container): the
    flattened optimizer state dict of the model, over an inner AdamW that does the steps."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.inner = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        super().__init__(list(model.parameters()), {"lr": 1e-2})
        self.state = self.inner.state  # type: ignore[assignment]  (full_state reads the moments here)

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        self.inner.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none)

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        return get_optimizer_state_dict(self.model, self.inner, options=StateDictOptions(
            flatten_optimizer_state_dict=True))

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        set_optimizer_state_dict(self.model, self.inner, state_dict, options=StateDictOptions(
            flatten_optimizer_state_dict=True))


def container_model(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model, _ = fsdp_model(seed)
    return model, FlatContainer(model)


def plain_model(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 37), torch.nn.ReLU(), torch.nn.Linear(37, 5))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: range, contributes: bool = True) -> None:
    """Rank 0 trains on batch i; the other ranks take part in FSDP's collectives with a zero loss."""
    for i in steps:
        g = torch.Generator().manual_seed(1000 + i)
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 5, generator=g)
        loss = (model(x) - y).pow(2).mean()
        (loss if contributes else loss * 0).backward()
        opt.step()
        opt.zero_grad()


def full_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Parameters and AdamW moments, whole (a collective for DTensors)."""
    out = {}
    for name, p in model.named_parameters():
        out[name] = p.full_tensor() if isinstance(p, DTensor) else p.detach().clone()
        for k, v in opt.state[p].items():
            out[f"{name}.{k}"] = v.full_tensor() if isinstance(v, DTensor) else v.clone()
    return out


def reference(steps: int) -> dict[str, torch.Tensor]:
    model, opt = plain_model()
    train(model, opt, range(steps))
    return full_state(model, opt)


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool | str:
    if sorted(a) != sorted(b):
        return f"keys {sorted(a)} != {sorted(b)}"
    bad = [k for k in a if not torch.equal(a[k].float(), b[k].float())]
    return True if not bad else f"differ: {bad}"


class Checks:
    def __init__(self) -> None:
        self.results: dict[str, Any] = {}
        self.times: dict[str, float] = {}

    def run(self, name: str, fn: Callable[[], Any]) -> None:
        t0 = time.perf_counter()
        try:
            out = fn()
            self.results[name] = True if out is None else out
        except Exception as exc:
            self.results[name] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
        self.times[name] = round(time.perf_counter() - t0, 2)


def counting(mgr: CheckpointManager) -> list[int]:
    """Count the bytes this rank reads from the manager's storage."""
    box = [0]
    target = mgr._target
    real = target.read_into

    def read_into(step: int, name: str, offset: int, out: list[Any]) -> None:
        box[0] += sum(a.size for a in out)
        real(step, name, offset, out)

    target.read_into = read_into  # type: ignore[method-assign]
    return box


def check_mix(mgr: CheckpointManager, mesh: Any, place: Callable[[str], Any], rank: int, saved_world: int,
              read: list[int], reads: dict[str, int], name: str) -> Any:
    """Restore the mix into zeroed DTensors of the given layout and compare everything."""
    target = mix_state(mesh, place, rank, zeros=True)
    read[0] = 0
    out = mgr.restore(target=target, rank_map=lambda r, n: (r + 1) % n)
    reads[name] = read[0]
    problems = []
    for k, v in global_mix().items():
        got = out["model"][k]
        if not isinstance(got, DTensor) or got is not target["model"][k]:
            problems.append(f"{k} came back as {type(got).__name__}, not the target's DTensor")
        if not torch.equal(got.full_tensor(), v):
            problems.append(f"{k} has other values")
    if not torch.equal(out["b"], torch.arange(6, dtype=torch.float32) - 1) or out["tied"] is not target["tied"]:
        problems.append("the replicated tensors differ")
    if any(not torch.equal(out["ddp"][k], v) or out["ddp"][k] is not target["ddp"][k] for k, v in replicated().items()):
        problems.append("the replicated (DDP) tensors differ")
    src = (rank + 1) % saved_world
    mine = out["rank"].value
    if mine["pos"] != 10 + src or not torch.equal(mine["rng"], torch.arange(4, dtype=torch.uint8) + src):
        problems.append(f"per-rank values {out['rank']} are not rank {src}'s")
    if out["step"] != 1:
        problems.append("step")
    return problems or None


def rows_dtensor(mesh: Any, zeros: bool) -> Any:
    """One 64 KiB tensor, Shard(0): 16 rows per 4 KiB checksum chunk."""
    g = torch.arange(256 * 64, dtype=torch.float32).reshape(256, 64)
    return distribute_tensor(torch.zeros_like(g) if zeros else g, mesh, [Shard(0)]), g


def partial_dtensor(mesh: Any, rank: int) -> Any:
    from torch.distributed.tensor import Partial

    return DTensor.from_local(torch.full((3,), float(rank + 1)), mesh, [Partial()], run_check=False)


def main() -> None:
    scenario, work, out_path = sys.argv[1], sys.argv[2], sys.argv[3]
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    checks = Checks()
    report: dict[str, Any] = {"rank": rank, "world": world}
    try:
        if scenario == "save":
            scenario_save(work, mesh, rank, checks)
        elif scenario == "restore":
            scenario_restore(work, mesh, rank, world, checks, report)
        elif scenario == "from3":
            scenario_from3(work, mesh, rank, world, checks, report)
    finally:
        report["checks"] = checks.results
        report["times"] = checks.times
        report["total_s"] = round(time.perf_counter() - T0, 2)
        with open(out_path, "w") as f:
            json.dump(report, f)
        dist.destroy_process_group()


def scenario_save(work: str, mesh: Any, rank: int, checks: Checks) -> None:
    with CheckpointManager(os.path.join(work, "mix"), write_options=WRITE) as mgr:
        mgr.save(1, mix_state(mesh, SAVED.__getitem__, rank, zeros=False)).result()
    with CheckpointManager(os.path.join(work, "rows"), write_options=WRITE) as mgr:
        mgr.save(1, {"y": rows_dtensor(mesh, zeros=False)[0]}).result()
    with CheckpointManager(os.path.join(work, "partial"), write_options=WRITE) as mgr:
        mgr.save(1, {"p": partial_dtensor(mesh, rank)}).result()

        def same_layout_partial() -> Any:
            target = {"p": DTensor.from_local(torch.zeros(3), mesh, [partial_dtensor(mesh, rank).placements[0]],
                                              run_check=False)}
            out = mgr.restore(target=target)
            return None if torch.equal(out["p"].to_local(), torch.full((3,), float(rank + 1))) else "other values"

        checks.run("a Partial DTensor at the same world size", same_layout_partial)
    with CheckpointManager(os.path.join(work, "damaged"), write_options=WRITE) as mgr:
        mgr.save(1, mix_state(mesh, SAVED.__getitem__, rank, zeros=False)).result()

        def one_rank_damaged() -> Any:
            if rank == 0:  # a byte of rank 1's file: only rank 1's reads can see it
                step_dir = os.path.join(work, "damaged", "step_000000000001")
                with open(os.path.join(step_dir, "data-r00001-00000.safetensors"), "r+b") as f:
                    f.seek(5000)
                    b = f.read(1)
                    f.seek(5000)
                    f.write(bytes([b[0] ^ 0xFF]))
            dist.barrier()
            target = mix_state(mesh, SAVED.__getitem__, rank, zeros=True)
            try:
                mgr.restore(1, target=target)
            except CheckpointCorruptError as exc:
                if "data-r00001-00000.safetensors" not in str(exc):
                    return f"the error does not name the file: {exc}"
            else:
                return "no error"
            changed = [k for k, v in target["model"].items() if v.to_local().abs().sum()] + \
                [k for k, v in target["ddp"].items() if v.abs().sum()]
            return f"the target changed: {changed}" if changed else None

        checks.run("one rank's damaged file: no rank's target changes", one_rank_damaged)
    model, opt = container_model()
    train(model, opt, range(KEEP_STEPS), contributes=rank == 0)
    with CheckpointManager(os.path.join(work, "flat"), write_options=WRITE) as mgr:
        mgr.save(KEEP_STEPS, {"model": model, "optim": opt, "step": KEEP_STEPS}).result()
    model, opt = fsdp_model()
    train(model, opt, range(KEEP_STEPS), contributes=rank == 0)
    with CheckpointManager(os.path.join(work, "fsdp"), write_options=WRITE) as mgr:
        mgr.save(KEEP_STEPS, {"model": model, "optim": opt, "step": KEEP_STEPS}).result()

        def fresh_optimizer() -> Any:
            m2, o2 = fsdp_model(seed=5)
            mgr.restore(target={"model": m2, "optim": o2, "step": 0})
            for p in m2.parameters():
                for k in ("exp_avg", "exp_avg_sq"):
                    v = o2.state[p][k]
                    if not isinstance(v, DTensor) or v.placements != p.placements or v.device_mesh != p.device_mesh:
                        return f"{k} came back as {type(v).__name__}"
            train(m2, o2, range(KEEP_STEPS, KEEP_STEPS + MORE_STEPS), contributes=rank == 0)
            got = full_state(m2, o2)
            return same(got, reference(KEEP_STEPS + MORE_STEPS)) if rank == 0 else None

        def stepped_optimizer() -> Any:
            m2, o2 = fsdp_model(seed=6)
            train(m2, o2, range(50, 51), contributes=rank == 0)  # moments exist, with other values
            mgr.restore(target={"model": m2, "optim": o2, "step": 0})
            train(m2, o2, range(KEEP_STEPS, KEEP_STEPS + MORE_STEPS), contributes=rank == 0)
            got = full_state(m2, o2)
            return same(got, reference(KEEP_STEPS + MORE_STEPS)) if rank == 0 else None

        def dict_target() -> Any:
            m2, _ = fsdp_model(seed=7)
            sd = m2.state_dict()
            out = mgr.restore(target={"model": sd, "optim": {"state": {}, "param_groups": [{}]}, "step": 0})
            if not all(isinstance(v, DTensor) and v is sd[k] for k, v in out["model"].items()):
                return f"returned {[type(v).__name__ for v in out['model'].values()]}"
            state = out["optim"]["state"]
            if not all(isinstance(v, DTensor) for s in state.values() for k, v in s.items() if k != "step"):
                return "optimizer moments are not DTensors"
            return None

        checks.run("fresh optimizer at the same world size", fresh_optimizer)
        checks.run("an optimizer of its own state_dict format at the same world size",
                   lambda: container(os.path.join(work, "flat")))
        checks.run("stepped optimizer at the same world size", stepped_optimizer)
        checks.run("dict target keeps its DTensors", dict_target)


def container(root: str) -> Any:
    """Restore the FSDP2 model and an optimizer whose state_dict is its own (flattened) format
    into fresh ones, train on, compare with the single-process reference."""
    model, opt = container_model(seed=4)
    with CheckpointManager(root) as mgr:
        mgr.restore(target={"model": model, "optim": opt, "step": 0})
    train(model, opt, range(KEEP_STEPS, KEEP_STEPS + MORE_STEPS), contributes=dist.get_rank() == 0)
    got = full_state(model, opt)
    return same(got, reference(KEEP_STEPS + MORE_STEPS)) if dist.get_rank() == 0 else None


def damage(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


def data_offset(path: str) -> int:
    """Where a safetensors file's data begins."""
    with open(path, "rb") as f:
        return 8 + int.from_bytes(f.read(8), "little")


def resharded_damaged(work: str, mesh: Any, rank: int, world: int) -> Any:
    """A copy of WORKDIR/rows (saved at 2) with a byte of row 200 flipped: at 3 ranks only
    rank 2 reads that row (rows 172-255); no rank's target may change."""
    root = os.path.join(work, f"rows-damaged{world}")
    if rank == 0:
        shutil.copytree(os.path.join(work, "rows"), root)
        f = os.path.join(root, "step_000000000001", "data-r00001-00000.safetensors")  # rows 128-255
        damage(f, data_offset(f) + (200 - 128) * 256 + 3)
    dist.barrier()
    y, _ = rows_dtensor(mesh, zeros=True)
    error: Exception | None = None
    with CheckpointManager(root) as mgr:
        try:
            mgr.restore(1, target={"y": y})
        except CheckpointCorruptError as exc:
            error = exc
    if y.to_local().abs().sum():
        return "the target changed"
    if error is None or "data-r00001-00000.safetensors" not in str(error):
        return f"the error does not name the file: {error}"
    return None


def scenario_restore(work: str, mesh: Any, rank: int, world: int, checks: Checks, report: dict[str, Any]) -> None:
    reads: dict[str, int] = {}
    report["bytes_read"] = reads
    with CheckpointManager(os.path.join(work, "mix"), write_options=WRITE) as mgr:
        read = counting(mgr)
        layouts: list[tuple[str, Any, Callable[[str], Any]]] = [(k, mesh, v) for k, v in LAYOUTS.items()]
        if world == 4:
            layouts += [(k, init_device_mesh("cpu", (2, 2)), v) for k, v in LAYOUTS_2D.items()]
        for layout, m, place in layouts:
            checks.run(f"mix from 2 at {world}, {layout}", lambda m=m, place=place, layout=layout:
                       check_mix(mgr, m, place, rank, 2, read, reads, layout))

        def no_rank_map() -> Any:
            try:
                mgr.restore(target=mix_state(mesh, SAVED.__getitem__, rank, zeros=True))
            except ConfigError as exc:
                return None if "state['rank']" in str(exc) and "rank_map" in str(exc) else str(exc)
            return "restored per-rank values at another world size without rank_map"

        def no_target() -> Any:
            out = mgr.restore(rank_map=lambda r, n: 0)
            bad = [k for k, v in global_mix().items() if not isinstance(out["model"][k], DTensor)
                   or out["model"][k].placements != (SAVED[k],) or not torch.equal(out["model"][k].full_tensor(), v)]
            return bad or None

        def wrong_shape() -> Any:
            target = mix_state(mesh, SAVED.__getitem__, rank, zeros=True)
            target["model"]["w"] = distribute_tensor(torch.zeros(12, 4), mesh, [Shard(0)])
            try:
                mgr.restore(target=target, rank_map=lambda r, n: 0)
            except StateMismatchError as exc:
                return None if "state['model']['w']: the target's global shape is [12, 4], the checkpoint's [10, 4]" \
                    in str(exc) else str(exc)
            return "no error"

        checks.run("per-rank values need rank_map", no_rank_map)
        checks.run("no target: DTensors of the saved placements on this world", no_target)
        checks.run("a target of another global shape", wrong_shape)
    with CheckpointManager(os.path.join(work, "rows"), write_options=WRITE) as mgr:
        read = counting(mgr)

        def rows() -> Any:
            y, g = rows_dtensor(mesh, zeros=True)
            mgr.restore(target={"y": y})
            reads["rows"] = read[0]
            return None if torch.equal(y.full_tensor(), g) else "other values"

        checks.run(f"a Shard(0) tensor from 2 at {world}", rows)
    if world == 3:
        checks.run("one rank's damaged piece at another world size: no rank's target changes",
                   lambda: resharded_damaged(work, mesh, rank, world))
    with CheckpointManager(os.path.join(work, "partial"), write_options=WRITE) as mgr:
        def partial() -> Any:
            try:
                mgr.restore(target={"p": distribute_tensor(torch.zeros(3), mesh, [Replicate()])})
            except ConfigError as exc:
                return None if "state['p'] was saved with placements ['P(sum)']" in str(exc) else str(exc)
            return "no error"

        checks.run("a Partial DTensor at another world size", partial)
    with CheckpointManager(os.path.join(work, "fsdp"), write_options=WRITE) as mgr:
        def fsdp() -> Any:
            model, opt = fsdp_model(seed=3)
            mgr.restore(target={"model": model, "optim": opt, "step": 0})
            train(model, opt, range(KEEP_STEPS, KEEP_STEPS + MORE_STEPS), contributes=rank == 0)
            got = full_state(model, opt)
            return same(got, reference(KEEP_STEPS + MORE_STEPS)) if rank == 0 else None

        checks.run(f"FSDP2 + AdamW from 2 at {world}, trained on", fsdp)
    checks.run(f"an optimizer of its own state_dict format from 2 at {world}",
               lambda: container(os.path.join(work, "flat")))
    with CheckpointManager(os.path.join(work, f"mix{world}"), write_options=WRITE) as mgr:
        mgr.save(1, mix_state(mesh, SAVED.__getitem__, rank, zeros=False)).result()
    if world == 4:  # a 2-D mesh checkpoint, restored at 2 by "from3"
        mesh2 = init_device_mesh("cpu", (2, 2))
        with CheckpointManager(os.path.join(work, "mesh2d"), write_options=WRITE) as mgr:
            mgr.save(1, mix_state(mesh2, LAYOUTS_2D["2-D"], rank, zeros=False)).result()
    golden = os.path.join(work, "golden")
    if os.path.isdir(golden):
        checks.run(f"golden dist-v2 (saved at 2) at {world}", lambda: legacy(golden, mesh, rank))


def legacy(golden: str, mesh: Any, rank: int) -> Any:
    """The golden checkpoint of the format before shards recorded their offsets."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden"))
    from make_golden_dist import PLACEMENTS, STEP, global_tensors

    g = global_tensors()
    place = {k: Shard(d) if kind == "S" else Replicate() for k, (kind, d) in PLACEMENTS.items()}
    dts = {k: distribute_tensor(torch.zeros_like(g[k]), mesh, [place[k]]) for k in place}
    target = {"model": {**{k: dts[k] for k in ("w", "u", "c", "e", "r")}, "b": torch.zeros(6)},
              "tied": torch.zeros(6), "big": torch.zeros(300, dtype=torch.int64),
              "optim": {"state": {0: {"step": torch.tensor(0.0), "exp_avg": dts["m"]}},
                        "param_groups": [{"lr": 0.0, "params": [0]}]},
              "rank": PerRank({"pos": 0, "rng": torch.zeros(4, dtype=torch.uint8)}), "step": 0}
    with CheckpointManager(golden) as gm:
        out = gm.restore(target=target, rank_map=lambda r, n: r % n)
    bad = [k for k in place if not torch.equal(dts[k].full_tensor(), g[k])]
    if out["step"] != STEP or out["rank"].value["pos"] != 10 + rank % 2 or not torch.equal(out["model"]["b"], g["b"]) \
            or not torch.equal(out["big"], g["big"]):
        bad.append("plain values")
    return bad or None


def scenario_from3(work: str, mesh: Any, rank: int, world: int, checks: Checks, report: dict[str, Any]) -> None:
    reads: dict[str, int] = {}
    report["bytes_read"] = reads
    with CheckpointManager(os.path.join(work, "mix3"), write_options=WRITE) as mgr:
        read = counting(mgr)
        for layout, place in LAYOUTS.items():
            checks.run(f"mix from 3 at {world}, {layout}", lambda place=place, layout=layout:
                       check_mix(mgr, mesh, place, rank, 3, read, reads, layout))
    if os.path.isdir(os.path.join(work, "mesh2d")):
        with CheckpointManager(os.path.join(work, "mesh2d"), write_options=WRITE) as mgr:
            read = counting(mgr)
            for layout, place in LAYOUTS.items():
                checks.run(f"mix from a 2 x 2 mesh at {world}, {layout}", lambda place=place, layout=layout:
                           check_mix(mgr, mesh, place, rank, 4, read, reads, "2-D " + layout))


if __name__ == "__main__":
    main()
