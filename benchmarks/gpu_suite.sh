#!/usr/bin/env bash
# The GPU machine's run: the CUDA tests and the product benchmarks, each mode writing JSON and a
# table under OUT_DIR (every measurement in fresh processes, the tool order rotated between
# rounds, several rounds with their spread).
#
#   bash benchmarks/gpu_suite.sh [--device cpu] [--gib G] OUT_DIR MODE[@old]...
#
# Modes:
#   tests      the CUDA test suite (the tests marked cuda, in every test file that has some)
#   loadfile   a G GiB (default 4) bf16 file written by safetensors in /dev/shm, loaded onto the GPU by
#              ckptmgr.load_file, fastsafetensors (nogds; skipped with a note where it cannot be
#              imported) and safetensors.load_file: seconds, GB/s, peak host memory growth
#   inplace    benchmarks/bench_inplace.py where the tree has it (extra arguments: $CKPTMGR_INPLACE_ARGS)
#   budget     24 x Linear(4096) + fused AdamW (4.83 GB of state), a save every 25 steps, 100 timed
#              steps with the first save inside: none, the default options, Schedule(continuous=True),
#              Schedule(max_lost_s=$CKPTMGR_MAX_LOST_S, default 2); Schedule(max_overhead=0.01) over 400
#              steps (budget-long.json); then the decoder (bench_training.py's default model) with a save
#              every 10 steps ($CKPTMGR_BUDGET_PARTS: some of linear,long,decoder; default all three)
#   staging    save stall and durable time of a G GiB state to /dev/shm and to the disk
#              (ckptmgr overlap; other tools with CKPTMGR_STAGING_TOOLS)
#   restore    restore of a G GiB state from /dev/shm and from a cold disk (ckptmgr against
#              fastsafetensors, with the disk's read ceiling measured in the same run; restore@old:
#              ckptmgr alone)
#   tier       restore from the /dev/shm local tier after a SIGKILL, in a fresh process
#   tiersettled  the same, the restore started once the manager's adoption of the slot has ended
#              (a job that builds its model between the open and the restore)
#   lightning  per-save cost of the Lightning plugin (30 steps, a save every 10; the peers with
#              CKPTMGR_LIGHTNING_PLUGINS="TorchCheckpointIO (Lightning default),AsyncCheckpointIO(TorchCheckpointIO),CkptmgrCheckpointIO")
#   hf         per-save cost of the Hugging Face Trainer integration against the stock Trainer
#              (extra arguments: $CKPTMGR_HF_ARGS, e.g. "--steps 100 --save-steps 25" for a shorter run;
#              hf@old: the baseline and ckptmgr, the stock Trainer runs once a call, beside this tree)
#   dist       FSDP2 save and restore against torch.distributed.checkpoint (needs 2 GPUs or more;
#              rounds stop starting after $CKPTMGR_DIST_WALL_S seconds, default 200; dist@old runs
#              ckptmgr alone: DCP runs once a call, beside this tree)
#   reshard    FSDP2 saved at one world size, restored at others, against DCP (needs 2 GPUs or more)
#   peer       the peer tier (bench_peer_tier.py, needs 2 GPUs or more; the GPUs as two simulated nodes):
#              replication overhead at a save every 25 of 100 steps, time until replicated, the lost
#              node's recovery from peers (NCCL, gloo) against the cold durable target, with its phases
#
# MODE@old runs the mode against another source tree, $CKPTMGR_OLD (default .old in the working
# directory; make it with `mkdir .old && git archive 6960b87 | tar -x -C .old`): the same
# benchmark scripts (this tree's, so that both trees are measured alike) with the old tree's
# package, writing NAME-old.json / NAME-old.txt beside this tree's. Two exceptions: tests@old runs
# the old tree's own tests, and budget@old the old tree's own bench_training.py with the default
# options only (the old package has no budget schedules and refuses StagingOptions(slots=None)).
#
# Rounds: $CKPTMGR_ROUNDS (default 3). Commit recorded: $CKPTMGR_COMMIT for this tree (the GPU copy
# has no git HEAD), $CKPTMGR_OLD_COMMIT (default 6960b87) for the old one. Packages the GPU image
# lacks (fastsafetensors, ...) are installed from .whl/ when present. Seconds per mode go to
# OUT_DIR/timings.txt.
#
# CPU smoke test of every mode (tiny sizes, no GPU):
#   bash benchmarks/gpu_suite.sh --device cpu --gib 0.01 /tmp/suite loadfile budget staging restore tier ...
set -uo pipefail
device=cuda
gib=4
while [[ $# -gt 0 && $1 == --* ]]; do
  case "$1" in
    --device) device="$2"; shift 2 ;;
    --gib) gib="$2"; shift 2 ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
