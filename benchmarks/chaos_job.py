"""The training job of the chaos run: `python -m benchmarks chaos` (benchmarks/specs/chaos.py)
launches it under torchrun.

The example GPT (``examples/train_gpt.py``, tiny) at ZeRO-3 on CPU with gloo,
started with ``zeroshard.init_distributed`` and ``zeroshard.resume``. The data
is a pure function of the step: step s trains on the same global batch of
``--global-batch`` sequences at every world size, rank r of W taking rows
r*B/W .. (r+1)*B/W, so a resumed run, at any world size, sees the same data
in the same order. Every ``--every`` steps it saves ``<run>/ckpt/step_<k>``,
blocking and in the background in turn (a background save overlaps the next
step's forward and backward; its ``result()`` is taken before that step's
update, so at most ``--every`` steps are ever lost), and keeps the newest two.

Kills. The file ``$CHAOS_PLAN`` gives, per attempt (torchrun's restart count), the
rank that SIGKILLs itself and where: ``forward`` / ``backward`` (when block
``at`` runs forward, or when its output's gradient arrives in backward, in
the attempt's ``after``-th step), ``step`` (at a call ``clip_grad_norm_`` + ``step()`` make, the ``frac``
part of the way through them: the calls of the previous step are counted),
``save`` / ``background save`` (at the ``at``-th ``os.fsync`` of the first save
of that kind after ``after`` steps: a rank file, an extra file, the manifest,
a directory), ``load`` (at the ``at``-th block read of ``resume``'s load).
A kill records its phase as it happens; a planned point that never comes (no
checkpoint to load) is taken at the next step's forward instead, and
recorded so. ``driver`` entries are the driver's kills at a wall-clock time.

Every rank appends one JSON line per event to ``<run>/events.jsonl``:
``start`` (pid), ``resumed`` (the step, and rank 0's own check of every
checkpoint directory), ``step`` (steps completed), ``saved``, ``kill``,
``error`` (an exception that ended the rank), ``done``.

    torchrun --nproc-per-node 2 --max-restarts 3 benchmarks/chaos_job.py --run-dir RUN_DIR
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import time
import warnings
import zlib

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))
from train_gpt import Block, CharData, build_model, make_corpus  # noqa: E402


class Events:
    """One JSON line per event, appended (O_APPEND: whole lines) to the run's log."""

    def __init__(self, path: str, **fields):
        self.fd, self.fields = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644), fields

    def __call__(self, ev: str, **data):
        line = json.dumps(dict(ev=ev, t=time.time(), **self.fields, **data)) + "\n"
        os.write(self.fd, line.encode())


