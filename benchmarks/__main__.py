"""python -m benchmarks NAME [options]   run one benchmark (NAME --help: its options)
python -m benchmarks --list             the benchmarks, a line each
python -m benchmarks report [options]   the plots, the Benchmarks page and RESULTS.md from benchmarks/out/
python -m benchmarks all [--quick]      the set `make bench` runs (SET below), then report

Each benchmark writes its JSON to benchmarks/out/ (its --json). --quick runs the set at
the small sizes each entry names: a check that the runner and the benchmarks work, not
figures to publish (it writes into a temporary directory, not benchmarks/out/)."""

from __future__ import annotations

import os
import sys
import tempfile

from benchmarks import harness

# The set `make bench` runs, in order: (name, options, options added with --quick).
# Their JSONs are what RESULTS.md's generated tables are made from.
SET = [
    ("adamw", [], ["--sizes", "65536,262144", "--repeat", "2"]),
    (
        "step",
        [],
        [
            "--variants",
            "ddp,zeroshard-2,zeroshard-3",
            "--steps",
            "1",
            "--warmup",
            "1",
            "--rounds",
            "1",
            "--paired",
            "2",
            "--layers",
            "1",
            "--dim",
            "64",
            "--no-comm",
        ],
    ),
    (
        "checkpoint",
        [],
        [
            "--variants",
            "fsdp2-3+dcp,zeroshard-3",
            "--layers",
            "1",
            "--dim",
            "64",
            "--repeats",
            "1",
            "--resume-world-size",
            "0",
        ],
    ),
    ("checkpoint", ["--paired", "9"], ["--paired", "1", "--runs", "1", "--layers", "1", "--dim", "64"]),
]


def _summary(name: str) -> str:
    doc = harness.spec(name).__doc__ or ""
    return doc.strip().split("\n")[0]


def main(argv: list) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name == "--list":
        for n in harness.specs():
            print(f"{n:<22} {_summary(n)}")
        return 0
    if name == "report":
        from benchmarks import report

        return report.main(rest)
    if name == "all":
        return run_set(quick="--quick" in rest)
    if name.replace("-", "_") not in harness.specs():
        print(f"no benchmark {name!r}; python -m benchmarks --list names them", file=sys.stderr)
        return 2
    return harness.run(name, rest)


def run_set(quick: bool) -> int:
    """SET, then the report (with --quick: into a temporary directory, the report not drawn)."""
    out = tempfile.mkdtemp(prefix="zs-bench-quick-") if quick else None
    for name, options, small in SET:
        argv = options + (small if quick else [])
        if quick:
            argv += ["--json", os.path.join(out, harness.json_name(name, harness.spec(name)))]
        print(f"\n=== python -m benchmarks {name} {' '.join(argv)}", flush=True)
        status = harness.run(name, argv)
        if status:
            return status
    if quick:
        print(f"\nquick set done: its JSONs are in {out}")
        return 0
    from benchmarks import report

    return report.main([])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
