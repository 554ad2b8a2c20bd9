"""Where a cold restore's time goes: ckptmgr ``restore(device)`` beside ``restore(target)``,
fastsafetensors and torch.load, each run a fresh process after the page cache of every file
is dropped, the tool order shuffled each round (seeded) so that each tool follows each other:

    python benchmarks/results/h200-2026-11-23i/trace/trace_restore.py DIR OUT.json ROUNDS [TOOLS]

TOOLS (comma-separated; default all):
  device     ckptmgr restore(device="cuda") into fresh memory (as bench_restore.py)
  target     ckptmgr restore(target=...) into tensors made before the clock (as bench_restore.py)
  device+c   restore(device) after 4 GiB were allocated and freed before the clock (kept by
             torch's caching allocator, so the step's allocation costs no cudaMalloc)
  fst        fastsafetensors (nogds), as bench_restore.py runs it
  torch.load torch.load of a torch.save copy (map_location cuda)

The ckptmgr runs record marks (seconds from the clock's start) by wrapping the restore's
phases: the manager made, the landing plan (allocation; synchronized), the queue of direct
reads, the chunk pipeline, the finish, the restore's return, the manager closed, the final
synchronize. Each run records the tool that ran before it. Prints a table, writes JSON.
"""
import json
import os
import random
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
BENCH = os.path.abspath(os.path.join(HERE, "..", "..", ".."))
sys.path.insert(0, BENCH)

import bench_restore as br  # noqa: E402
import torch  # noqa: E402

DEV = os.environ.get("TRACE_DEVICE", "cuda")  # cpu: a smoke test of the harness
CUDA = DEV == "cuda"


def sync():
    if CUDA:
        torch.cuda.synchronize()


TOOLS = ["device", "target", "device+c", "fst", "torch.load"]


def child(tool, step_dir, torch_path, shapes_path):
    if CUDA:
        torch.cuda.init()
    torch.empty(1, device=DEV)
    with open(shapes_path) as f:
        meta = json.load(f)
    target = None
    if tool == "target":
        target = {k: torch.empty(s, dtype=getattr(torch, d), device=DEV) for k, (d, s) in meta["shapes"].items()}
    if tool == "device+c":
        x = torch.empty(4 << 30, dtype=torch.uint8, device=DEV)
        del x  # (the caching allocator keeps the segment)
    marks = {}
    t0 = [0.0]

    def mark(name):
        marks[name] = round(time.perf_counter() - t0[0], 4)

    if tool in ("device", "target", "device+c"):
        import ckptmgr.restore.loaders.ring as rg
        from ckptmgr import CheckpointManager, StagingOptions

        def wrap(name, sync=False, sync_=sync):
            fn = getattr(rg, name)

            def inner(*a, **kw):
                mark(name + ">")
                try:
                    return fn(*a, **kw)
                finally:
                    if sync:
                        sync_()
                    mark(name + "<")
            setattr(rg, name, inner)

        wrap("_plan_all", sync=True)
        wrap("_windowed")
        wrap("_pipeline")
        wrap("_finish")
        root = os.path.dirname(step_dir)

        def load():
            m = CheckpointManager(root, staging=StagingOptions(local_tier=False))
            mark("manager")
            try:
                out = m.restore(1, target=target) if tool == "target" else m.restore(1, device=DEV)
                mark("restored")
            finally:
                m.close()
                mark("closed")
            return out
    else:
        load = br._loader({"fst": "fastsafetensors (nogds)", "torch.load": "torch.load"}[tool], step_dir,
                          torch_path, DEV, None)
    t0[0] = time.perf_counter()
    out = load()
    sync()
    took = time.perf_counter() - t0[0]
    got = br.fingerprint(out)
    del out
    for fn in br._after:
        fn()
    return {"tool": tool, "s": took, "marks": marks, "identical": got == meta["crc"]}


def main():
    if sys.argv[1] == "child":
        print("RESULT " + json.dumps(child(*sys.argv[2:6])), flush=True)
        return
    d, out_path, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3])
    tools = sys.argv[4].split(",") if len(sys.argv) > 4 else TOOLS
    import shutil

    from bench_staging import make_state

    from ckptmgr import CheckpointManager, StagingOptions
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    state = make_state(float(os.environ.get("TRACE_GIB", "4")), DEV)
    cpu_state = {k: v.cpu() for k, v in state.items()}
    meta = {"shapes": {k: (str(v.dtype).removeprefix("torch."), list(v.shape)) for k, v in cpu_state.items()},
            "crc": br.fingerprint(cpu_state)}
    with CheckpointManager(os.path.join(d, "root"), staging=StagingOptions(local_tier=False)) as m:
        m.save(1, state).result()
    torch_path = os.path.join(d, "state.pt")
    torch.save(cpu_state, torch_path)
    shapes = os.path.join(d, "shapes.json")
    with open(shapes, "w") as f:
        json.dump(meta, f)
    del state, cpu_state
    if CUDA:
        torch.cuda.empty_cache()
    step_dir = os.path.join(d, "root", "step_000000000001")
    files = [*br.data_files(step_dir), torch_path]
    runs, prev = [], None
    for r in range(rounds):
        order = list(tools)
        random.Random(r).shuffle(order)
        for tool in order:
            br.drop_cache(files)
            p = subprocess.run([sys.executable, os.path.abspath(__file__), "child", tool, step_dir, torch_path, shapes],
                               capture_output=True, text=True, timeout=600)
            line = next((x for x in p.stdout.splitlines() if x.startswith("RESULT ")), None)
            err = (p.stderr.strip().splitlines() or ["?"])[-1]
            res = json.loads(line[7:]) if line else {"tool": tool, "error": err}
            res["round"], res["after"] = r, prev
            prev = tool
            runs.append(res)
            print(f"  r{r} {tool:10s} after {res['after']!s:10s} "
                  + (f"{res['s']:.3f} s {'' if res['identical'] else 'NOT IDENTICAL '}{res['marks']}"
                     if "s" in res else res["error"]), flush=True)
    print("\n| tool | median s | min-max | runs |\n|---|---|---|---|")
    summary = {}
    for tool in tools:
        secs = [x["s"] for x in runs if x["tool"] == tool and "s" in x]
        if secs:
            summary[tool] = {"median_s": statistics.median(secs), "min_s": min(secs), "max_s": max(secs),
                             "n": len(secs)}
            print(f"| {tool} | {statistics.median(secs):.3f} | {min(secs):.3f}-{max(secs):.3f} | {len(secs)} |")
    with open(out_path, "w") as f:
        json.dump({"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name() if CUDA else "cpu",
                   "torch": torch.__version__, "summary": summary, "runs": runs}, f, indent=1)
    shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()