class Killer:
    """This rank's planned kill, if any, and the hooks that SIGKILL the process where it says."""

    def __init__(self, plan, rank: int, log: Events):
        self.plan = plan if plan and plan.get("rank") == rank and plan["phase"] != "driver" else None
        self.log, self.steps, self.fsyncs, self.reads, self.calls = log, 0, 0, 0, 0
        self.saving = None  # the kind of the save in progress ("save", "background save"), if armed

    def wants(self, phase: str) -> bool:
        return self.plan is not None and self.plan["phase"] == phase and self.steps + 1 >= self.plan["after"]

    def now(self, phase: str, **data):
        self.log("kill", phase=phase, by="self", step=self.steps, planned=self.plan.get("planned", phase), **data)
        os.kill(os.getpid(), signal.SIGKILL)

    def install(self):
        """Count the fsyncs of the saves this rank is to die in."""
        fsync = os.fsync

        def counting_fsync(fd):
            fsync(fd)
            if self.saving is not None:
                self.fsyncs += 1
                if self.fsyncs >= self.plan["at"]:
                    self.now(self.saving, fsync=self.fsyncs)

        os.fsync = counting_fsync

    def at_block(self, model):
        """The forward and backward kills: hooks on block ``at``."""
        if self.plan and self.plan["phase"] in ("forward", "backward"):
            block = model.blocks[self.plan["at"]]

            def on_forward(module, args, out):
                if self.wants("forward"):
                    self.now("forward", block=self.plan["at"])
                if self.wants("backward") and out.requires_grad:
                    out.register_hook(lambda g: self.now("backward", block=self.plan["at"]))

            block.register_forward_hook(on_forward)

    def stepping(self, on: bool):
        """Count the calls (Python and C functions) of ``clip_grad_norm_`` + ``step()`` while
        ``on``; in the planned step, kill at call ``frac`` x the previous step's count."""
        if not (self.plan and self.plan["phase"] == "step"):
            return
        if on:
            self.last_calls, self.calls = self.calls, 0
            target = max(1, round(self.plan["frac"] * self.last_calls)) if self.wants("step") else None

            def prof(frame, event, arg):
                if event in ("call", "c_call"):
                    self.calls += 1
                    if self.calls == target:
                        self.now("step", call=self.calls, of=self.last_calls)

        sys.setprofile(prof if on else None)

    def loading(self, on: bool):
        """Count the load's block reads (checkpoint/files.py, ``CheckpointReader.read``) while ``on``."""
        if not (self.plan and self.plan["phase"] == "load"):
            return

        def prof(frame, event, arg):
            if (
                event == "call"
                and frame.f_code.co_name == "read"
                and frame.f_code.co_filename.endswith(os.path.join("checkpoint", "files.py"))
            ):
                self.reads += 1
                if self.reads >= self.plan["at"]:
                    self.now("load", read=self.reads)

        sys.setprofile(prof if on else None)


def complete(path: str) -> bool:
    """The job's own check of a checkpoint directory, apart from zeroshard's: not an
    interrupted save's, its manifest parses, and every file it lists has its size and
    every byte of it its CRC-32 (whole extra files; each block of each tensor piece)."""
    if ".partial-" in os.path.basename(path):
        return False
    try:
        with open(os.path.join(path, "manifest.json"), "rb") as f:
            body = json.loads(f.read())["body"]
        if any(os.path.getsize(os.path.join(path, n)) != i["size"] for n, i in body["files"].items()):
            return False
        data = {}
        for n in body["files"]:
            with open(os.path.join(path, n), "rb") as f:
                data[n] = f.read()
    except (OSError, ValueError, KeyError):
        return False
    if any(zlib.crc32(data[n]) != i["crc32"] for n, i in body["files"].items() if n.startswith("extra")):
        return False
    block = body["block_bytes"]
    for t in body["tensors"].values():
        item = torch.empty(0, dtype=getattr(torch, t["dtype"])).element_size()
        for fname, byte0, _, numel, crcs in t["entries"]:
            piece = data[fname][byte0 : byte0 + numel * item]
            if [zlib.crc32(piece[i : i + block]) for i in range(0, len(piece), block)] != crcs:
                return False
    return True


def survey(ckpt: str) -> dict:
    """Every directory under ``ckpt``: {name: complete?}."""
    if not os.path.isdir(ckpt):
        return {}
    return {
        d: complete(os.path.join(ckpt, d)) for d in sorted(os.listdir(ckpt)) if os.path.isdir(os.path.join(ckpt, d))
    }


