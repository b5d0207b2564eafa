"""benchmarks/report.py on synthetic benchmark JSONs: plots, the generated docs
page, the RESULTS.md section between its markers, idempotence,
missing JSONs."""

import importlib.util
import json
import os
import re

import pytest

pytest.importorskip("matplotlib")

_PATH = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "benchmarks", "report.py")
_spec = importlib.util.spec_from_file_location("bench_report", _PATH)
report = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(report)

MACHINE = {
    "description": "Test CPU 9000, 4 CPUs",
    "cpu": "Test CPU 9000",
    "cpus": 4,
    "gpu": None,
    "gpus": None,
    "torch": "2.99.0",
    "python": "3.11.0",
    "os": "Linux",
    "commit": "abc1234",
}
P = 3_437_312


def _step(variant, ms, mb, comm):
    return {
        "variant": variant,
        "params": P,
        "step_ms": ms,
        "peak_mb": mb,
        "loss": 5.45,
        "comm": {"all_reduce": {"calls": 1, "bytes": int(comm * 2**20)}},
        "comm_mb": comm,
    }


STEP = {
    "date": "2031-01-02",
    "torch": "2.99.0",
    "world_size": 2,
    "param_dtype": "float32",
    "config": {"vocab": 1021, "seq": 64, "layers": 4, "dim": 256, "heads": 4},
    "machine": MACHINE,
    "device": "cpu",
    "backend": "CPU gloo",
    "dtype": "float32",
    "batch": 8,
    "steps": 6,
    "warmup": 2,
    "prefetch": 1,
    "baseline": "ddp",
    "rows": [
        _step("ddp", 368.1, 243.6, 13.1),
        _step("ddp+zero", 420.0, 230.0, 19.7),
        _step("fsdp2", 500.0, 225.0, 19.7),
        _step("zeroshard-1", 380.0, 229.0, 26.2),
        _step("zeroshard-2", 370.0, 226.0, 26.2),
        _step("zeroshard-2@5", 375.0, 224.0, 26.2),
        _step("fsdp2-3", 690.3, 220.6, 26.3),
        _step("zeroshard-3", 433.5, 227.0, 31.6),
    ],
}
ADAMW = {
    "date": "2031-01-02",
    "commit": "abc1234",
    "torch": "2.99.0",
    "machine": MACHINE,
    "bytes_per_param": {"zeroshard bf16": 28, "torch fused": 28},
    "results": [
        {
            "device": "cpu",
            "device_name": "x86_64, 4 threads",
            "params": n,
            "variant": v,
            "seconds": t * n / 2**20,
            "gb_per_s": 28 * 2**20 / t / 1e9,
            "copy_gb_per_s": 25.0,
            "fraction_of_copy": 28 * 2**20 / t / 1e9 / 25.0,
            "time_vs_zeroshard_bf16": t / 1e-3,
        }
        for n in (2**20, 2**22)
        for v, t in (("zeroshard bf16", 1e-3), ("torch fused", 1.1e-3))
    ],
}
CKPT = {
    "date": "2031-01-02",
    "world_size": 2,
    "torch": "2.99.0",
    "backend": "CPU gloo",
    "machine": MACHINE,
    "config": {"layers": 4, "dim": 512},
    "repeats": 3,
    "rows": [
        {
            "variant": v,
            "params": 13_166_080,
            "save_ms": s,
            "load_ms": lo,
            "mb_per_rank": [75.4, 75.3],
            "save_peak_mb": 0.4,
            "load_peak_mb": 0.2,
        }
        for v, s, lo in (("fsdp2-3+dcp", 384.3, 275.1), ("zeroshard-3", 262.9, 77.7))
    ],
}

RESULTS = "# Benchmark results\n\nIntro paragraph.\n\n## Old run\n\nhand-written reading\n"
PNGS = ["headline.png", "memory_by_stage.png", "step_time_ratio.png", "adamw.png", "checkpoint.png"]


def _setup(tmp_path, files=(("step.json", STEP), ("adamw.json", ADAMW), ("checkpoint.json", CKPT))):
    out = tmp_path / "bench" / "out"
    out.mkdir(parents=True)
    for name, data in files:
        (out / name).write_text(json.dumps(data))
    results = tmp_path / "bench" / "RESULTS.md"
    results.write_text(RESULTS)
    return out, results


def _run(tmp_path, out, results):
    docs = tmp_path / "docs" / "benchmarks"
    return report.report(str(out), str(results), str(docs)), docs


def _links(text):
    """The targets of the markdown links and images in text."""
    return re.findall(r"\]\(([^)\s]+)\)", text)


def _section(text, markers):
    i, j = text.index(markers[0]), text.index(markers[1])
    assert text.count(markers[0]) == text.count(markers[1]) == 1
    return text[i : j + len(markers[1])]


