#!/usr/bin/env bash
# The GPU machine's run: CUDA tests, then the staging and training benchmarks.
#   bash benchmarks/gpu_suite.sh OUT_DIR [tests|coldblocks|coalesce|training-device|pinning|report|dist|reshard|staging4|staging16|training|training25|restore4|restore16|restore10k|coldread|tier|timeline|parts4|lightning|hf]...
# Packages the GPU image lacks are installed from .whl/ when present.
set -uo pipefail
out="${1:?output directory}"; shift
mkdir -p "$out"
export PYTHONUNBUFFERED=1
export KVIKIO_NTHREADS="${KVIKIO_NTHREADS:-16}"  # kvikio reads with one thread unless told
# ckptmgr as it is installed: integrations/ becomes ckptmgr.integrations (pytest runs with -P, so
# that the source tree in the working directory never shadows it)
rm -rf /tmp/ckptmgr-pkg && mkdir -p /tmp/ckptmgr-pkg && cp -r ckptmgr /tmp/ckptmgr-pkg/ \
    && cp -r integrations /tmp/ckptmgr-pkg/ckptmgr/integrations
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH="/tmp/site:/tmp/ckptmgr-pkg${PYTHONPATH:+:$PYTHONPATH}"
else
    export PYTHONPATH="/tmp/ckptmgr-pkg${PYTHONPATH:+:$PYTHONPATH}"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/machine.txt"