def batch(data: CharData, step: int, rank: int, world: int, args):
    """Step ``step``'s rows for ``rank``: the same global batch at every world size."""
    x, y = data.batch(args.global_batch, args.seq, step, 0, 0, args.seed)
    rows = slice(rank * args.global_batch // world, (rank + 1) * args.global_batch // world)
    return x[rows], y[rows]


def build(args):
    import zeroshard as zs

    torch.manual_seed(args.seed)
    model = build_model("tiny", vocab=64)
    fs = zs.FullyShard(model, wrap={Block})
    return model, fs, zs.ShardedOptimizer(fs.parameters(), lr=args.lr, weight_decay=0.01)


def start(args, kill: Killer, log: Events, model, fs, opt) -> int:
    """Resume (the newest complete checkpoint, or none): the step to start from."""
    import zeroshard as zs

    ckpt = os.path.join(args.run, "ckpt")
    seen = survey(ckpt) if dist.get_rank() == 0 else None
    kill.loading(True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t0 = time.time()
        extra = zs.resume(ckpt, fs, opt)
    kill.loading(False)
    step = extra["step"] if extra else 0
    log(
        "resumed",
        step=step,
        s=time.time() - t0,
        seen=seen,
        skipped=[str(w.message)[:300] for w in caught if "zeroshard.resume" in str(w.message)],
    )
    if kill.plan and kill.plan["phase"] == "load":  # nothing was loaded: the next forward instead
        kill.plan.update(phase="forward", at=0, after=1, planned="load")
    return step


def train_step(args, kill: Killer, fs, opt, data, step: int, saving):
    world, rank = dist.get_world_size(), dist.get_rank()
    for g in opt.param_groups:
        g["lr"] = args.lr * min(1.0, (step + 1) / 4)  # warm-up: a function of the step
    x, y = batch(data, step, rank, world, args)
    fs(x, y).backward()
    if saving is not None:
        saving.result()  # the previous step's background save is durable
        kill.log("saved", step=step, kind="background save")
    kill.stepping(True)
    opt.clip_grad_norm_(1.0)
    opt.step()
    kill.stepping(False)
    opt.zero_grad()


def save(args, kill: Killer, fs, opt, step: int):
    """Checkpoint after ``step`` steps (blocking and background in turn); returns the Future or None."""
    import zeroshard as zs

    kind = "save" if (step // args.every) % 2 else "background save"
    kill.saving, kill.fsyncs = (kind if kill.wants(kind) else None), 0
    path = os.path.join(args.run, "ckpt", f"step_{step:06d}")
    done = zs.save_checkpoint(path, fs, opt, extra={"step": step}, background=kind != "save")
    if done is None:
        kill.saving = None
        kill.log("saved", step=step, kind=kind)
        if dist.get_rank() == 0:
            prune(os.path.join(args.run, "ckpt"))
    return done


def prune(ckpt: str, keep: int = 2):
    """Delete complete checkpoints but the newest ``keep`` (the script's choice; torn ones stay)."""
    done = sorted(
        d for d in os.listdir(ckpt) if d.startswith("step_") and os.path.exists(os.path.join(ckpt, d, "manifest.json"))
    )
    for d in done[:-keep]:
        shutil.rmtree(os.path.join(ckpt, d), ignore_errors=True)


def run(args, log: Events):
    import zeroshard as zs

    zs.init_distributed("gloo")
    rank, attempt = dist.get_rank(), int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    with open(os.environ["CHAOS_PLAN"]) as f:
        plan = json.load(f).get(str(attempt))
    kill = Killer(plan, rank, log)
    model, fs, opt = build(args)
    kill.install()
    first = start(args, kill, log, model, fs, opt)
    kill.at_block(model)
    data, saving = CharData(make_corpus(), vocab=64), None
    for step in range(first, args.steps):
        train_step(args, kill, fs, opt, data, step, saving)
        kill.steps += 1
        log("step", step=step + 1)
        saving = save(args, kill, fs, opt, step + 1) if (step + 1) % args.every == 0 else None
    if saving is not None:
        saving.result()
        log("saved", step=args.steps, kind="background save")
    dist.barrier()
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run-dir", dest="run", required=True, help="the run's directory (events.jsonl and ckpt/ out)")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--every", type=int, default=4, help="checkpoint interval (steps)")
    ap.add_argument("--global-batch", type=int, default=12, help="sequences per step, over all ranks")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(1)  # one thread per rank: the same arithmetic in every attempt
    log = Events(
        os.path.join(args.run, "events.jsonl"),
        launch=int(os.environ.get("CHAOS_LAUNCH", "0")),
        attempt=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
        rank=int(os.environ["RANK"]),
        world=int(os.environ["WORLD_SIZE"]),
    )
    log("start", pid=os.getpid())
    try:
        run(args, log)
    except BaseException as e:
        log("error", error=f"{type(e).__name__}: {e}"[:400])
        raise
    log("done")


if __name__ == "__main__":
    main()
