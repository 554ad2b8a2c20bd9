"""One rank of a multi-rank job on gloo (CPU), for tests/test_distributed.py.

    python tests/dist_worker.py SCENARIO ROOT OUT_JSON   (RANK, WORLD_SIZE, MASTER_ADDR/PORT set)

Scenarios:
  save      train a DDP-like replicated model (same seed on every rank) with per-rank RNG and
            loader position; save steps 1..3; report what each rank wrote
  restore   restore the newest step into fresh objects; report the restored values
  die       save step 4 without blocking, then rank 1 SIGKILLs itself while rank 0 waits
  retain    save steps 1..6 with KeepLatest(2); every rank reports steps()
  skip      rank 1 never saves step 5: rank 0's save must fail with a timeout
  mismatch  an unwrapped per-rank value: the save must fail on every rank, naming it
  resave    the README's loop: save step 1 with PerRank values (one differs between the ranks,
            one is equal on both), restore it into a fresh target with state = mgr.restore(
            target=state), save that state as step 2 and restore step 2: report what came back
"""

from __future__ import annotations

import json
import os
import signal
import sys

import torch
import torch.distributed as dist

from ckptmgr import CheckpointManager, KeepLatest, PerRank


def model_and_opt() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)  # replicated: identical on every rank
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 64))
    model[2].weight = torch.nn.Parameter(model[0].weight.t())  # tied, non-contiguous share
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(8, 64, generator=g)
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def digest(t: torch.Tensor) -> float:
    return float(t.double().sum()) + float((t.double() ** 2).sum())


def main() -> None:
    scenario, root, out = sys.argv[1], sys.argv[2], sys.argv[3]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model, opt = model_and_opt()
    torch.manual_seed(100 + rank)  # per-rank RNG stream
    report: dict = {"rank": rank}
    timeout = float(os.environ.get("CKPT_TIMEOUT", "60"))
    retention = KeepLatest(2) if scenario == "retain" else None
    mgr = CheckpointManager(root, coordination_timeout=timeout, retention=retention)
    try:
        if scenario in ("save", "retain"):
            for step in range(1, 4 if scenario == "save" else 7):
                train(model, opt, 1)
                torch.rand(3)  # advance the per-rank stream
                state = {"model": model, "optim": opt, "step": step,
                         "rank": PerRank({"rng": torch.get_rng_state(), "loader_pos": 10 * step + rank})}
                info = mgr.save(step, state).result()
                report.setdefault("bytes", []).append(info.bytes)
            mgr.wait()
            report["steps"] = mgr.steps()
            report["model"] = {k: digest(v) for k, v in model.state_dict().items()}
            report["rng"] = digest(torch.get_rng_state())
            report["loader_pos"] = 10 * 3 + rank if scenario == "save" else None
        elif scenario == "restore":
            state = {"model": model, "optim": opt, "step": 0,
                     "rank": PerRank({"rng": torch.get_rng_state().clone(), "loader_pos": -1})}
            restored = mgr.restore(target=state)
            report["step"] = restored["step"]
            report["model"] = {k: digest(v) for k, v in model.state_dict().items()}
            report["tied"] = model[2].weight.data_ptr() == model[0].weight.data_ptr()
            report["rng"] = digest(restored["rank"].value["rng"])
            report["loader_pos"] = restored["rank"].value["loader_pos"]
            report["opt_steps"] = sorted(float(s["step"]) for s in opt.state_dict()["state"].values())
        elif scenario == "die":
            train(model, opt, 1)
            handle = mgr.save(4, {"model": model, "optim": opt, "step": 4}, block=True)
            if rank == 1:
                os.kill(os.getpid(), signal.SIGKILL)
            try:
                handle.result()
                report["committed"] = True
            except Exception as exc:
                report["error"] = f"{type(exc).__name__}: {exc}"
        elif scenario == "skip":
            if rank == 0:
                try:
                    mgr.save(5, {"model": model, "step": 5}).result()
                except Exception as exc:
                    report["error"] = f"{type(exc).__name__}: {exc}"
            else:
                import time

                time.sleep(timeout + 3)
        elif scenario == "resave":
            def fresh() -> dict:
                return {"model": model, "step": 0, "rank": PerRank({"pos": -1}), "same": PerRank({"seed": 0})}

            mgr.save(1, {"model": model, "step": 1, "rank": PerRank({"pos": 10 + rank}),
                         "same": PerRank({"seed": 7})}).result()
            state = mgr.restore(target=fresh())
            report["types"] = [type(state[k]).__name__ for k in ("rank", "same")]
            try:
                mgr.save(2, {**state, "step": 2}).result()
            except Exception as exc:
                report["error"] = f"{type(exc).__name__}: {exc}"
            else:
                again = mgr.restore(2, target=fresh())
                report["pos"] = again["rank"].value["pos"]
                report["seed"] = again["same"].value["seed"]
        elif scenario == "mismatch":
            try:
                mgr.save(7, {"model": model, "loader_pos": 100 + rank}).result()
            except Exception as exc:
                report["error"] = f"{type(exc).__name__}: {exc}"
        report["files"] = sorted(os.listdir(root))
    finally:
        with open(out, "w") as f:
            json.dump(report, f)
        if scenario not in ("skip", "die"):
            mgr.close()
            dist.destroy_process_group()
        else:
            os._exit(0)  # a peer is gone: no orderly shutdown of the groups


if __name__ == "__main__":
    main()
