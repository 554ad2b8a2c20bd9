"""Run the benchmarks of ckptmgr against its peers, then print the tables and draw the chart.

    python benchmarks/run.py                       # GPU if there is one, else CPU sizes
    python benchmarks/run.py --device cpu --quick  # a minute on a laptop
    python benchmarks/run.py --parts staging,restore --out /tmp/bench

Each benchmark runs in a process of its own, on the same data for every tool it compares:

* ``staging``: bench_staging.py, what a save costs the training loop and when it is durable
  (``staging-shm`` and ``staging-disk``: one target each, into the same staging.json, for
  machines that limit how long one command runs);
* ``restore``: bench_restore.py, every restore in a fresh process (onto the GPU when there is one);
* ``training``: bench_training.py, step-time overhead of checkpointing a transformer;
* ``s3``: bench_s3.py, upload to moto's S3 server with injected latency (needs ``moto``).

Each writes its JSON into ``--out`` (default benchmarks/out/report); report.py then prints a
table per metric and writes ``summary.json`` and ``chart.png`` there. A part that fails is
reported and the others still run; the exit code is non-zero if any failed.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import subprocess
import sys
import time
from typing import Any

import torch

HERE = os.path.dirname(os.path.abspath(__file__))


def _commands(device: str, quick: bool, out: str, scratch: str) -> dict[str, list[str]]:
    gpu = device.startswith("cuda")
    gib = "4" if gpu and not quick else ("1" if gpu else "0.25")
    train = [] if gpu and not quick else ["--dim", "256", "--layers", "4", "--heads", "4", "--vocab", "2000",
                                         "--batch", "8", "--seq", "128", "--steps", "12", "--warmup", "3",
                                         "--every", "4", "--repeat", "1"]
    # --quick: one round of the main peers only (a smoke run, not a measurement)
    save_tools = ["--rounds", "1", "--saves", "2", "--tools", "ckptmgr block,torch.save,safetensors.save_file"] \
        if quick else ["--rounds", "2", "--saves", "3"]
    load_tools = ["--repeat", "1", "--tools", "ckptmgr restore(device),torch.load,safetensors.load_file"] \
        if quick else ["--repeat", "3"]
    return {
        "staging": ["bench_staging.py", "--gib", gib, "--device", device, *save_tools,
                    "--shm-dir", "/dev/shm/ckptmgr-bench-run", "--disk-dir", os.path.join(scratch, "staging"),
                    "--out", os.path.join(out, "staging.json")],
        **{f"staging-{t}": ["bench_staging.py", "--gib", gib, "--device", device, *save_tools, "--targets", t,
                            "--merge", "--shm-dir", "/dev/shm/ckptmgr-bench-run",
                            "--disk-dir", os.path.join(scratch, "staging"), "--out", os.path.join(out, "staging.json")]
           for t in ("shm", "disk")},
        "restore": ["bench_restore.py", "--gib", gib, "--device", device, *load_tools,
                    "--shm-dir", "/dev/shm/ckptmgr-bench-restore", "--disk-dir", os.path.join(scratch, "restore"),
                    "--out", os.path.join(out, "restore.json")],
        "training": ["bench_training.py", "--device", device, "--dir", os.path.join(scratch, "training"),
                     *train, "--out", os.path.join(out, "training.json")],
        "s3": ["bench_s3.py", "--mib", "64" if quick else "256", "--repeat", "1" if quick else "3",
               "--out", os.path.join(out, "s3.json")],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true", help="small sizes, one repetition where possible")
    ap.add_argument("--parts", default="staging,restore,training,s3")
    ap.add_argument("--out", default=os.path.join(HERE, "out", "report"))
    ap.add_argument("--scratch", default=os.path.join(HERE, "out", "scratch"), help="where checkpoints are written")
    ap.add_argument("--commit", default=None, help="the commit to record (default: git rev-parse HEAD)")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    sys.path.insert(0, HERE)
    from common import commit as head

    commit = args.commit or head()
    gpu = torch.cuda.get_device_name() if args.device.startswith("cuda") else None
    run: dict[str, Any] = {"date": time.strftime("%Y-%m-%d"), "host": platform.node(), "commit": commit,
                           "torch": torch.__version__, "device": gpu or f"cpu ({os.cpu_count()} cores)", "parts": {}}
    commands = _commands(args.device, args.quick, args.out, args.scratch)
    failed = []
    for part in args.parts.split(","):
        if part not in commands:
            ap.error(f"unknown part {part!r}; choose from {', '.join(commands)}")
        if part == "s3" and importlib.util.find_spec("moto") is None:
            print("== s3: skipped (moto is not installed: pip install 'moto[server]')", flush=True)
            run["parts"][part] = "skipped: no moto"
            continue
        print(f"== {part}: {' '.join(commands[part])}", flush=True)
        t = time.perf_counter()
        rc = subprocess.run([sys.executable, *commands[part]], cwd=HERE,
                            env={**os.environ, "CKPTMGR_COMMIT": commit}).returncode
        run["parts"][part] = {"rc": rc, "seconds": round(time.perf_counter() - t, 1), "commit": commit}
        if rc != 0:
            failed.append(part)
            print(f"== {part}: FAILED with exit code {rc}", flush=True)
    previous = os.path.join(args.out, "run.json")  # parts run by earlier calls into the same --out
    if os.path.exists(previous):  # (each part names the commit it ran at)
        with open(previous) as f:
            earlier = json.load(f).get("parts", {})
        run["parts"] = {**{k: {"commit": "?", **v} if isinstance(v, dict) else v for k, v in earlier.items()},
                        **run["parts"]}
    with open(os.path.join(args.out, "run.json"), "w") as f:
        json.dump(run, f, indent=1)
    sys.path.insert(0, HERE)
    import report

    rc = report.main([args.out])
    if failed:
        print(f"failed parts: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else rc


if __name__ == "__main__":
    sys.exit(main())
