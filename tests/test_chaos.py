"""The chaos run's short version (benchmarks/chaos.py): the example GPT under real
`torch.distributed.run --max-restarts 2` launches, five ranks SIGKILLed (in the middle of a
background save, of resume's load, of a blocking save, in backward, and by the driver at a
wall-clock time), the world size going 2 -> 3 when the first launch has used its restarts.
It must end with the uninterrupted run's state, load no torn checkpoint, redo at most a
checkpoint interval, and have the survivors gone within the watchdog's timeout + 30 s."""
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import chaos  # noqa: E402

PHASES = ["background save", "load", "save", "backward", "driver"]


@pytest.mark.timeout(240)
def test_a_job_survives_five_kills_and_a_world_size_change(tmp_path):
    args = chaos.parse([
        "--kills", "5", "--kills-per-run", "5", "--kinds", "changing", "--restarts", "2",
        "--phases", ",".join(PHASES), "--in-order", "--driver-delay", "2", "--work", str(tmp_path), "--out", ""])
    s = chaos.run_all(args)
    detail = s["runs_detail"]
    assert s["runs"] == 1 and s["runs_ok"] == 1, detail
    assert [la["world"] for la in detail[0]["launches"]] == [2, 3], detail     # relaunched at 3 ranks
    assert s["kills"] == 5 and s["restarts"] >= 4, (s["by_phase"], detail)
    assert s["bad_resumes"] == [], s["bad_resumes"]                            # nothing torn or stale loaded
    assert s["warned"] >= 1 and s["torn"] >= 1, s                             # a killed save left one, refused
    lost = s["redone"]
    assert len(lost) == 5 and None not in lost and max(lost) <= args.every, lost
    assert len(s["exit_s"]) == 5 and max(s["exit_s"]) <= args.watchdog + 30, s["exit_s"]
    diff = detail[0]["diff"]
    assert chaos.within(diff, args.tolerance), diff                            # the uninterrupted run's state
    assert s["written"] >= args.steps // args.every, s["written"]
