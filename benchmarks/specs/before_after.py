"""Step time of two (or more) builds of zeroshard in one process group, turn by turn.

    python -m benchmarks before_after --build 33842ae --build 7bd72aa    # commits, built here
    python -m benchmarks before_after --package old=/path/to/site --stages 1,3 --paired 100

Separate runs of `python -m benchmarks step` on a shared machine spread by several percent, more
than most changes one wants to judge. Here every build is imported into the
same worker processes under its own name (`zs_<name>`; the installed package
is "head"), every stage of every build is set up on its own copy of the step benchmark's
default GPT (3.4M parameters, world size 2 unless --world-size, gloo) next to DDP + fused AdamW,
and their steps are taken in turn (order rotated each turn). The result is
the median over turns of each build's step time over the first build's *in
the same turn*: two copies of one build read 1.000 +- 0.002 at 80 turns on
the 2-core VM (see RESULTS, "Before/after in one process group").

``--build COMMIT`` checks the commit out into a temporary worktree and
installs it with ``pip install --target`` (a few minutes: the C++ core is
compiled); for two builds to load side by side their pybind11 classes must be
module-local, which the current bindings are, and older ones are made so in
the worktree's copy. The first build listed is the baseline.
"""

from __future__ import annotations

import importlib.util
import os
import re
import statistics
import subprocess
import sys
import tempfile
import types

import torch

from benchmarks import training
from benchmarks.gpt import GPTConfig
from benchmarks.harness import ROOT, opt, paired_ratio, spawn


def build_commit(commit: str, cache: str) -> str:
    """Install ``commit``'s package into ``cache``/``commit``; returns that directory."""
    target = os.path.join(cache, commit)
    if os.path.isdir(os.path.join(target, "zeroshard")):
        return target
    src = tempfile.mkdtemp(prefix=f"zeroshard-{commit}-")
    subprocess.run(
        ["git", "-C", ROOT, "worktree", "add", "--detach", "-f", src, commit], check=True, capture_output=True
    )
    try:
        bindings = os.path.join(src, "csrc", "bindings.cpp")
        with open(bindings) as f:
            text = f.read()
        if "py::module_local()" not in text:
            text = re.sub(r'(py::(?:class_|enum_)<[^>]*>\(m, "\w+")', r"\1, py::module_local()", text)
            with open(bindings, "w") as f:
                f.write(text)
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "install",
                "-q",
                "--no-build-isolation",
                "--no-deps",
                "--target",
                target,
                src,
            ],
            check=True,
        )
    finally:
        subprocess.run(["git", "-C", ROOT, "worktree", "remove", "--force", src], capture_output=True)
    return target


def load(packages: dict) -> None:
    for name, path in packages.items():
        if path is None or f"zs_{name}" in sys.modules:
            continue
        pkg = os.path.join(path, "zeroshard")
        spec = importlib.util.spec_from_file_location(
            f"zs_{name}", os.path.join(pkg, "__init__.py"), submodule_search_locations=[pkg]
        )
        module = importlib.util.module_from_spec(spec)
        sys.modules[f"zs_{name}"] = module
        spec.loader.exec_module(module)


class Builder:
    """training.build() with the named build's module: variants "ddp" and "<build>:<stage>"
    (picklable: it travels to the spawned workers, which import the builds first)."""

    def __init__(self, packages: dict):
        self.packages = packages

    def __call__(self, variant: str, model):
        load(self.packages)
        if variant == "ddp":
            return training.build(variant, model, torch.float32)
        name, stage = variant.rsplit(":", 1)
        zs = sys.modules[f"zs_{name}"] if self.packages[name] else None  # None: the installed one
        return training.build(f"zeroshard-{stage}", model, torch.float32, zs=zs)


OPTIONS = [
    opt("--build", action="append", default=[], help="a commit to build and compare (repeatable)"),
    opt(
        "--package", action="append", default=[], help="name=DIR: a build installed in DIR (DIR/zeroshard); repeatable"
    ),
    opt("--no-head", action="store_true", help="leave out the installed package"),
    opt("--stages", default="1,2,3"),
    opt("--paired", type=int, default=80, help="turns measured"),
    opt("--warmup", type=int, default=3),
    opt("--layers", type=int, default=4, help="GPT blocks (the step benchmark's default; 8 with --dim 512: 25.8M)"),
    opt("--dim", type=int, default=256),
    opt("--batch", type=int, default=8, help="sequences per rank (the sweep's: 2)"),
    opt("--world-size", type=int, default=2, help="ranks (on this machine's cores: oversubscribed past 2)"),
    opt("--cache", default=os.path.join(tempfile.gettempdir(), "zeroshard-builds")),
]


def check(args):
    if len(args.build) + len(args.package) + (not args.no_head) < 2:
        return "give at least two builds (--build / --package, and the installed one unless --no-head)"
    return None


def run(args):
    packages = {c: build_commit(c, args.cache) for c in args.build}
    packages.update(dict(p.split("=", 1) for p in args.package))
    if not args.no_head:
        packages["head"] = None
    stages = args.stages.split(",")
    names = list(packages)
    variants = ["ddp"] + [f"{n}:{s}" for s in stages for n in names]
    cfg = GPTConfig(layers=args.layers, dim=args.dim, heads=4, seq=64, vocab=1021)
    run = types.SimpleNamespace(batch=args.batch, warmup=args.warmup, paired=args.paired, device="cpu", dtype="float32")
    times = spawn(training.paired_worker, args.world_size, variants, cfg, run, Builder(packages), what="before/after")
    n, base = len(times["ddp"]), names[0]
    print(f"{n} turns; median per-turn ratio (and mean) of each build's step time over {base}'s, and over DDP's")
    print(f"| stage | build | step ms | vs DDP | vs {base} (median) | (mean) |")
    print("|---|---|---:|---:|---:|---:|")
    for s in stages:
        b = times[f"{base}:{s}"]
        for name in names:
            a = times[f"{name}:{s}"]
            per = [a[i] / b[i] for i in range(n)]
            ddp = paired_ratio(a, times["ddp"])
            print(
                f"| {s} | {name} | {1e3 * statistics.median(a):.2f} | {ddp:.3f}x | "
                f"{statistics.median(per):.3f} | {statistics.mean(per):.3f} |"
            )
    return dict(
        builds=dict(packages), stages=stages, turns=n, batch=args.batch, world_size=args.world_size, times_s=times
    )