def test_plots_sections_and_idempotent(tmp_path):
    out, results = _setup(tmp_path)
    (out / "sweep_size.png").write_bytes(b"\x89PNG sweep.py's plot")  # drawn by another script: copied
    changed, docs = _run(tmp_path, out, results)
    for png in PNGS:
        data = (docs / png).read_bytes()
        assert data.startswith(b"\x89PNG") and len(data) < 100_000, png
        assert changed[str(docs / png)]
        assert not (out / png).exists()
    assert (docs / "sweep_size.png").read_bytes() == b"\x89PNG sweep.py's plot"

    res = results.read_text()
    sec = sec_res = _section(res, report.RESULTS_MARKERS)
    assert res.startswith("# Benchmark results\n\nIntro paragraph.\n\n" + report.RESULTS_MARKERS[0])
    assert res.endswith("\n\n## Old run\n\nhand-written reading\n")
    assert "| 2031-01-02 | Test CPU 9000, 4 CPUs | 2.99.0 | abc1234 |" in sec
    assert "| zeroshard-2 | ZeRO-2 | 370.0 | 1.01x | 226.0 | 0.93x | 26.20 | 5.450 |" in sec
    assert "zeroshard-3 / fsdp2-3 (ZeRO-3): 0.63x time" in sec
    assert "| zeroshard-3 | 262.9 | 0.68x | 77.7 | 0.28x |" in sec

    # the docs page: generated whole, every plot (links relative to the page), the same tables
    page = (docs / "index.md").read_text()
    assert page.startswith(report.DOCS_HEADER) and "do not edit by hand" in page.lower()
    shown = [t for t in _links(page) if t.endswith(".png")]
    assert sorted(shown) == sorted(PNGS + ["sweep_size.png"])
    # every link resolves inside the docs directory
    assert all((docs / t).exists() for t in _links(page)), _links(page)
    tables = "\n".join(report.tables(report.load(str(out))))
    assert tables in page and tables in sec_res
    assert "## Old run\n\nhand-written reading\n" in page  # RESULTS' hand-kept sections follow

    files = [results] + [docs / p for p in PNGS + ["index.md", "sweep_size.png"]]
    snapshot = {p: p.read_bytes() for p in files}
    again, _ = _run(tmp_path, out, results)
    assert not any(again.values())
    assert snapshot == {p: p.read_bytes() for p in snapshot}


def test_docs_page_links_stay_inside_docs(tmp_path):
    out, results = _setup(tmp_path, files=[("step.json", STEP)])
    (out / "sweep_world.png").write_bytes(b"\x89PNG")
    results.write_text(
        "# R\n\n## GPU run (x)\n\n![plot](out/sweep_world.png) and [a file](gpu_run.sh), "
        "[site](https://example.com), [here](#gpu-run-x)\n"
    )
    _, docs = _run(tmp_path, out, results)
    page = (docs / "index.md").read_text()
    assert (
        "![plot](sweep_world.png) and a file (`benchmarks/gpu_run.sh`), [site](https://example.com), "
        "[here](#gpu-run-x)" in page
    )
    assert page.count("](sweep_world.png)") == 1  # shown there, not again under Plots
    res = results.read_text()
    assert "![plot](out/sweep_world.png)" in res  # RESULTS.md itself keeps its links


def test_missing_jsons_are_skipped(tmp_path):
    out, results = _setup(tmp_path, files=[("checkpoint.json", CKPT), ("notes.json", {"x": 1})])
    (out / "broken.json").write_text("{not json")
    _, docs = _run(tmp_path, out, results)
    assert sorted(p.name for p in docs.glob("*.png")) == ["checkpoint.png"]
    page = (docs / "index.md").read_text()
    assert "checkpoint.png" in page and "memory_by_stage.png" not in page and "adamw.png" not in page
    res = _section(results.read_text(), report.RESULTS_MARKERS)
    assert "Checkpoint save and load" in res and "One training step" not in res and "Fused AdamW" not in res


def test_existing_sections_are_replaced_in_place(tmp_path):
    out, results = _setup(tmp_path)
    old = f"# R\n\nintro\n\n{report.RESULTS_MARKERS[0]}\nstale numbers\n{report.RESULTS_MARKERS[1]}\n\n## Old\n"
    results.write_text(old)
    _run(tmp_path, out, results)
    res = results.read_text()
    assert "stale numbers" not in res and res.startswith("# R\n\nintro\n\n") and res.endswith("\n\n## Old\n")


def test_cli_and_broken_markers(tmp_path, capsys):
    out, results = _setup(tmp_path, files=[("step.json", STEP)])
    docs = tmp_path / "site" / "bench"
    args = ["--out-dir", str(out), "--results", str(results), "--docs", str(docs)]
    assert report.main(args) == 0
    assert all((docs / png).exists() for png in ("headline.png", "memory_by_stage.png", "step_time_ratio.png"))
    capsys.readouterr()
    assert report.main(args) == 0
    printed = capsys.readouterr().out
    assert "wrote" not in printed and printed.count("unchanged") == 5  # 3 plots, RESULTS, page
    results.write_text(f"# R\n\n{report.RESULTS_MARKERS[0]}\nno end marker\n")
    with pytest.raises(ValueError, match="by hand"):
        report.main(args)


