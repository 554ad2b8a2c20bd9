"""Runs benchmarks/bench_peer_tier.py with the peer restore's transfer settings changed, to
compare settings in one call: ``CKPTMGR_PEER_KNOBS="FETCH_PIECE_BYTES=134217728,COPY_THREADS=8"``
(names of constants of :mod:`ckptmgr.distributed.peer_restore`, ``peer_transport`` or
``peer_mover``; COPY_METHOD takes a string). Same arguments as the benchmark; under torchrun too:

    CKPTMGR_PEER_KNOBS=COPY_THREADS=8 torchrun --nproc-per-node 2 benchmarks/probes/peer_knobs.py --ranks-per-node 1 ...
"""

from __future__ import annotations

import os
import runpy
import sys

from ckptmgr.distributed import peer_mover, peer_restore, peer_transport

for item in filter(None, os.environ.get("CKPTMGR_PEER_KNOBS", "").split(",")):
    name, _, value = item.partition("=")
    module = next((m for m in (peer_restore, peer_transport, peer_mover) if hasattr(m, name)), None)
    if module is None:
        raise SystemExit(f"no setting {name!r}")
    setattr(module, name, value if name == "COPY_METHOD" else int(value))
    print(f"peer_knobs: {module.__name__}.{name} = {getattr(module, name)!r}", file=sys.stderr)

benchmarks = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, benchmarks)  # (the benchmark's own imports: common.py)
sys.argv[0] = os.path.join(benchmarks, "bench_peer_tier.py")
runpy.run_path(sys.argv[0], run_name="__main__")