df -h / /dev/shm | tee -a "$out/machine.txt"
parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(tests staging4 training)
for part in "${parts[@]}"; do
  case "$part" in
    tests) python3 -P -m pytest -q -p no:cacheprovider -m cuda tests/test_cuda.py tests/test_cuda_snapshot.py tests/test_cuda_restore_trust.py tests/test_landing.py tests/test_restore_many_small.py tests/test_window_reads.py tests/test_lightning_cuda.py tests/test_tier_ram.py 2>&1 | tee "$out/tests.txt" ;;
    staging4) python3 benchmarks/bench_staging.py --gib 4 --out "$out/staging4.json" 2>&1 | tee "$out/staging4.txt" ;;
    staging16) python3 benchmarks/bench_staging.py --gib 16 --out "$out/staging16.json" 2>&1 | tee "$out/staging16.txt" ;;
    training) python3 benchmarks/bench_training.py --repeat 3 --dir /var/tmp/ckptmgr-bench-train \
              --out "$out/training.json" 2>&1 | tee "$out/training.txt" ;;
    restore4) python3 benchmarks/bench_restore.py --gib 4 --repeat 3 --disk-dir /var/tmp/ckptmgr-bench-restore \
              --out "$out/restore4.json" 2>&1 | tee "$out/restore4.txt" ;;
    restore16) python3 benchmarks/bench_restore.py --gib 16 --repeat 2 --sources shm --out "$out/restore16.json" \
              2>&1 | tee "$out/restore16.txt" ;;
    coldread) python3 benchmarks/results/h200-2026-11-23g/cold-read/cold_window.py /var/tmp/ckptmgr-coldread "$out/coldread.json" 4 \
              "fst,aio 16 512 sep pin,aio 16 512 sep pin rot=6,ckptmgr,ckptmgr CIF=3,land 16 512 32,land 16 512 192" \
              2>&1 | tee "$out/coldread.txt" ;;
    coldblocks) python3 benchmarks/results/h200-2026-11-23h/cold-read/cold_window.py /var/tmp/ckptmgr-coldread "$out/coldblocks.json" \
              "${CKPTMGR_ROUNDS:-5}" "${CKPTMGR_MODES:-fst,aio 16 512 sep pin,ckptmgr PKG=benchmarks/out/old,ckptmgr,ckptmgr SL=24,ckptmgr SL=48,ckptmgr BA=16,ckptmgr NOWORK=1}" \
              2>&1 | tee "$out/coldblocks.txt" ;;
    parts4) python3 benchmarks/bench_restore_parts.py --gib 4 --out "$out/parts4.json" 2>&1 | tee "$out/parts4.txt" ;;
    training-device) python3 benchmarks/bench_training.py --repeat 3 --modes "none,ckptmgr overlap,ckptmgr overlap+device" \
              --dir /var/tmp/ckptmgr-bench-train --out "$out/training-device.json" 2>&1 | tee "$out/training-device.txt" ;;
    training25) python3 benchmarks/bench_training.py --model linear --every 25 --steps 100 --warmup 5 \
              --modes "none,ckptmgr overlap" --repeat 3 --dir /var/tmp/ckptmgr-bench-train25 \
              --out "$out/training25.json" 2>&1 | tee "$out/training25.txt" ;;
    hf) python3 -P -m pytest -q -p no:cacheprovider -m cuda tests/test_hf_trainer.py 2>&1 | tee "$out/hf-tests.txt"
        python3 benchmarks/bench_hf_trainer.py --workdir /var/tmp --out "$out" 2>&1 | tee "$out/hf.txt" ;;
    coalesce) python3 benchmarks/bench_training.py --model linear --every 25 --steps 200 --warmup 5 \
              --modes "${CKPTMGR_COALESCE_MODES:-none,ckptmgr overlap,ckptmgr coalesce,ckptmgr coalesce+device}" \
              --repeat 3 --dir /var/tmp/ckptmgr-bench-coalesce \
              --out "$out/coalesce.json" 2>&1 | tee "$out/coalesce.txt" ;;
    pinning) python3 benchmarks/bench_pinning.py --dir /var/tmp --out "$out/pinning.json" 2>&1 | tee "$out/pinning.txt" ;;
    lightning) python3 benchmarks/bench_lightning.py --steps 60 --every 20 --repeat 3 --out "$out/lightning.json" 2>&1 | tee "$out/lightning.txt"
               python3 benchmarks/bench_torchzip.py --mib 4096 --tensors 150 --out "$out/torchzip.json" 2>&1 | tee "$out/torchzip.txt" ;;
    report) python3 benchmarks/run.py --out "$out/report" --scratch /var/tmp/ckptmgr-bench-run \
              --commit "${CKPTMGR_COMMIT:?set CKPTMGR_COMMIT to the commit of this tree (the GPU copy has no current git HEAD)}" 2>&1 | tee "$out/report.txt" ;;
    # dist + reshard: under 8 minutes together on 2 or 4 H200s (rounds stop starting after 200 s)
    dist) n=$(nvidia-smi -L | wc -l)
              NCCL_NVLS_ENABLE=0 timeout 330 python3 benchmarks/bench_distributed.py --gpus "$n" --layers 4 --rounds 3 \
              --saves 3 --max-wall-s 200 --commit "${CKPTMGR_COMMIT:-unknown}" --out "$out/distributed.json" \
              2>&1 | tee "$out/distributed.txt"; rm -rf /var/tmp/ckptmgr-bench-dist ;;
    reshard) n=$(nvidia-smi -L | wc -l); spec="${CKPTMGR_RESHARD:-$([ "$n" -ge 4 ] && echo 4:2,4 || echo 2:1,2)}"
              NCCL_NVLS_ENABLE=0 timeout 150 python3 benchmarks/bench_distributed.py --reshard "$spec" \
              --commit "${CKPTMGR_COMMIT:-unknown}" --out "$out/reshard.json" 2>&1 | tee "$out/reshard.txt"
              rm -rf /var/tmp/ckptmgr-bench-dist ;;
    tier) python3 benchmarks/bench_tier_restore.py --gib 4.5 --tensors 192 --rounds 3 --disk-dir /var/tmp \
              --out "$out/tier_restore.json" 2>&1 | tee "$out/tier_restore.txt" ;;
    timeline) python3 benchmarks/bench_timeline.py --dir /var/tmp --out "$out/timeline" 2>&1 | tee "$out/timeline.txt" ;;
    restore10k) python3 benchmarks/bench_restore.py --gib 1 --tensors 10000 --sources shm --repeat 3 \
              --tools "ckptmgr restore(device),ckptmgr restore(target),safetensors.load_file" \
              --out "$out/restore10k.json" 2>&1 | tee "$out/restore10k.txt" ;;
  esac
done
