"""Plots and tables of the latest benchmark run, from the JSON files the benchmarks write.

Reads every JSON in benchmarks/out/ that is there (adamw.json, step.json and
any step_*.json, checkpoint.json; a missing one is skipped) and writes:
  benchmarks/out/memory_by_stage.png   peak memory per rank by variant (step*.json)
  benchmarks/out/step_time_ratio.png   step time of each variant over DDP's (step*.json)
  benchmarks/out/adamw.png             fused AdamW GB/s against size per variant (adamw.json)
  benchmarks/out/checkpoint.png        checkpoint save/load time per variant (checkpoint.json)
then rewrites the section of benchmarks/RESULTS.md between
<!-- bench:auto:start --> and <!-- bench:auto:end --> (dated tables of the
numbers) and the section of README.md between <!-- bench:plots:start --> and
<!-- bench:plots:end --> (the plots, and on what machine and when they were
made). Each section is created where it is missing: in RESULTS.md after the
introduction, in README.md at the end of its Benchmarks section. Nothing else in
either file changes, and a file is only written when its contents change, so
running it twice gives the same files. `make bench` runs it last.

    python benchmarks/report.py [--out-dir DIR] [--results FILE] [--readme FILE]
"""
from __future__ import annotations

import argparse
import glob
import io
import json
import os
import re
import sys
import textwrap

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

RESULTS_MARKERS = ("<!-- bench:auto:start -->", "<!-- bench:auto:end -->")
README_MARKERS = ("<!-- bench:plots:start -->", "<!-- bench:plots:end -->")

# ZeRO stage of each step.py / checkpoint.py variant (what "by stage" means in the plots).
STAGES = {"adamw": "no DDP", "ddp": "DDP", "ddp+zero": "ZeRO-1", "zeroshard-1": "ZeRO-1", "fsdp2": "ZeRO-2",
          "zeroshard-2": "ZeRO-2", "fsdp2-3": "ZeRO-3", "zeroshard-3": "ZeRO-3", "fsdp2-3+dcp": "ZeRO-3",
          "deepspeed-1": "ZeRO-1", "deepspeed-2": "ZeRO-2", "deepspeed-3": "ZeRO-3"}
STAGE_ORDER = ["no DDP", "DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3"]
# Ours against torch's alternative of the same stage (summary lines under the step tables).
PAIRS = [("zeroshard-1", "ddp+zero"), ("zeroshard-2", "fsdp2"), ("zeroshard-3", "fsdp2-3"),
         ("zeroshard-3@p0", "fsdp2-3"), ("zeroshard-1", "deepspeed-1"), ("zeroshard-2", "deepspeed-2"),
         ("zeroshard-3", "deepspeed-3"), ("zeroshard-2+cpu", "deepspeed-2+cpu"), ("zeroshard-2+nvme", "deepspeed-2+cpu")]


def stage(variant: str) -> str:
    """"zeroshard-2@5", "deepspeed-2+cpu", "zeroshard-1+overlap" are their stage's too."""
    base = variant.split("@")[0]
    for suffix in ("+cpu", "+nvme", "+overlap", "+nosync", "+background"):
        base = base.removesuffix(suffix)
    return STAGES.get(variant, STAGES.get(base, "?"))


def lost_ms(row: dict) -> float:
    """The training time a background checkpoint save costs: the call, and the step its
    write slows (benchmarks/checkpoint.py's row)."""
    return row["save_ms"] + row["step_during_ms"] - row["step_ms"]


def color(variant: str) -> str:
    if variant.startswith("zeroshard"):
        return "tab:orange"
    return "tab:gray" if variant in ("ddp", "adamw") else "tab:blue"


# ---------------------------------------------------------------- reading

