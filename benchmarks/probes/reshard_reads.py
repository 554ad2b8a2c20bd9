"""How many bytes a rank reads when it restores an FSDP2 checkpoint at another world size,
against the bytes its new shards hold: the cost of reading whole checksum chunks.

    python benchmarks/reshard_reads.py [--chunks 16,4,1] [--model llama7b|llama70b]

Pure arithmetic over the checkpoint layout (no I/O, seconds on a CPU): every parameter of the
model and its two AdamW moments (fp32) is ``Shard(0)`` over the saving ranks, each rank's
shards laid out in state order as ckptmgr writes them (one stream per rank: the split into
files and the 4 KiB header add at most a chunk per file); a rank restoring at world
size M needs rows ``chunk_extent(rows, M, rank)`` of each tensor and reads the checksum chunks
(``WriteOptions.chunk_size``) that cover them. Prints the worst and the mean rank's read bytes
relative to what it needs (1.00 = no waste), per saved and restored world size and chunk size.
"""

from __future__ import annotations

import argparse

from ckptmgr.distributed.shards import chunk_extent

MODELS = {  # (hidden, intermediate, layers, vocab)
    "llama7b": (4096, 11008, 32, 32000),
    "llama70b": (8192, 28672, 80, 32000),
}


def tensors(model: str) -> list[tuple[int, int]]:
    """(rows, row bytes) of every fp32 tensor of the state, in state order: parameters, then
    each parameter's exp_avg and exp_avg_sq."""
    h, inter, layers, vocab = MODELS[model]
    params = [(vocab, h)]
    for _ in range(layers):
        params += [(h, h)] * 4 + [(inter, h), (inter, h), (h, inter), (h, 1), (h, 1)]
    params += [(h, 1), (vocab, h)]
    rows = [(r, c * 4) for r, c in params]
    return rows + [t for t in rows for _ in range(2)]


def reads(ts: list[tuple[int, int]], saved: int, world: int, chunk: int) -> list[tuple[int, int]]:
    """(bytes needed, bytes read) of each restoring rank."""
    base = []  # per saved rank: the offset of each tensor's shard in its file
    for k in range(saved):
        off, offs = 0, []
        for rows, rb in ts:
            offs.append(off)
            off += chunk_extent(rows, saved, k)[1] * rb
        base.append(offs)
    out = []
    for r in range(world):
        need = 0
        wanted: list[set[int]] = [set() for _ in range(saved)]
        for i, (rows, rb) in enumerate(ts):
            start, n = chunk_extent(rows, world, r)
            need += n * rb
            for k in range(saved):
                s0, sn = chunk_extent(rows, saved, k)
                lo, hi = max(start, s0), min(start + n, s0 + sn)
                if lo < hi:
                    b, e = base[k][i] + (lo - s0) * rb, base[k][i] + (hi - s0) * rb
                    wanted[k].update(range(b // chunk, (e - 1) // chunk + 1))
        out.append((need, sum(len(w) for w in wanted) * chunk))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama7b", choices=sorted(MODELS))
    ap.add_argument("--chunks", default="16,4,1", help="checksum chunk sizes to compare, MiB")
    ap.add_argument("--pairs", default="8:4,8:6,8:12,8:16,8:64,64:48,64:96",
                    help="saved:restored world sizes")
    args = ap.parse_args()
    ts = tensors(args.model)
    total = sum(r * b for r, b in ts)
    chunks = [int(c) for c in args.chunks.split(",")]
    print(f"{args.model}: {total / 2**30:.1f} GiB of fp32 parameters and AdamW moments, FSDP2 Shard(0)\n")
    print("| saved -> restored | needed per rank GiB | " +
          " | ".join(f"read / needed, {c} MiB chunks (worst, mean)" for c in chunks) + " |")
    print("|---|---|" + "---|" * len(chunks))
    for pair in args.pairs.split(","):
        saved, world = (int(x) for x in pair.split(":"))
        cells = []
        need = 0.0
        for c in chunks:
            per = reads(ts, saved, world, c << 20)
            need = max(n for n, _ in per) / 2**30
            ratios = [got / n for n, got in per if n]
            cells.append(f"{max(ratios):.3f}, {sum(ratios) / len(ratios):.3f}")
        print(f"| {saved} -> {world} | {need:.2f} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