done
out="${1:?output directory}"; shift
mkdir -p "$out" && out="$(cd "$out" && pwd)"
here="$(pwd)"
old="${CKPTMGR_OLD:-$here/.old}"
rounds="${CKPTMGR_ROUNDS:-3}"
scratch="${CKPTMGR_SCRATCH:-/var/tmp/ckptmgr-suite}"
export PYTHONUNBUFFERED=1
export KVIKIO_NTHREADS="${KVIKIO_NTHREADS:-16}"  # kvikio reads with one thread unless told
site=""
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  site="/tmp/site"
fi
if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/machine.txt"
  gpus=$(nvidia-smi -L | wc -l)
else
  echo "no nvidia-smi: $device" | tee "$out/machine.txt"
  gpus=0
fi
df -h / /dev/shm | tee -a "$out/machine.txt"
small=""  # tiny models and sizes on the CPU: a smoke test of the scripts, not a measurement
[ "$device" = cpu ] && small=1

# A tree's ckptmgr as it is installed: integrations/ becomes ckptmgr.integrations (pytest runs with
# -P, so that the source tree in the working directory never shadows it).
package() {  # TREE NAME -> the directory to put on PYTHONPATH
  local dest="/tmp/ckptmgr-pkg-$2"
  rm -rf "$dest" && mkdir -p "$dest" && cp -r "$1/ckptmgr" "$dest/" && cp -r "$1/integrations" "$dest/ckptmgr/integrations"
  echo "$dest"
}