def load(out_dir: str) -> dict:
    """{"adamw": data, "step": [(name, data), ...], "checkpoint": data} for the JSONs
    that exist and parse; step.json first, then step_*.json by name."""
    found = {"adamw": None, "step": [], "checkpoint": None}
    for path in sorted(glob.glob(os.path.join(out_dir, "*.json"))):
        name = os.path.basename(path)
        try:
            with open(path) as f:
                data = json.load(f)
        except (OSError, ValueError) as e:
            print(f"report: skipping {path}: {e}", file=sys.stderr)
            continue
        if name == "adamw.json" and data.get("results"):
            found["adamw"] = data
        elif re.fullmatch(r"step(_.*)?\.json", name) and data.get("rows"):
            found["step"].append((name, data))
        elif name == "checkpoint.json" and data.get("rows"):
            found["checkpoint"] = data
        else:
            print(f"report: skipping {path} (not a benchmark JSON this script knows, or empty)", file=sys.stderr)
    found["step"].sort(key=lambda nd: (nd[0] != "step.json", nd[0]))
    return found


def machine(d: dict) -> str:
    m = d.get("machine") or {}
    if m.get("description"):
        return m["description"]
    names = sorted({r["device_name"] for r in d.get("results", []) if r.get("device_name")})
    return ", ".join(names) if names else "machine not recorded"


def commit(d: dict) -> str:
    return d.get("commit") or (d.get("machine") or {}).get("commit") or "not recorded"


def torch_version(d: dict) -> str:
    return d.get("torch") or (d.get("machine") or {}).get("torch") or "not recorded"


def params(d: dict) -> int:
    return max(r.get("params", 0) for r in d["rows"])


def step_baseline(d: dict) -> dict:
    rows = d["rows"]
    for name in (d.get("baseline"), "ddp", "adamw"):
        for r in rows:
            if r["variant"] == name:
                return r
    return rows[0]


def step_rows(d: dict) -> list:
    """Rows in stage order (stable within a stage)."""
    return sorted(d["rows"], key=lambda r: STAGE_ORDER.index(stage(r["variant"]))
                  if stage(r["variant"]) in STAGE_ORDER else len(STAGE_ORDER))


def step_setup(d: dict) -> str:
    parts = [f"GPT {params(d) / 1e6:.2f}M params"]
    if d.get("dtype"):
        parts.append(d["dtype"])
    if d.get("param_dtype") and d["param_dtype"] != "float32":
        parts.append(f"{d['param_dtype']} gathered params (ZeRO-3)")
    parts.append(f"world size {d.get('world_size', '?')}")
    if d.get("backend"):
        parts.append(d["backend"])
    return ", ".join(parts)


def ckpt_reference(d: dict) -> dict:
    return next((r for r in d["rows"] if r["variant"] == "fsdp2-3+dcp"), d["rows"][0])


def one_or_each(values: list) -> str | None:
    """The value when all are equal, else None."""
    return values[0] if values and all(v == values[0] for v in values) else None


# ---------------------------------------------------------------- plots

