"""The chaos run's short version (benchmarks/specs/chaos.py): the example GPT under real
`torch.distributed.run --max-restarts 2` launches with ranks SIGKILLed. Five kills (in the
middle of a background save, of resume's load, of a blocking save, in backward, and by the
driver at a wall-clock time) with the world size going 2 -> 3 once the first launch has used
its restarts: the job must end with the uninterrupted run's state, load no torn checkpoint,
redo at most a checkpoint interval, and have the survivors gone within the watchdog's
timeout + 30 s. Two kills (in step() and in forward) at a fixed world size: bitwise the
uninterrupted run's state."""

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
from benchmarks.specs import chaos  # noqa: E402


def _chaos(tmp_path, kills, kind, phases):
    args = chaos.parse(
        [
            "--kills",
            str(kills),
            "--kills-per-run",
            str(kills),
            "--kinds",
            kind,
            "--restarts",
            "2",
            "--phases",
            ",".join(phases),
            "--in-order",
            "--driver-delay",
            "2",
            "--work",
            str(tmp_path),
            "--json",
            "",
        ]
    )
    s = chaos.run_all(args)
    assert s["runs"] == 1 and s["runs_ok"] == 1, s["runs_detail"]
    assert s["kills"] == kills and all(s["by_phase"][p] == phases.count(p) for p in phases), s["by_phase"]
    return args, s, s["runs_detail"][0]


@pytest.mark.timeout(240)
def test_a_job_survives_five_kills_and_a_world_size_change(tmp_path):
    args, s, run = _chaos(tmp_path, 5, "changing", ["background save", "load", "save", "backward", "driver"])
    assert [la["world"] for la in run["launches"]] == [2, 3], run  # relaunched at 3 ranks
    assert s["restarts"] == 4, run
    assert s["bad_resumes"] == [], s["bad_resumes"]  # nothing torn or stale loaded
    assert s["warned"] >= 1 and s["torn"] >= 1, s  # a killed save left one, refused
    lost = s["redone"]
    assert len(lost) == 5 and None not in lost and max(lost) <= args.every, lost
    assert len(s["exit_s"]) == 5 and max(s["exit_s"]) <= args.watchdog + 30, s["exit_s"]
    assert chaos.within(run["diff"], args.tolerance), run["diff"]  # the uninterrupted run's state
    assert s["written"] >= args.steps // args.every, s["written"]


@pytest.mark.timeout(180)
def test_at_a_fixed_world_size_the_job_ends_bitwise_as_uninterrupted(tmp_path):
    _, s, run = _chaos(tmp_path, 2, "fixed2", ["step", "forward"])
    assert [la["world"] for la in run["launches"]] == [2] and s["restarts"] == 2, run
    assert run["diff"]["equal"], run["diff"]