# One mode, run in this tree's directory with the package on PYTHONPATH.
# $1 mode, $2 file tag ("" or "-old"), $3 1 when the tree is the old one, $4 the tree.
mode() {
  local m="$1" t="$2" is_old="$3" tree="$4" r="$rounds" o="$out/$1$2"
  case "$m" in
    tests)
      # every test file with CUDA tests (marked cuda), found by their mark
      cd "$tree" && python3 -P -m pytest -q -p no:cacheprovider -m cuda $(grep -l "mark.cuda" tests/test_*.py) 2>&1 \
        | tee "$o.txt" ;;
    loadfile)
      python3 benchmarks/bench_restore.py --writer safetensors --dtype bf16 --gib "$gib" --sources shm \
        --repeat "$r" --device "$device" --shm-dir "/dev/shm/ckptmgr-suite-loadfile$t" --out "$o.json" 2>&1 | tee "$o.txt" ;;
    inplace)
      if [ -f benchmarks/bench_inplace.py ]; then
        # shellcheck disable=SC2086  # the extra arguments are words
        python3 benchmarks/bench_inplace.py ${CKPTMGR_INPLACE_ARGS:-} --out "$o.json" 2>&1 | tee "$o.txt"
      else
        echo "inplace: no benchmarks/bench_inplace.py in $(pwd): skipped" | tee "$o.txt"
      fi ;;
    budget)
      local modes="none,ckptmgr overlap,ckptmgr continuous,ckptmgr lost" lin=() dec=() long=(--steps 400)
      local script=benchmarks/bench_training.py
      [ "$is_old" = 1 ] && modes="none,ckptmgr overlap" script="$tree/benchmarks/bench_training.py"
      [ -n "$small" ] && lin=(--dim 64 --layers 2 --batch 8 --steps 20 --every 5) \
                      && dec=(--dim 64 --layers 2 --heads 2 --vocab 128 --seq 16 --batch 2 --steps 20 --every 5)
      local extra=(); [ "$is_old" = 1 ] || extra=(--max-lost-s "${CKPTMGR_MAX_LOST_S:-2}")
      local parts=",${CKPTMGR_BUDGET_PARTS:-linear,long,decoder},"
      [[ $parts == *,linear,* ]] && python3 "$script" --model linear --every 25 --steps 100 --warmup 5 \
        --modes "$modes" --repeat "$r" --device "$device" --dir "$scratch/budget" "${extra[@]}" "${lin[@]}" \
        --out "$o.json" 2>&1 | tee "$o.txt"
      [ "$is_old" = 1 ] && return 0  # the budget schedule and the decoder: this tree only
      [ -n "$small" ] && long=(--steps 40)
      # Schedule(max_overhead=0.01) over 400 steps: at ~0.05 s a save and 53 ms steps, its budget
      # allows a save every ~100 steps, so 100 steps would measure the first save alone
      [[ $parts == *,long,* ]] && python3 "$script" --model linear --every 25 --warmup 5 \
        --modes "none,ckptmgr budget" --repeat "$r" --device "$device" --dir "$scratch/budget" "${lin[@]}" \
        "${long[@]}" --out "$out/budget-long$t.json" 2>&1 | tee "$out/budget-long$t.txt"
      [[ $parts == *,decoder,* ]] && python3 "$script" --every 10 --modes "none,ckptmgr overlap" --repeat "$r" \
        --device "$device" --dir "$scratch/decoder" "${dec[@]}" --out "$out/decoder$t.json" 2>&1 \
        | tee "$out/decoder$t.txt"
      return 0 ;;
    staging)
      python3 benchmarks/bench_staging.py --gib "$gib" --rounds "$r" --saves 3 --device "$device" \
        --tools "${CKPTMGR_STAGING_TOOLS:-ckptmgr overlap}" --targets shm,disk \
        --shm-dir "/dev/shm/ckptmgr-suite-staging" --disk-dir "$scratch/staging" --out "$o.json" 2>&1 | tee "$o.txt" ;;
    restore)  # (restore@old: ckptmgr alone; fastsafetensors runs once a call, beside this tree)
      local tools="ckptmgr restore(target),fastsafetensors (nogds)"; [ "$is_old" = 1 ] && tools="ckptmgr restore(target)"
      python3 benchmarks/bench_restore.py --gib "$gib" --repeat "$r" --device "$device" --sources shm,disk \
        --tools "$tools" \
        --shm-dir /dev/shm/ckptmgr-suite-restore --disk-dir "$scratch/restore" --out "$o.json" 2>&1 | tee "$o.txt" ;;
    tier)
      local tg="4.5"; [ -n "$small" ] && tg="$gib"
      python3 benchmarks/bench_tier_restore.py --gib "$tg" --tensors 192 --rounds "$r" --device "$device" \
        --disk-dir "$scratch" --out "$o.json" 2>&1 | tee "$o.txt" ;;
    tiersettled)
      local tg="4.5"; [ -n "$small" ] && tg="$gib"
      python3 benchmarks/bench_tier_restore.py --gib "$tg" --tensors 192 --rounds "$r" --device "$device" \
        --disk-dir "$scratch" --after-adoption --out "$o.json" 2>&1 | tee "$o.txt" ;;
    lightning)
      local q=(); [ -n "$small" ] && q=(--quick)
      python3 benchmarks/bench_lightning.py --steps 30 --every 10 --repeat "$r" "${q[@]}" --dir "$scratch/lightning" \
        --plugins "${CKPTMGR_LIGHTNING_PLUGINS:-CkptmgrCheckpointIO}" --out "$o.json" 2>&1 | tee "$o.txt" ;;
    hf)
      local q=(); [ -n "$small" ] && q=(--tiny --cpu --steps 12 --save-steps 4)
      local hm=none,stock,ckptmgr; [ "$is_old" = 1 ] && hm=none,ckptmgr  # (the stock Trainer runs once a call)
      # shellcheck disable=SC2086  # the extra arguments are words
      python3 benchmarks/bench_hf_trainer.py --rounds "$r" --modes "$hm" "${q[@]}" ${CKPTMGR_HF_ARGS:-} \
        --workdir "$scratch" --out "$o" 2>&1 | tee "$o.txt" ;;
    dist|reshard)
      local n="$gpus" dev=cuda q=()
      [ -n "$small" ] && n=2 dev=cpu q=(--width 256 --layers 2)
      if [ "$n" -lt 2 ]; then
        echo "$m: needs 2 GPUs or more, this machine has $n: skipped" | tee "$o.txt"
      elif [ "$m" = dist ]; then  # rounds stop starting after 200 s
        local tools=ckptmgr,DCP; [ "$is_old" = 1 ] && tools=ckptmgr  # (DCP runs once a call, with this tree)
        NCCL_NVLS_ENABLE=0 timeout 330 python3 benchmarks/bench_distributed.py --gpus "$n" --modes fsdp2 --layers 4 \
          --rounds "$r" --saves 3 --max-wall-s "${CKPTMGR_DIST_WALL_S:-200}" --device "$dev" "${q[@]}" --dir "$scratch/dist" \
          --tools "$tools" \
          --commit "$CKPTMGR_COMMIT" --out "$o.json" 2>&1 | tee "$o.txt"
      else
        local spec="${CKPTMGR_RESHARD:-$([ "$n" -ge 4 ] && echo 4:2,4 || echo 2:1,2)}"
        NCCL_NVLS_ENABLE=0 timeout 150 python3 benchmarks/bench_distributed.py --reshard "$spec" --device "$dev" \
          "${q[@]}" --dir "$scratch/dist" --commit "$CKPTMGR_COMMIT" --out "$o.json" 2>&1 | tee "$o.txt"
      fi
      rm -rf "$scratch/dist" ;;
    peer)
      local n="$gpus" q=(--device cuda --width 4096 --layers 8 --steps 100 --every 25)
      [ -n "$small" ] && n=2 q=(--device cpu --nproc 2 --width 256 --layers 2 --batch 16 --steps 20 --every 5)
      if [ "$n" -lt 2 ]; then
        echo "$m: needs 2 GPUs or more, this machine has $n: skipped" | tee "$o.txt"
      elif [ -n "$small" ]; then
        timeout 300 python3 benchmarks/bench_peer_tier.py --ranks-per-node 1 "${q[@]}" --rounds "$r" \
          --dir "$scratch/peer" --out "$o.json" 2>&1 | tee "$o.txt"
      else
        NCCL_NVLS_ENABLE=0 timeout 500 torchrun --nproc-per-node "$n" benchmarks/bench_peer_tier.py \
          --ranks-per-node $((n / 2)) "${q[@]}" --rounds "$r" --dir "$scratch/peer" --out "$o.json" 2>&1 | tee "$o.txt"
      fi
      rm -rf "$scratch/peer" ;;
    *) echo "unknown mode $m" >&2; return 2 ;;
  esac
}

new_pkg="$(package "$here" new)"
old_pkg=""
this_commit="${CKPTMGR_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(tests)
for part in "${parts[@]}"; do
  name="${part%@old}"
  if [ "$name" != "$part" ]; then
    if [ ! -d "$old/ckptmgr" ]; then
      echo "$part: no old tree at $old (CKPTMGR_OLD): skipped" | tee -a "$out/timings.txt"
      continue
    fi
    [ -n "$old_pkg" ] || old_pkg="$(package "$old" old)"
    tree="$old" pkg="$old_pkg" tag="-old" is_old=1 commit="${CKPTMGR_OLD_COMMIT:-6960b87}"
  else
    tree="$here" pkg="$new_pkg" tag="" is_old=0 commit="$this_commit"
  fi
  start=$SECONDS
  mkdir -p "$scratch"
  (export CKPTMGR_COMMIT="$commit" PYTHONPATH="${site:+$site:}$pkg${PYTHONPATH:+:$PYTHONPATH}" \
     && mode "$name" "$tag" "$is_old" "$tree")
  rm -rf "$scratch"
  echo "$part: $((SECONDS - start)) s ($commit)" | tee -a "$out/timings.txt"
done