def _save(fig, path: str) -> bool:
    """Writes the figure as PNG (no software/time metadata) if its bytes differ from the file's."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, metadata={"Software": None})
    import matplotlib.pyplot as plt
    plt.close(fig)
    return _write_if_changed(path, buf.getvalue())


def _bar_panels(runs, value, ylabel, suptitle, path, ref_line=None, fmt="{:.0f}"):
    import matplotlib.pyplot as plt
    n = len(runs)
    fig, axes = plt.subplots(1, n, figsize=(5.2 * n if n > 1 else 7.5, 4.6), squeeze=False)
    machines = one_or_each([machine(d) for _, d in runs])
    dates = one_or_each([d.get("date", "?") for _, d in runs])
    for ax, (name, d) in zip(axes[0], runs):
        rows = step_rows(d)
        vals = [value(d, r) for r in rows]
        labels = [f"{r['variant']}\n{stage(r['variant'])}" for r in rows]
        bars = ax.bar(range(len(rows)), vals, width=0.6, color=[color(r["variant"]) for r in rows])
        ax.set_xlim(-0.7 - max(0, 3 - len(rows)) / 2, len(rows) - 0.3 + max(0, 3 - len(rows)) / 2)
        for b, v in zip(bars, vals):
            ax.annotate(fmt.format(v), (b.get_x() + b.get_width() / 2, v), ha="center", va="bottom",
                        fontsize=8, xytext=(0, 2), textcoords="offset points")
        if ref_line is not None:
            ax.axhline(ref_line, color="black", lw=1, ls="--")
        ax.set_xticks(range(len(rows)), labels, fontsize=8, rotation=45 if len(rows) > 5 else 0,
                      ha="right" if len(rows) > 5 else "center")
        ax.set_ylabel(ylabel(d))
        ax.set_ylim(0, max(vals + [ref_line or 0]) * 1.15)
        title = f"{name}: {step_setup(d)}"
        extra = [x for x, same in ((d.get("date", "?"), dates), (machine(d), machines)) if same is None]
        ax.set_title("\n".join(_wrap(", ".join([title] + extra), 60)), fontsize=9)
        ax.grid(axis="y", alpha=0.3)
    head = " · ".join(x for x in (suptitle, machines, dates) if x)
    fig.suptitle(head, fontsize=11)
    fig.tight_layout()
    return _save(fig, path)


def _wrap(text: str, width: int) -> list:
    lines, line = [], ""
    for word in text.split(" "):
        if line and len(line) + 1 + len(word) > width:
            lines.append(line)
            line = word
        else:
            line = f"{line} {word}" if line else word
    return lines + [line]


def _exact(d):
    """Whether a step run has the exact CPU tensor-byte peak of every variant."""
    return all("tensor_mb" in r for r in d["rows"])


def plot_memory(runs, path):
    return _bar_panels(runs, lambda d, r: r["tensor_mb"] if _exact(d) else r["peak_mb"],
                       lambda d: ("peak tensor MB per rank (CPU allocator, exact)" if _exact(d) else
                                  "peak MB per rank (rise on rank 0)" + (" (CUDA allocator)" if d.get("device") ==
                                                                         "cuda" else "")),
                       "Peak memory per rank by variant", path)


def plot_ratio(runs, path):
    bases = {step_baseline(d)["variant"] for _, d in runs}
    head = ("Step time relative to DDP" if bases == {"ddp"} else
            "Step time relative to DDP (or the run's baseline where DDP did not run)")
    # the paired ratio (steps taken in turn in one process group) where the run has one
    return _bar_panels(runs, lambda d, r: r.get("paired_ratio", r["step_ms"] / step_baseline(d)["step_ms"]),
                       lambda d: f"step time / {step_baseline(d)['variant']}'s"
                       + (" (paired)" if all("paired_ratio" in r for r in d["rows"]) else ""),
                       head, path, ref_line=1.0, fmt="{:.2f}x")


def plot_adamw(d, path):
    import matplotlib.pyplot as plt
    devices = sorted({r["device"] for r in d["results"]})
    fig, axes = plt.subplots(1, len(devices), figsize=(7.5 * len(devices), 4.6), squeeze=False)
    for ax, dev in zip(axes[0], devices):
        rows = [r for r in d["results"] if r["device"] == dev]
        for variant in dict.fromkeys(r["variant"] for r in rows):
            pts = sorted((r["params"], r["gb_per_s"]) for r in rows if r["variant"] == variant)
            ax.plot([p for p, _ in pts], [g for _, g in pts], marker="o", label=variant,
                    lw=2 if variant.startswith("zeroshard") else 1.2,
                    ls="-" if variant.startswith("zeroshard") else "--")
        copy = rows[0].get("copy_gb_per_s")
        if copy:
            ax.axhline(copy, color="black", lw=1, ls=":", label=f"device copy ({copy:.1f} GB/s)")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("parameters in the shard")
        ax.set_ylabel("GB/s (bytes per param x params / time)")
        ax.set_title(f"{dev}: {rows[0].get('device_name', '')}", fontsize=9)
        ax.set_ylim(0, max([r["gb_per_s"] for r in rows] + [copy or 0]) * 1.4)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, ncol=3, loc="upper center")
    fig.suptitle(f"Fused AdamW step, one process · {machine(d)} · {d.get('date', '?')} · commit {commit(d)}",
                 fontsize=11)
    fig.tight_layout()
    return _save(fig, path)


def plot_checkpoint(d, path):
    import matplotlib.pyplot as plt
    rows = d["rows"]
    fig, ax = plt.subplots(figsize=(7.5, 4.6))
    width = 0.38
    for i, (key, label) in enumerate((("save_ms", "save"), ("load_ms", "load"))):
        xs = [j + (i - 0.5) * width for j in range(len(rows))]
        bars = ax.bar(xs, [r[key] for r in rows], width, label=label, color=("tab:blue", "tab:orange")[i])
        for b, r in zip(bars, rows):
            ax.annotate(f"{r[key]:.0f}", (b.get_x() + b.get_width() / 2, r[key]), ha="center", va="bottom",
                        fontsize=8, xytext=(0, 2), textcoords="offset points")
    ax.set_xticks(range(len(rows)), [r["variant"] for r in rows])
    ax.set_ylabel("ms (median, rank 0, barrier to barrier)")
    ax.set_ylim(0, max(max(r["save_ms"], r["load_ms"]) for r in rows) * 1.15)
    ax.legend()
    ax.grid(axis="y", alpha=0.3)
    ax.set_title(f"GPT {params(d) / 1e6:.2f}M params, world size {d.get('world_size', '?')}, "
                 f"{d.get('backend', 'CPU gloo')}", fontsize=9)
    fig.suptitle(f"Checkpoint save and load · {machine(d)} · {d.get('date', '?')}", fontsize=11)
    fig.tight_layout()
    return _save(fig, path)


# ---------------------------------------------------------------- markdown

def _para(text: str) -> str:
    return textwrap.fill(text, 78, break_long_words=False, break_on_hyphens=False)


def _table(header: list, rows: list, align: str) -> list:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---:" if a == "r" else "---" for a in align) + "|"]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return out


def results_section(found: dict) -> str:
    lines = [RESULTS_MARKERS[0],
             "## Latest run (generated)",
             "",
             "Written by `python benchmarks/report.py` (the last step of `make bench`) from",
             "the JSON files in `benchmarks/out/`, where its plots are too. Everything",
             "between the `bench:auto` markers is rewritten on each run: do not edit it by",
             "hand. The dated sections after it are readings of earlier runs.",
             ""]
    overview = []
    if found["adamw"]:
        overview.append(("Fused AdamW", "adamw.json", found["adamw"]))
    for name, d in found["step"]:
        overview.append(("Training step", name, d))
    if found["checkpoint"]:
        overview.append(("Checkpoint save/load", "checkpoint.json", found["checkpoint"]))
    if not overview:
        lines += ["No benchmark JSON in `benchmarks/out/` yet: run `make bench`.", RESULTS_MARKERS[1]]
        return "\n".join(lines)
    lines += _table(["benchmark", "file", "date", "machine", "torch", "commit"],
                    [(b, f"`{f}`", d.get("date", "?"), machine(d), torch_version(d), commit(d))
                     for b, f, d in overview], "llllll")

    for name, d in found["step"]:
        base = step_baseline(d)
        comm = any("comm_mb" in r for r in d["rows"])
        across = bool(d.get("shard_size")) and any("comm_groups" in r for r in d["rows"])
        exact = _exact(d)
        paired = all("paired_ratio" in r for r in d["rows"])
        lines += ["", f"### One training step: `{name}` ({d.get('date', '?')})", "",
                  _para(f"{step_setup(d)}. Median step time on rank 0 (over {d.get('rounds', 1)} rounds, each "
                        "running every variant in turn: the median of the rounds' medians) and peak memory on "
                        f"rank 0; ratios against {base['variant']}." + (" comm MB: what one rank sends per step under the ring model "
                                                 "of the collectives counted in one step (see "
                                                 "`benchmarks/step.py`)."
                                                 if comm else " Communication bytes not recorded in this JSON.")
                        + (" across replicas MB: what one rank sends to its replica group (the slow link "
                           "between nodes), counted by process group (`benchmarks/comm_count.py`)." if across else "")
                        + (" tensor MB: the exact peak of live tensor bytes over the built model, from the "
                           "CPU allocator's own events (peak MB is resident memory, which also counts what "
                           "is not tensors)." if exact else "")
                        + (f" paired: the median over {d.get('paired')} turns, in one process group taking "
                           f"every variant's step in turn, of the step time over {base['variant']}'s in the "
                           "same turn (steadier than separate runs on a shared machine)." if paired else "")),
                  ""]
        header = ["variant", "stage", "step ms", f"vs {base['variant']}"] + [f"paired vs {base['variant']}"] * paired
        header += ["peak MB/rank", f"vs {base['variant']}"]
        header += ["comm MB/rank/step"] * comm + ["across replicas MB"] * across + ["tensor MB", f"vs {base['variant']}"] * exact + ["loss"]
        rows = []
        for r in step_rows(d):
            row = [r["variant"], stage(r["variant"]), f"{r['step_ms']:.1f}", f"{r['step_ms'] / base['step_ms']:.2f}x"]
            row += [f"{r['paired_ratio']:.2f}x"] if paired else []
            row += [f"{r['peak_mb']:.1f}", f"{r['peak_mb'] / base['peak_mb']:.2f}x" if base["peak_mb"] else "-"]
            if comm:
                row.append(f"{r['comm_mb']:.2f}" if r.get("comm_mb") is not None else "-")
            if across:
                rep = r.get("comm_groups", {}).get("replicate")
                row.append(f"{rep['sent'] / 2**20:.2f}" if rep else "-")
            if exact:
                row += [f"{r['tensor_mb']:.1f}", f"{r['tensor_mb'] / base['tensor_mb']:.2f}x"]
            row.append(f"{r['loss']:.3f}" if "loss" in r else "-")
            rows.append(row)
        lines += _table(header, rows, "llrr" + "r" * paired + "rr" + "r" * (comm + across) + "rr" * exact + "r")
        by = {r["variant"]: r for r in d["rows"]}
        pairs = [(a, b) for a, b in PAIRS if a in by and b in by]
        if pairs:
            lines.append("")
            for a, b in pairs:
                ra, rb = by[a], by[b]
                lines.append(f"- {a} / {b} ({stage(a)}): {ra['step_ms'] / rb['step_ms']:.2f}x time"
                             + (f" ({ra['paired_ratio'] / rb['paired_ratio']:.2f}x paired)" if paired else "") + ", "
                             f"{ra['peak_mb'] / rb['peak_mb']:.2f}x peak memory"
                             + (f", {ra['tensor_mb'] / rb['tensor_mb']:.2f}x exact tensor peak" if exact else "")
                             + (f", {ra['comm_mb'] / rb['comm_mb']:.2f}x comm bytes"
                                if ra.get("comm_mb") and rb.get("comm_mb") else ""))

    d = found["adamw"]
    if d:
        for dev in sorted({r["device"] for r in d["results"]}):
            rows = [r for r in d["results"] if r["device"] == dev]
            copy = rows[0].get("copy_gb_per_s")
            lines += ["", f"### Fused AdamW, {dev}: `adamw.json` ({d.get('date', '?')})", "",
                      _para(f"{rows[0].get('device_name', dev)}; device copy (read + write) {copy:.1f} GB/s. "
                            "Best time per step; \"vs ours\" is the time over zeroshard bf16's." if copy
                            else f"{rows[0].get('device_name', dev)}."), ""]
            lines += _table(["params", "variant", "ms/step", "GB/s", "of copy", "vs ours"],
                            [(f"{r['params']:,}", r["variant"], f"{r['seconds'] * 1e3:.3f}", f"{r['gb_per_s']:.1f}",
                              f"{r['fraction_of_copy']:.1%}" if "fraction_of_copy" in r else "-",
                              f"{r['time_vs_zeroshard_bf16']:.2f}x" if "time_vs_zeroshard_bf16" in r else "-")
                             for r in rows], "rlrrrr")

    d = found["checkpoint"]
    if d:
        ref = ckpt_reference(d)
        lines += ["", f"### Checkpoint save and load: `checkpoint.json` ({d.get('date', '?')})", "",
                  _para(f"GPT {params(d) / 1e6:.2f}M params, world size {d.get('world_size', '?')}, "
                        f"{d.get('backend', 'CPU gloo')}. Median times on rank 0; MB each rank wrote; peak = rise "
                        f"of rank 0's peak RSS; save tensor MB = the most tensor bytes a save holds live on "
                        f"rank 0 (the CPU allocator's exact count); ratios against {ref['variant']}."), ""]
        lines += _table(["variant", "save ms", f"vs {ref['variant']}", "load ms", f"vs {ref['variant']}",
                         "MB/rank", "save peak MB", "load peak MB", "save: in fsync ms", "save tensor MB"],
                        [(r["variant"], f"{r['save_ms']:.1f}", f"{r['save_ms'] / ref['save_ms']:.2f}x",
                          f"{r['load_ms']:.1f}", f"{r['load_ms'] / ref['load_ms']:.2f}x",
                          " / ".join(f"{m:.1f}" for m in r.get("mb_per_rank", [])),
                          f"{r['save_peak_mb']:.1f}", f"{r['load_peak_mb']:.1f}",
                          f"{r['fsync_ms']:.1f}" if "fsync_ms" in r else "-",
                          f"{r['save_tensor_mb']:.1f}" if "save_tensor_mb" in r else "-") for r in d["rows"]],
                        "lrrrrrrrrr")
        background = [r for r in d["rows"] if "durable_ms" in r]
        if background:
            lines += ["", _para("Background saves (`save_checkpoint(..., background=True)`): \"save ms\" above is "
                                "the time the call blocks training; \"durable\" runs from the call to the Future's "
                                "`result()` (written, fsynced, committed); a training step taken while the write "
                                "runs, against one alone (medians); training loses the call and that step's "
                                "slowdown."), ""]
            lines += _table(["variant", "call blocks ms", "durable ms", "step ms alone", "step ms while writing",
                             "training loses ms"],
                            [(r["variant"], f"{r['save_ms']:.1f}", f"{r['durable_ms']:.1f}", f"{r['step_ms']:.1f}",
                              f"{r['step_during_ms']:.1f}", f"{lost_ms(r):.1f}")
                             for r in background], "lrrrrr")
    lines.append(RESULTS_MARKERS[1])
    return "\n".join(lines)


def readme_section(found: dict, plots: dict, rel: str) -> str:
    """plots: {file name: (alt text, JSON data it was drawn from, [(JSON name, its data)])}."""
    lines = [README_MARKERS[0], "### Latest plots", ""]
    if not plots:
        lines += ["No plots yet: `make bench` makes them.", README_MARKERS[1]]
        return "\n".join(lines)
    sources = [d for _, d, _ in plots.values()]
    where, when = one_or_each([machine(d) for d in sources]), one_or_each([d.get("date", "?") for d in sources])
    if where and when:
        lines += [_para(f"Made by `benchmarks/report.py` from the `make bench` run of {when} on {where} "
                        f"(torch {torch_version(sources[0])}, commit {commit(sources[0])}). The numbers, and "
                        "older runs with their readings, are in `benchmarks/RESULTS.md`."), ""]
    else:
        lines += [_para("Made by `benchmarks/report.py` from the JSON files of the runs named under each plot; "
                        "the numbers, and older runs with their readings, are in `benchmarks/RESULTS.md`."), ""]
    for png, (alt, d, names) in plots.items():
        lines.append(f"![{alt}]({rel}/{png})")
        if not (where and when):
            lines.append("*" + "; ".join(f"{n}: {nd.get('date', '?')}, {machine(nd)}, commit {commit(nd)}"
                                         for n, nd in names) + "*")
        lines.append("")
    lines[-1] = README_MARKERS[1]
    return "\n".join(lines)


def replace_section(text: str, markers: tuple, section: str, where) -> str:
    """text with the markers' section replaced by ``section`` (markers included), or, when
    absent, inserted at the line index ``where(lines)`` returns."""
    start, end = markers
    i, j = text.find(start), text.find(end)
    if i >= 0 and j > i:
        return text[:i] + section + text[j + len(end):]
    if i >= 0 or j >= 0:
        raise ValueError(f"only one of {start} / {end}, or in the wrong order: fix the file by hand")
    lines = text.split("\n")
    k = where(lines)
    before, after = lines[:k], lines[k:]
    while before and before[-1] == "":
        before.pop()
    while after and after[0] == "":
        after.pop(0)
    out = before + ([""] if before else []) + section.split("\n") + ([""] + after if after else [""])
    return "\n".join(out)


def after_intro(lines: list) -> int:
    """Index of the first level-2 heading (the section goes before it), else the end."""
    return next((k for k, line in enumerate(lines) if line.startswith("## ")), len(lines))


def end_of_benchmarks(lines: list) -> int:
    """Index of the heading after the README's Benchmarks section, else the end."""
    start = next((k for k, line in enumerate(lines) if re.match(r"##\s+benchmark", line, re.I)), None)
    if start is None:
        return len(lines)
    return next((k for k in range(start + 1, len(lines)) if re.match(r"#{1,2}\s", lines[k])), len(lines))


