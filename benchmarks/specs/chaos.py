"""A chaos run: the example GPT trained under ``torchrun --max-restarts`` while ranks are
SIGKILLed, many times; the job must end with an uninterrupted run's result.

Each run trains ``benchmarks/chaos_job.py`` (the tiny GPT at ZeRO-3, CPU, gloo;
data a pure function of the step) from scratch in its own directory, through
one or more torchrun launches (``--standalone --nproc-per-node W
--max-restarts K``). Every attempt but the run's last is killed once:

* by the job itself (``os.kill(os.getpid(), SIGKILL)`` at a rank, step and
  phase drawn here and passed in ``plan<launch>.json``): in forward, in backward,
  in ``step()``, in the middle of a blocking save and of a background save
  (at one of its fsyncs), while ``zeroshard.resume`` loads a checkpoint;
* or by this driver, at a random wall-clock time after the attempt's
  processes started (import, rendezvous, resume, training, saving).

A launch whose attempts are all killed has used its restarts and fails;
the driver then launches the run again, in "changing" runs with the other
world size (2 <-> 3), in "fixed" runs with the same. The report: kills by
phase, restarts, relaunches, checkpoints written, torn checkpoints found
(zeroshard.resume's warnings and the job's own check of every byte) and
whether one was ever loaded, steps redone after each kill, the time from a
kill to the surviving ranks' exit (this driver polls their processes), and
the final parameters and AdamW state against an uninterrupted run's at the
run's final world size (exactly equal in fixed runs; within ``--tolerance``
across world-size changes, where the reduction order differs).

    python -m benchmarks chaos --kills 100            # writes benchmarks/out/chaos.json
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import date

import torch

from benchmarks import harness
from benchmarks.harness import opt

JOB = os.path.join(harness.HERE, "chaos_job.py")
ROOT = harness.ROOT
SELF_PHASES = ["forward", "backward", "step", "save", "background save", "load"]
PHASES = SELF_PHASES + ["driver"]


# ------------------------------------------------------------------ the plan
def draw(rng: random.Random, phase: str, world: int, every: int, driver_delay: float = 3.5) -> dict:
    """One attempt's kill: the rank, and where (see chaos_job.py's docstring)."""
    rank = rng.randrange(world)
    kill = dict(phase=phase, rank=rank, after=rng.randint(1, 2 * every))
    if phase in ("forward", "backward"):
        kill["at"] = rng.randrange(4)  # the tiny GPT's blocks
    elif phase == "step":
        kill.update(after=rng.randint(2, 2 * every), frac=rng.random())
    elif phase in ("save", "background save"):
        kill.update(after=rng.randint(1, every), at=rng.randint(1, 5 if rank == 0 else 2))
    elif phase == "load":
        kill["at"] = rng.randint(1, 30)  # block reads: each rank makes 36 or more
    else:
        kill["delay"] = rng.uniform(0.0, driver_delay)  # s after the attempt's ranks started
    return kill


class Phases:
    """Every phase in turn, in a shuffled order per round, so all are hit about equally."""

    def __init__(self, rng: random.Random, phases=PHASES, shuffle: bool = True):
        self.rng, self.phases, self.shuffle, self.queue = rng, list(phases), shuffle, []

    def next(self) -> str:
        if not self.queue:
            self.queue = self.rng.sample(self.phases, len(self.phases)) if self.shuffle else self.phases[::-1]
        return self.queue.pop()


# ------------------------------------------------------------------ launching
def alive(pid: int) -> bool:
    """Running (not exited, not a zombie waiting for torchrun to reap it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


class Watch:
    """One launch's events as they arrive: the driver's kills, and each kill's survivors
    polled until they exit."""

    def __init__(self, run_dir: str, launch: int, plan: dict, world: int):
        self.path, self.launch, self.plan, self.world = os.path.join(run_dir, "events.jsonl"), launch, plan, world
        self.pos, self.pids, self.started, self.fired = 0, {}, {}, set()
        self.pending = []  # (kill time, {survivor pid}) not yet all exited
        self.exits = []  # (kill event, seconds to the survivors' exit)
        self.progress = {}  # attempt -> the victim's last event

    def events(self):
        if not os.path.exists(self.path):
            return []
        with open(self.path) as f:
            f.seek(self.pos)
            text = f.read()
        whole = text[: text.rfind("\n") + 1]
        self.pos += len(whole.encode())
        return [e for e in map(json.loads, whole.splitlines()) if e.get("launch") == self.launch]

    def poll(self):
        now = time.time()
        for e in self.events():
            a = e["attempt"]
            if e["ev"] == "start":
                self.pids[(a, e["rank"])] = e["pid"]
                if sum(k[0] == a for k in self.pids) == self.world:
                    self.started[a] = now
            elif e["ev"] == "kill":
                self.survivors(e)
            self.progress[(a, e["rank"])] = e["ev"]
        for a, t in list(self.started.items()):
            k = self.plan.get(str(a))
            if k and k["phase"] == "driver" and a not in self.fired and now >= t + k["delay"]:
                self.driver_kill(a, k)
        for item in list(self.pending):
            kill, pids = item
            if not any(alive(p) for p in pids):
                self.exits.append((kill, time.time() - kill["t"]))
                self.pending.remove(item)

    def survivors(self, kill: dict):
        pids = {p for (a, r), p in self.pids.items() if a == kill["attempt"] and r != kill["rank"]}
        self.pending.append((kill, pids))

    def driver_kill(self, attempt: int, k: dict):
        self.fired.add(attempt)
        pid = self.pids[(attempt, k["rank"])]
        if not alive(pid) or self.progress.get((attempt, k["rank"])) in ("done", "error"):
            return
        last = self.progress.get((attempt, k["rank"]), "start")
        kill = dict(
            ev="kill",
            t=time.time(),
            launch=self.launch,
            attempt=attempt,
            rank=k["rank"],
            world=self.world,
            by="driver",
            phase="driver",
            last_event=last,
        )
        os.kill(pid, signal.SIGKILL)
        with open(self.path, "a") as f:  # read back by events() as the job's kills are
            f.write(json.dumps(kill) + "\n")


def launch(run_dir: str, idx: int, world: int, restarts: int, plan: dict, job_args: list, timeout: float):
    """One torchrun launch of the job; (return code, [(kill, seconds to the survivors' exit)])."""
    plan_file = os.path.join(run_dir, f"plan{idx}.json")
    with open(plan_file, "w") as f:
        json.dump(plan, f)
    env = dict(
        os.environ, OMP_NUM_THREADS="1", CHAOS_LAUNCH=str(idx), CHAOS_PLAN=plan_file, ZEROSHARD_RECORD_DIR=run_dir
    )
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(world),
        "--max-restarts",
        str(restarts),
        JOB,
        "--run-dir",
        run_dir,
        *job_args,
    ]
    watch = Watch(run_dir, idx, plan, world)
    with open(os.path.join(run_dir, f"launch{idx}.log"), "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        end = time.time() + timeout
        while True:
            ended = proc.poll() is not None
            watch.poll()  # (after the end: what the last processes wrote)
            if ended and not watch.pending:
                break
            if time.time() > end:
                proc.kill()
                raise RuntimeError(f"launch {idx} of {run_dir} ran past {timeout} s; see launch{idx}.log")
            time.sleep(0.02)
    return proc.returncode, watch.exits


def chaos_run(run_dir: str, kind: str, kills: int, rng: random.Random, phases: Phases, args) -> dict:
    """One run from scratch, launched until the job completes: its launches (world size,
    return code, planned kills, each kill's seconds to the survivors' exit)."""
    os.makedirs(run_dir)
    world, planned, launches = (3 if kind == "fixed3" else 2), 0, []
    while True:
        attempts = args.restarts + 1
        n = min(kills - planned, attempts)
        plan = {str(a): draw(rng, phases.next(), world, args.every, args.driver_delay) for a in range(n)}
        rc, exits = launch(run_dir, len(launches), world, args.restarts, plan, job_args(args), args.launch_timeout)
        launches.append(dict(world=world, rc=rc, planned=n, exits=[s for _, s in exits]))
        planned += n
        if rc == 0 or n < attempts:  # done, or failed with restarts left: the job did not come up
            break
        if kind == "changing":
            world = 5 - world  # 2 <-> 3
    return dict(dir=run_dir, kind=kind, launches=launches, ok=rc == 0)


def job_args(args) -> list:
    return ["--steps", str(args.steps), "--every", str(args.every)]


# ------------------------------------------------------------------ the record
def load_events(run_dir: str) -> list:
    with open(os.path.join(run_dir, "events.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def redone(ev: list) -> list:
    """Steps redone after each kill: the steps the killed attempt had completed (none if it
    died before resuming) less the step the next resumed attempt started from."""
    order = sorted({(e["launch"], e["attempt"]) for e in ev})
    done, resumed = {}, {}
    for e in ev:
        key = (e["launch"], e["attempt"])
        if e["ev"] == "step":
            done[key] = max(done.get(key, 0), e["step"])
        elif e["ev"] == "resumed" and e["rank"] == 0:
            resumed[key] = e["step"]
    out = []
    for k in (e for e in ev if e["ev"] == "kill"):
        key = (k["launch"], k["attempt"])
        if key not in resumed:
            out.append(0)
            continue
        later = [resumed[a] for a in order[order.index(key) + 1 :] if a in resumed]
        out.append(max(done.get(key, resumed[key]), resumed[key]) - later[0] if later else None)
    return out


def checkpoints(ev: list, run: str) -> dict:
    """Written, torn (distinct directories the job's check found incomplete at a resume),
    refused by zeroshard.resume (its warnings), and resumes that loaded a torn checkpoint
    or not the newest complete one."""
    torn, warned, bad = set(), 0, []
    for e in (e for e in ev if e["ev"] == "resumed" and e["rank"] == 0):
        seen = e["seen"] or {}
        torn |= {(run, d) for d, ok in seen.items() if not ok}
        warned += len(e["skipped"])
        newest = max((int(d[5:]) for d, ok in seen.items() if ok and d.startswith("step_")), default=0)
        if e["step"] != newest or (e["step"] and not seen.get(f"step_{e['step']:06d}")):
            bad.append(dict(launch=e["launch"], attempt=e["attempt"], step=e["step"], newest=newest))
        warned_dirs = " ".join(e["skipped"])
        torn_unwarned = [d for d, ok in seen.items() if not ok and d not in warned_dirs and _newer_than(d, newest)]
        bad += [dict(launch=e["launch"], attempt=e["attempt"], unwarned=d) for d in torn_unwarned]
    written = sum(1 for e in ev if e["ev"] == "saved" and e["rank"] == 0)
    return dict(written=written, torn=torn, warned=warned, bad=bad)


def _newer_than(name: str, step: int) -> bool:
    """A torn directory's step is newer than ``step`` (``.step_000012.partial-*``, ``step_000012``)."""
    digits = name.lstrip(".").split(".")[0].removeprefix("step_")
    return digits.isdigit() and int(digits) > step


def final_state(ckpt: str) -> dict:
    """A checkpoint's parameters and AdamW state, loaded into the plain example GPT and
    torch.optim.AdamW (no process group): {"param:name" / "exp_avg:name" / ...: tensor}."""
    import zeroshard as zs
    from train_gpt import build_model  # (examples/, on the path the harness sets)

    model = build_model("tiny", vocab=64)
    opt = torch.optim.AdamW(model.parameters())
    zs.load_checkpoint(ckpt, model, opt)
    out = {}
    for name, p in model.named_parameters():
        out[f"param:{name}"] = p.detach().clone()
        for k, v in opt.state[p].items():
            out[f"{k}:{name}"] = v.clone() if torch.is_tensor(v) else torch.tensor(v)
    return out


def difference(a: dict, b: dict) -> dict:
    """{"equal": bitwise equal everywhere, "param" / "exp_avg" / "exp_avg_sq" / "step": the
    relative difference ||a - b|| / ||b|| over every tensor of that kind}. (Per element, some
    differ by up to the learning rate across world sizes: the key part of each qkv bias has
    an exactly zero gradient, softmax being invariant to it, so its computed gradient is
    rounding noise, which AdamW's normalisation turns into updates of the learning rate's size.)"""
    if a.keys() != b.keys():
        raise ValueError(f"different state: {sorted(a.keys() ^ b.keys())[:4]}")
    out, num, den = {"equal": all(torch.equal(a[k], b[k]) for k in a)}, {}, {}
    for k in a:
        kind = k.split(":", 1)[0]
        x, y = a[k].double(), b[k].double()
        num[kind] = num.get(kind, 0.0) + ((x - y) ** 2).sum().item()
        den[kind] = den.get(kind, 0.0) + (y**2).sum().item()
    out.update({kind: (num[kind] / max(den[kind], 1e-300)) ** 0.5 for kind in num})
    return out


def reference(out_dir: str, world: int, args) -> dict:
    """The uninterrupted run's final state at ``world`` ranks (one launch, no kills)."""
    run_dir = os.path.join(out_dir, f"reference_w{world}")
    os.makedirs(run_dir)
    rc, _ = launch(run_dir, 0, world, 0, {}, job_args(args), args.launch_timeout)
    if rc != 0:
        raise RuntimeError(f"the uninterrupted run at world size {world} failed: see {run_dir}/launch0.log")
    return final_state(os.path.join(run_dir, "ckpt", f"step_{args.steps:06d}"))


# ------------------------------------------------------------------ the report
def summarize(runs: list, refs: dict, args) -> dict:
    """Every run's events and final state, put together against the targets."""
    kills, lost, exits, restarts, relaunches, written, warned, torn, bad, errors = [], [], [], 0, 0, 0, 0, set(), [], {}
    for r in runs:
        ev = load_events(r["dir"])
        kills += [e for e in ev if e["ev"] == "kill"]
        lost += redone(ev)
        exits += [s for la in r["launches"] for s in la["exits"]]
        restarts += len({(e["launch"], e["attempt"]) for e in ev if e["ev"] == "start" and e["attempt"] > 0})
        relaunches += len(r["launches"]) - 1
        c = checkpoints(ev, r["dir"])
        written, warned, torn, bad = written + c["written"], warned + c["warned"], torn | c["torn"], bad + c["bad"]
        for e in (e for e in ev if e["ev"] == "error"):  # ranks that raised before torchrun stopped them
            errors[e["error"][:160]] = errors.get(e["error"][:160], 0) + 1
        final = os.path.join(r["dir"], "ckpt", f"step_{args.steps:06d}")
        world = r["launches"][-1]["world"]
        r["diff"] = difference(final_state(final), refs[world]) if r["ok"] else None
        r["changed"] = len({la["world"] for la in r["launches"]}) > 1
    fixed = [r for r in runs if not r["changed"]]
    changing = [r for r in runs if r["changed"]]
    return dict(
        kills=len(kills),
        by_phase={
            p: sum(k["phase"] == p for k in kills) for p in PHASES + sorted({k["phase"] for k in kills} - set(PHASES))
        },
        moved=sum(1 for k in kills if k["by"] == "self" and k["planned"] != k["phase"]),  # no load to kill in
        restarts=restarts,
        relaunches=relaunches,
        runs=len(runs),
        runs_ok=sum(r["ok"] for r in runs),
        written=written,
        torn=len(torn),
        warned=warned,
        bad_resumes=bad,
        redone_max=max((x for x in lost if x is not None), default=0),
        redone_unknown=lost.count(None),
        redone=[x for x in lost],
        exit_s=exits,
        survivor_errors=errors,
        fixed_equal=sum(1 for r in fixed if r["diff"] and r["diff"]["equal"]),
        fixed=len(fixed),
        changing_within=sum(1 for r in changing if r["diff"] and within(r["diff"], args.tolerance)),
        changing=len(changing),
        changing_max={
            k: max((r["diff"][k] for r in changing if r["diff"]), default=0.0)
            for k in ("param", "exp_avg", "exp_avg_sq", "step")
        },
        reference_w2_vs_w3=difference(refs[2], refs[3]) if len(refs) == 2 else None,
    )


def within(diff: dict, tol: float) -> bool:
    return diff["step"] == 0 and all(diff[k] <= tol for k in ("param", "exp_avg", "exp_avg_sq"))


def table(s: dict, args) -> str:
    bound = args.watchdog + 30
    ex = s["exit_s"] or [0.0]
    lost = [x for x in s["redone"] if x is not None] or [0]
    phases = ", ".join(f"{p} {n}" for p, n in s["by_phase"].items())
    rows = [
        ("kills", f"{s['kills']} ({phases})", f">= {args.kills}", s["kills"] >= args.kills),
        (
            "restarts by torchrun / relaunches (world size 2 <-> 3 in changing runs)",
            f"{s['restarts']} / {s['relaunches']}",
            "-",
            True,
        ),
        (
            "runs ending with the uninterrupted run's result",
            f"{s['fixed_equal'] + s['changing_within']} of {s['runs']}",
            "all",
            s["fixed_equal"] + s["changing_within"] == s["runs"],
        ),
        ("checkpoints written", str(s["written"]), "-", True),
        ("torn checkpoints found (resume's warnings)", f"{s['torn']} ({s['warned']})", "all refused", True),
        ("torn or not-newest checkpoints loaded", str(len(s["bad_resumes"])), "0", not s["bad_resumes"]),
        (
            "steps redone after a kill: max (mean)",
            f"{max(lost)} ({statistics.mean(lost):.1f})",
            f"<= {args.every}",
            max(lost) <= args.every and s["redone_unknown"] == 0,
        ),
        (
            "kill -> surviving ranks exited, s: max (median)",
            f"{max(ex):.2f} ({statistics.median(ex):.2f})",
            f"<= {bound:.0f}",
            max(ex) <= bound and len(s["exit_s"]) == s["kills"],
        ),
        (
            "final state, fixed world size: bitwise equal",
            f"{s['fixed_equal']} of {s['fixed']} runs",
            "all",
            s["fixed_equal"] == s["fixed"],
        ),
        (
            "final state across world-size changes: max rel. diff param / exp_avg / exp_avg_sq",
            " / ".join(f"{s['changing_max'][k]:.1e}" for k in ("param", "exp_avg", "exp_avg_sq"))
            + f" ({s['changing_within']} of {s['changing']} runs within)",
            f"<= {args.tolerance:.0e}",
            s["changing_within"] == s["changing"],
        ),
    ]
    ref = s["reference_w2_vs_w3"]
    if ref:
        rows.append(
            (
                "for scale: uninterrupted runs at 2 and 3 ranks, rel. diff",
                " / ".join(f"{ref[k]:.1e}" for k in ("param", "exp_avg", "exp_avg_sq")),
                "-",
                True,
            )
        )
    lines = ["| | measured | target | at target |", "|---|---|---|---|"]
    lines += [f"| {a} | {b} | {c} | {'yes' if d else 'NO'} |" for a, b, c, d in rows]
    return "\n".join(lines), all(d for *_, d in rows)


JSON = "chaos.json"  # --json '': none
OPTIONS = [
    opt("--kills", type=int, default=100, help="kills in all (runs are added until reached)"),
    opt("--kills-per-run", type=int, default=8),
    opt("--restarts", type=int, default=3, help="torchrun --max-restarts of each launch"),
    opt("--steps", type=int, default=24),
    opt("--every", type=int, default=4, help="checkpoint interval (steps)"),
    opt(
        "--tolerance",
        type=float,
        default=1e-3,
        help="largest relative difference across world-size changes (fp32 reduction order)",
    ),
    opt(
        "--phases",
        default=",".join(PHASES),
        help="the kills' phases, each in turn (shuffled per round unless --in-order)",
    ),
    opt("--in-order", action="store_true", help="the phases exactly in the order given"),
    opt("--watchdog", type=float, default=60, help="ZEROSHARD_TIMEOUT of the job (seconds)"),
    opt("--kinds", default="fixed2,changing,fixed3,changing", help="run kinds, in turn"),
    opt(
        "--driver-delay",
        type=float,
        default=3.5,
        help="the driver kills within this many seconds "
        "of an attempt's ranks starting (import, rendezvous, resume, the first steps)",
    ),
    opt("--seed", type=int, default=0),
    opt("--launch-timeout", type=float, default=600),
    opt("--work", default=None, help="where runs go (default: a temporary directory, removed)"),
]


def parse(argv=None):
    return harness.parse("chaos", argv)


def run(args) -> int:
    return 0 if report(run_all(args), args) else 1


def run_all(args):
    os.environ["ZEROSHARD_TIMEOUT"] = str(args.watchdog)
    work = args.work or tempfile.mkdtemp(prefix="zeroshard-chaos-")
    rng, t0 = random.Random(args.seed), time.time()
    phases, kinds = Phases(rng, args.phases.split(","), not args.in_order), args.kinds.split(",")
    runs, kills = [], 0
    while kills < args.kills:
        run = chaos_run(
            os.path.join(work, f"run{len(runs)}"),
            kinds[len(runs) % len(kinds)],
            min(args.kills_per_run, args.kills - kills),
            rng,
            phases,
            args,
        )
        runs.append(run)
        kills += sum(1 for e in load_events(run["dir"]) if e["ev"] == "kill")
        print(f"run {len(runs) - 1} ({run['kind']}): {kills} kills so far, {time.time() - t0:.0f} s", flush=True)
        if not run["ok"]:
            break
    refs = {w: reference(work, w, args) for w in sorted({r["launches"][-1]["world"] for r in runs})}
    s = summarize(runs, refs, args)
    s.update(wall_s=time.time() - t0, runs_detail=[{k: r[k] for k in ("kind", "launches", "ok", "diff")} for r in runs])
    if args.work is None:
        shutil.rmtree(work, ignore_errors=True)
    return s


def report(s: dict, args) -> bool:
    text, ok = table(s, args)
    print(f"\nchaos: {s['kills']} kills over {s['runs']} runs in {s['wall_s']:.0f} s\n{text}")
    if args.json:
        os.makedirs(os.path.dirname(args.json), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(
                dict(date=str(date.today()), torch=torch.__version__, args=vars(args), at_target=ok, table=text, **s),
                f,
                indent=1,
                default=str,
            )
    return ok
