"""zeroshard's point-to-point transport on gloo against gloo's own collectives, paired.

    python -m benchmarks gloo_transport                       # 2 and 3 ranks, 13.8 MB and 1 MB
    python -m benchmarks gloo_transport --world-sizes 2 --mb 13.8 --turns 40

What csrc/gloo_p2p.{h,cpp} ([Note: gloo algorithms]) is kept for has to be
measured against what c10d would run without it, in the same process group and
the same turns: each turn times, in a rotated order, on the same fp32 buffer

* reduce-scatter: zeroshard's (``input_is_scratch`` False and True: whole
  chunks, or landing in sent chunks at 3+ ranks; and in place with
  ``input_is_scratch``, as the library's buckets and units run it, in pieces
  when the chunk is large) against gloo's own
  ``reduce_scatter_tensor`` and against ``all_reduce`` (what a reduce-scatter
  on gloo costs at the least without the transport);
* all-gather in place: zeroshard's against gloo's ``all_gather_into_tensor``;

and prints, per world size and size, the median time of each and the median
over turns of each one's time over gloo's own in the same turn, with the
scratch each zeroshard reduce-scatter holds in flight. Rank 0 prints.
"""

from __future__ import annotations

import os
import statistics
import time

import torch
import torch.distributed as dist

from benchmarks.harness import opt, paired_ratio, paired_times, spawn


def _timed(fn) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _cases(numel: int, world: int):
    """name -> a function running one collective on fresh-enough buffers."""
    import zeroshard as zs

    n = numel // world
    flat = torch.randn(n * world)
    scratch = flat.clone()
    out = torch.empty(n)
    gathered = torch.randn(n * world)
    rank = dist.get_rank()

    def zs_rs(scratch_input: bool):
        def run():
            src = scratch if scratch_input else flat
            if scratch_input:
                src.copy_(flat)
            zs.reduce_scatter(src, out, average=False, input_is_scratch=scratch_input).wait()

        return run

    def zs_rs_in_place():  # what the library's own buckets and units run: the output is the input's chunk
        scratch.copy_(flat)
        zs.reduce_scatter(scratch, scratch[rank * n : (rank + 1) * n], average=False, input_is_scratch=True).wait()

    def gloo_rs():
        dist.reduce_scatter_tensor(out, flat)

    def gloo_ar():
        scratch.copy_(flat)
        dist.all_reduce(scratch)

    def zs_ag():
        zs.all_gather(gathered[rank * n : (rank + 1) * n], gathered).wait()

    def gloo_ag():
        dist.all_gather_into_tensor(gathered, gathered[rank * n : (rank + 1) * n].clone())

    def copy_only():  # the copy the scratch and in-place cases and gloo_ar make first, timed alone
        scratch.copy_(flat)

    return {
        "rs zeroshard": zs_rs(False),
        "rs zeroshard scratch": zs_rs(True),
        "rs zeroshard in place": zs_rs_in_place,
        "rs gloo": gloo_rs,
        "rs gloo all_reduce": gloo_ar,
        "copy": copy_only,
        "ag zeroshard": zs_ag,
        "ag gloo": gloo_ag,
    }


def _worker(rank: int, world: int, port: int, out, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    import zeroshard as zs

    try:
        for mb in args.mb:
            numel = int(mb * 2**20 / 4) // world * world
            cases = _cases(numel, world)
            times = paired_times(cases, args.turns, args.warmup, timer=_timed)
            if rank == 0:
                n = numel // world
                scratch = {
                    s: zs.comm.reduce_scatter_scratch_bytes(
                        n, 4, world, in_place=s == "in place", input_is_scratch=s != "kept"
                    )
                    for s in ("kept", "scratch", "in place")
                }
                out.put((world, mb, times, scratch))
    finally:
        dist.destroy_process_group()


OPTIONS = [
    opt("--world-sizes", default="2,3"),
    opt("--mb", default="13.8,1", help="buffer sizes in MB (fp32)"),
    opt("--turns", type=int, default=30),
    opt("--warmup", type=int, default=3),
]


def run(args):
    args.mb = [float(x) for x in args.mb.split(",")]
    results = []
    for world in (int(w) for w in args.world_sizes.split(",")):
        for world_, mb, times, scratch in spawn(_worker, world, args, every=True):
            print(
                f"\nworld size {world_}, {mb} MB fp32 buffer, {args.turns} turns (median ms; ratio: median per turn "
                "over gloo's own in the same turn)"
            )
            for k, ts in times.items():
                base = times["ag gloo" if k.startswith("ag") else "rs gloo"]
                ratio = paired_ratio(ts, base) if k != "copy" else float("nan")
                print(f"  {k:22s} {1e3 * statistics.median(ts):8.2f} ms   x{ratio:5.2f}")
            print(
                f"  reduce-scatter scratch in flight: {scratch['kept']} B (input kept), {scratch['scratch']} B "
                f"(input_is_scratch), {scratch['in place']} B (in place, input_is_scratch)"
            )
            results.append(dict(world=world_, mb=mb, times_s=times, scratch_bytes=scratch))
    return dict(turns=args.turns, warmup=args.warmup, results=results)