def _write_if_changed(path: str, data) -> bool:
    data = data.encode() if isinstance(data, str) else data
    try:
        with open(path, "rb") as f:
            if f.read() == data:
                return False
    except FileNotFoundError:
        pass
    with open(path, "wb") as f:
        f.write(data)
    return True


def update(path: str, markers: tuple, section: str, where) -> bool:
    try:
        with open(path) as f:
            text = f.read()
    except FileNotFoundError:
        text = ""
    return _write_if_changed(path, replace_section(text, markers, section, where))


# ---------------------------------------------------------------- main

def report(out_dir: str, results: str, readme: str) -> dict:
    """Writes the plots, RESULTS section and README section; returns {path: changed}."""
    import matplotlib
    matplotlib.use("Agg")
    found = load(out_dir)
    changed, plots = {}, {}
    steps = found["step"]
    if steps:
        names = list(steps)
        ref = steps[0][1]
        path = os.path.join(out_dir, "memory_by_stage.png")
        changed[path] = plot_memory(steps, path)
        plots["memory_by_stage.png"] = ("Peak memory per rank by variant and stage", ref, names)
        path = os.path.join(out_dir, "step_time_ratio.png")
        changed[path] = plot_ratio(steps, path)
        plots["step_time_ratio.png"] = ("Step time of each variant relative to DDP", ref, names)
    if found["adamw"]:
        path = os.path.join(out_dir, "adamw.png")
        changed[path] = plot_adamw(found["adamw"], path)
        plots["adamw.png"] = ("Fused AdamW throughput per variant against size", found["adamw"],
                              [("adamw.json", found["adamw"])])
    if found["checkpoint"]:
        path = os.path.join(out_dir, "checkpoint.png")
        changed[path] = plot_checkpoint(found["checkpoint"], path)
        plots["checkpoint.png"] = ("Checkpoint save and load time per variant", found["checkpoint"],
                                   [("checkpoint.json", found["checkpoint"])])
    changed[results] = update(results, RESULTS_MARKERS, results_section(found), after_intro)
    rel = os.path.relpath(os.path.abspath(out_dir), os.path.dirname(os.path.abspath(readme))).replace(os.sep, "/")
    changed[readme] = update(readme, README_MARKERS, readme_section(found, plots, rel), end_of_benchmarks)
    return changed


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out-dir", default=os.path.join(HERE, "out"), help="where the JSONs are and the PNGs go")
    ap.add_argument("--results", default=os.path.join(HERE, "RESULTS.md"))
    ap.add_argument("--readme", default=os.path.join(ROOT, "README.md"))
    args = ap.parse_args(argv)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("report.py needs matplotlib to draw the plots: pip install matplotlib "
              "(`make bench` installs it into .venv)", file=sys.stderr)
        return 2
    if not os.path.isdir(args.out_dir):
        print(f"report: {args.out_dir} does not exist: run the benchmarks first (make bench)", file=sys.stderr)
        return 1
    for path, was_changed in report(args.out_dir, args.results, args.readme).items():
        print(f"{'wrote    ' if was_changed else 'unchanged'} {os.path.relpath(path)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
