"""Checkpoints on S3 (or any S3-compatible store): save, list, restore.

    pip install '.[s3]'   # from a checkout of this repository (ckptmgr is not on PyPI yet)

    python examples/s3_config.py s3://my-bucket/run1 --endpoint https://s3.example.com

Credentials come from the usual places (environment, ~/.aws, instance profile); pass
``storage_options`` for anything s3fs accepts. Each file is uploaded in parts straight from
the staged buffer, ``concurrency`` parts in flight, every request retried with backoff.
"""

import argparse

import torch

from ckptmgr import CheckpointManager, KeepLatest, S3Options

ap = argparse.ArgumentParser()
ap.add_argument("root", help="s3://bucket/prefix")
ap.add_argument("--endpoint", default=None, help="endpoint URL of an S3-compatible store")
ap.add_argument("--key", default=None)
ap.add_argument("--secret", default=None)
args = ap.parse_args()

storage_options = {k: v for k, v in {"endpoint_url": args.endpoint, "key": args.key,
                                     "secret": args.secret}.items() if v is not None}
model = torch.nn.Linear(256, 256)
with CheckpointManager(args.root, retention=KeepLatest(2), storage_options=storage_options,
                       s3_options=S3Options(part_size=16 << 20, concurrency=16, max_attempts=8)) as mgr:
    for step in (100, 200, 300):
        with torch.no_grad():
            model.weight.add_(1.0)
        info = mgr.save(step, {"model": model, "step": step}).result()  # waits for the commit
        print(f"step {step}: {info.bytes} bytes committed in {info.total_s:.2f} s", flush=True)
    mgr.wait()
    print("committed steps:", mgr.steps())
    restored = mgr.restore(target={"model": torch.nn.Linear(256, 256), "step": 0})
    print("restored step", restored["step"], "identical:", torch.equal(restored["model"].weight, model.weight))