def test_paired_ratios_get_their_column(tmp_path):
    step = json.loads(json.dumps(STEP))
    step["paired"] = 12
    for r, ratio in zip(step["rows"], (1.0, 1.13, 1.4, 0.97, 0.96, 0.99, 1.8, 1.2)):
        r["paired_ratio"] = ratio
    out, results = _setup(tmp_path, files=[("step.json", step)])
    _run(tmp_path, out, results)
    sec = _section(results.read_text(), report.RESULTS_MARKERS)
    assert "| variant | stage | step ms | vs ddp | paired vs ddp | peak MB/rank |" in sec
    assert "| zeroshard-2 | ZeRO-2 | 370.0 | 1.01x | 0.96x | 226.0 | 0.93x |" in sec
    assert "median over 12 turns" in " ".join(sec.split())
    # a/b in the stage comparisons uses the paired ratios too: 0.97 / 1.13
    assert "zeroshard-1 / ddp+zero (ZeRO-1): 0.90x time (0.86x paired)" in sec


def test_paired_checkpoint_runs_give_each_launch_its_ratio(tmp_path):
    # two launches of two repeats: zeroshard's save 0.9x then 1.0x FSDP2's (per-repeat medians)
    runs = [
        {
            "fsdp2-3+dcp save": [0.2, 0.4],
            "fsdp2-3+dcp load": [0.1, 0.1],
            "ddp+dcp save": [0.1, 0.2],
            "ddp+dcp load": [0.2, 0.2],
            "zeroshard-3+dcp save": [0.18, 0.36],
            "zeroshard-3+dcp load": [0.05, 0.1],
        },
        {
            "fsdp2-3+dcp save": [0.2, 0.2],
            "fsdp2-3+dcp load": [0.1, 0.1],
            "ddp+dcp save": [0.2, 0.2],
            "ddp+dcp load": [0.2, 0.2],
            "zeroshard-3+dcp save": [0.2, 0.2],
            "zeroshard-3+dcp load": [0.1, 0.1],
        },
    ]
    rows = {r["variant"]: r for r in report.paired_ratios(runs)}
    assert [round(x, 6) for x in rows["zeroshard-3+dcp"]["save"]["fsdp2-3+dcp"]] == [0.9, 1.0]
    assert rows["zeroshard-3+dcp"]["save_ms"] == pytest.approx(200.0)  # the median of all four repeats
    assert report.ratio_range([0.9, 1.0]) == "0.90-1.00x" and report.ratio_range([0.901, 0.899]) == "0.90x"
    paired = {"date": "2031-01-02", "world_size": 2, "repeats": 2, "runs_s": runs, "machine": MACHINE}
    out, results = _setup(tmp_path, files=[("checkpoint.json", CKPT), ("checkpoint-paired.json", paired)])
    _run(tmp_path, out, results)
    sec = _section(results.read_text(), report.RESULTS_MARKERS)
    # load: launch 1's ratios 0.5 and 1.0 (median 0.75), launch 2's 1.0; ranges lowest first
    assert "| zeroshard-3+dcp | 200.0 | 0.90-1.00x | 1.00-1.80x | 100.0 | 0.75-1.00x | 0.38-0.50x |" in sec


def test_hybrid_runs_get_the_replica_traffic_column(tmp_path):
    step = json.loads(json.dumps(STEP))
    step["shard_size"] = 2
    for r, sent in zip(step["rows"], (None, None, 3.25, 3.25, 3.25, 3.25, 3.25, 3.25)):
        r["comm_groups"] = {"shard": {"size": 2, "sent": 1.0 * 2**20}}
        if sent is not None:
            r["comm_groups"]["replicate"] = {"size": 2, "sent": sent * 2**20}
    out, results = _setup(tmp_path, files=[("step_hybrid.json", step)])
    _run(tmp_path, out, results)
    sec = _section(results.read_text(), report.RESULTS_MARKERS)
    assert "| comm MB/rank/step | across replicas MB |" in sec
    assert "| 13.10 | - |" in sec and "| 26.20 | 3.25 |" in sec  # ddp: no replica group


def test_comm_count_names_groups_by_their_ranks():
    spec = importlib.util.spec_from_file_location(
        "bench_comm_count", os.path.join(os.path.dirname(_PATH), "comm_count.py")
    )
    cc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cc)
    # world 6 = 3 replicas x 2 shards, rank 3: shard group {2, 3}, replica group {1, 3, 5}
    assert cc.group_role([0, 1, 2, 3, 4, 5], 3, 6, 2) == "world"
    assert cc.group_role([3, 2], 3, 6, 2) == "shard"
    assert cc.group_role([1, 3, 5], 3, 6, 2) == "replicate"
    assert cc.group_role([0, 3], 3, 6, 2) == "ranks 0,3"
    assert cc.group_role([0, 1, 2, 3, 4, 5], 3, 6, None) == "world"
    assert cc.comm_kind("gloo:all_reduce") == "all_reduce" and cc.comm_kind("aten::add") is None
    text = cc.format_groups({"replicate": {"size": 3, "sent": 2**20, "all_reduce": {"calls": 2, "bytes": 3 * 2**19}}})
    assert text == "  replicate (3 ranks): sends 1.00 MB | all_reduce 2x 1.50 MB"
