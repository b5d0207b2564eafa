"""No hang, ever: ranks that take different branches, die or stall end within
the watchdog's timeout + 30 s with an error that names the other rank and what
diverged, and leave no process behind (see [Note: watchdog] in comm/watchdog.py).

Real processes on gloo. As under torchrun, the store lives outside the ranks
(here in the test process, as torchrun's agent holds it), so a rank that has
already exited leaves its report readable."""

import os
import re
import sys
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import zeroshard as zs
from support.launch import launch

TIMEOUT = 4.0  # ZEROSHARD_TIMEOUT in the ranks


class Stall(nn.Module):
    """Identity; sleeps in its forward on the rank and call it is told to."""

    def __init__(self, rank, call, seconds):
        super().__init__()
        self.rank, self.call, self.seconds, self.calls = rank, call, seconds, 0

    def forward(self, x):
        self.calls += 1
        if dist.get_rank() == self.rank and self.calls == self.call:
            time.sleep(self.seconds)
        return x


def _model_and_opt(stage, stall=None):
    torch.manual_seed(0)
    layers = [nn.Linear(32, 32), nn.Tanh(), stall or nn.Identity(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 3)]
    model = nn.Sequential(*layers)
    if stage == 3:
        model = zs.FullyShard(model, wrap={nn.Linear})
        return model, zs.ShardedOptimizer(model.parameters(), lr=1e-2)
    return model, zs.ShardedOptimizer(model.parameters(), lr=1e-2, stage=stage, bucket_mb=1000 / 2**20)


def _train(model, opt, steps, skip=None):
    """``skip``: (rank, step) whose backward and step that rank skips, as a
    data-dependent ``continue`` would."""
    for k in range(steps):
        torch.manual_seed(100 + k)
        x, y = torch.randn(8, 32), torch.randint(0, 3, (8,))
        loss = F.cross_entropy(model(x), y)
        if skip == (dist.get_rank(), k):
            continue
        loss.backward()
        opt.step()
        opt.zero_grad()


def _scenario(name, stage, tmp):
    rank = dist.get_rank()
    if name == "state_dict_on_rank_0":
        model, opt = _model_and_opt(stage)
        _train(model, opt, 1)
        if rank == 0:
            opt.state_dict()
        _train(model, opt, 1)
    elif name == "skipped_backward":
        model, opt = _model_and_opt(stage)
        _train(model, opt, 3, skip=(1, 1))
        zs.save_checkpoint(os.path.join(tmp, "ckpt"), model, opt)
    elif name == "extra_step":
        model, opt = _model_and_opt(stage)
        _train(model, opt, 3 if rank == 1 else 2)
        zs.save_checkpoint(os.path.join(tmp, "ckpt"), model, opt)
    elif name == "sleeps_in_forward":
        model, opt = _model_and_opt(stage, stall=Stall(1, 2, 3 * TIMEOUT))
        _train(model, opt, 3)
    elif name == "checkpoint_on_rank_0":
        model, opt = _model_and_opt(stage)
        _train(model, opt, 1)
        if rank == 0:
            zs.save_checkpoint(os.path.join(tmp, "ckpt"), model, opt)
        _train(model, opt, 1)
    elif name == "pieces_on_rank_0":
        # a reduce-scatter in pieces (csrc/comm.h) that the other rank never joins
        zs._C.set_reduce_scatter_piece_bytes(64 << 10)
        world = dist.get_world_size()
        if rank == 0:
            x = torch.ones(world * 100_003)
            zs.reduce_scatter(x, x[:100_003], average=False, what="pieced").wait()
        else:
            zs.all_reduce(torch.ones(3), what="elsewhere").wait()
    elif name == "landing_on_rank_0":
        # a reduce-scatter landing in its input's sent chunks (csrc/comm.h) that no peer joins
        world = dist.get_world_size()
        if rank == 0:
            x = torch.ones(world * 1009)
            zs.reduce_scatter(x, x[:1009], average=False, input_is_scratch=True, what="landing").wait()
        else:
            zs.all_reduce(torch.ones(3), what="elsewhere").wait()
    elif name == "normal":
        model, opt = _model_and_opt(stage)
        _train(model, opt, 2)
        zs.save_checkpoint(os.path.join(tmp, "ckpt"), model, opt)
        return [(r["kind"], r["what"]) for r in zs.flight_record()]
    else:
        raise ValueError(name)
    return None


def _rank(rank, world, port, name, stage, tmp, env, results):
    os.environ.update(env)
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=120))
    try:
        out = ("ok", _scenario(name, stage, tmp))
    except Exception as e:  # noqa: BLE001 - report what the rank saw
        out = (type(e).__name__, str(e))
    results.put((rank, time.time()) + out)
    results.close()
    results.join_thread()
    sys.exit(0 if out[0] == "ok" else 3)  # a normal interpreter exit: it must not hang


def _run(name, stage, tmp_path, world=2, debug=False):
    """Every rank's (kind, message) and its time to end, after asserting that
    every process ended within TIMEOUT + 30 s of the start."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    env = {
        "ZEROSHARD_TIMEOUT": str(TIMEOUT),
        "GLOO_SOCKET_IFNAME": "lo",
        "ZEROSHARD_RECORD_DIR": str(tmp_path),
        "ZEROSHARD_DEBUG": "1" if debug else "0",
    }
    ctx = launch("processes")
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_rank, args=(r, world, store.port, name, stage, str(tmp_path), env, results))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    got = {}
    deadline = time.time() + 120  # process start and imports, then TIMEOUT + 30 s at most
    while len(got) < world and time.time() < deadline:
        try:
            rank, t, kind, msg = results.get(timeout=1)
        except Exception:  # noqa: BLE001 - queue.Empty
            if all(not p.is_alive() for p in procs) and results.empty():
                break
            continue
        got[rank] = (kind, msg, t)
    for p in procs:
        p.join(timeout=30)
    alive = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
    assert not alive, f"rank(s) {alive} still running: {got}"
    assert sorted(got) == list(range(world)), got
    ends = [got[r][2] for r in range(world)]
    assert max(ends) - min(ends) < TIMEOUT + 30, got
    return got


def _assert_names(msg, other, *words):
    # (named alone, or in a group of ranks in the same state: "ranks 1-2: ...")
    assert re.search(rf"\brank {other}\b|\branks [0-9, -]*\b{other}\b|\[{other}\]", msg.lower()), msg
    for w in words:
        assert w in msg, (w, msg)
    assert "What each rank last did" in msg and "zeroshard-flight-rank" in msg, msg


@pytest.mark.parametrize("stage", [2, 3])
def test_state_dict_on_rank_0_only(tmp_path, stage):
    got = _run("state_dict_on_rank_0", stage, tmp_path)
    kind0, msg0, _ = got[0]
    assert kind0 == "CollectiveTimeout" and "did not call it" in msg0, msg0
    _assert_names(msg0, 1, "ShardedOptimizer.state_dict()", "consolidate_state_dict(to=0)")
    kind1, msg1, _ = got[1]
    assert kind1 == "CollectiveTimeout", msg1
    _assert_names(msg1, 0, "check-in 'ShardedOptimizer.state_dict()'")


def _both_name_the_other(got, *words):
    for r, other in ((0, 1), (1, 0)):
        kind, msg, _ = got[r]
        assert kind == "CollectiveTimeout", msg
        _assert_names(msg, other, "first differ at collective #", *words)


def test_a_skipped_backward(tmp_path):
    got = _run("skipped_backward", 2, tmp_path)
    _both_name_the_other(
        got,
        "rank 0 issued #",
        "(step 3, bucket 0 reduce-scatter); rank 1 issued #",
        "check_in of 0 bytes (save_checkpoint())",
    )


def test_a_skipped_backward_at_zero3_names_each_ranks_step_and_phase(tmp_path):
    """Rank 1 skips step 2's backward and step: rank 0 waits in step 2's backward
    all-gathers while rank 1 (whose step 2 never happened) gathers for step 2's forward again."""
    got = _run("skipped_backward", 3, tmp_path)
    _both_name_the_other(
        got, "rank 0 issued #", "(step 2 backward, unit '", "rank 1 issued #", "(step 2 forward, unit '"
    )


def test_one_extra_step(tmp_path):
    _both_name_the_other(_run("extra_step", 3, tmp_path), "check_in of 0 bytes (save_checkpoint())", "unit '")


def test_a_rank_sleeping_past_the_timeout_in_forward(tmp_path):
    got = _run("sleeps_in_forward", 3, tmp_path)
    kind0, msg0, _ = got[0]
    assert kind0 == "CollectiveTimeout" and "did not complete within 4 s" in msg0, msg0
    _assert_names(msg0, 1, "Rank 1 did not answer", "all-gather")
    kind1, msg1, _ = got[1]  # wakes after rank 0 gave up: its collective fails, rank 0's report explains
    assert kind1 == "CollectiveTimeout", msg1
    _assert_names(msg1, 0, "cause: timed out in #")


def test_a_checkpoint_save_entered_by_one_rank(tmp_path):
    got = _run("checkpoint_on_rank_0", 2, tmp_path)
    _both_name_the_other(got, "check_in of 0 bytes (save_checkpoint())", "step 2, bucket 0 reduce-scatter")
    assert not os.path.exists(tmp_path / "ckpt")  # nothing half-written in its place


def test_a_reduce_scatter_in_pieces_entered_by_one_rank(tmp_path):
    """Its thread waits for pieces that never come: the watchdog reports it, the
    handle parks the thread, and both processes end."""
    got = _run("pieces_on_rank_0", 2, tmp_path)
    _both_name_the_other(got, "(pieced)", "(elsewhere)")


def test_a_reduce_scatter_landing_in_sent_chunks_entered_by_one_rank(tmp_path):
    """At three ranks its thread waits for a send no peer receives: the watchdog
    reports it, the handle parks the thread, and every process ends."""
    got = _run("landing_on_rank_0", 2, tmp_path, world=3)
    _both_name_the_other(got, "(landing)", "(elsewhere)")


def test_debug_mode_names_both_sides_of_a_mismatch_before_data_moves(tmp_path):
    got = _run("extra_step", 2, tmp_path, debug=True)
    for r in (0, 1):
        kind, msg, _ = got[r]
        assert kind == "CollectiveMismatch", msg
        assert "rank 0: check_in of 0 bytes (save_checkpoint())" in msg, msg
        assert "rank 1: reduce_scatter of" in msg and "(step 3, bucket 0 reduce-scatter)" in msg, msg


def test_debug_mode_passes_a_correct_script_and_records_every_collective(tmp_path):
    got = _run("normal", 3, tmp_path, debug=True)
    assert got[0][0] == "ok" and got[1][0] == "ok", got
    kinds = got[0][1]
    assert kinds == got[1][1]
    assert [k for k, _ in kinds].count("reduce_scatter") == 2 * 3  # 3 units, 2 steps
    assert kinds[-1] == ("all_gather", "checkpoint outcome exchange (object bytes)")


def test_set_timeout_validates_and_overrides_the_environment(monkeypatch):
    from zeroshard.comm import watchdog as _incident

    monkeypatch.setenv("ZEROSHARD_TIMEOUT", "7")
    assert _incident.timeout() == 7.0
    zs.set_timeout(2.5)
    try:
        assert _incident.timeout() == 2.5
    finally:
        zs.set_timeout(None)
    assert _incident.timeout() == 7.0
    with pytest.raises(ValueError, match="positive number"):
        zs.set_timeout(0)
    monkeypatch.setenv("ZEROSHARD_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="ZEROSHARD_TIMEOUT='soon'"):
        _incident.timeout()


def test_the_diagnosis_names_the_first_difference_and_the_silent_ranks():
    from zeroshard.comm import watchdog as _incident

    def rec(seq, kind, what, end=1.0, numel=10):
        return {
            "seq": seq,
            "group": "0",
            "kind": kind,
            "what": what,
            "numel": numel,
            "dtype": "float32",
            "start": 0.0,
            "end": end,
        }

    reports = {
        0: {
            "cause": "timed out in #3",
            "records": [
                rec(1, "all_reduce", "a"),
                rec(2, "all_gather", "b"),
                rec(3, "all_gather", "state_dict gather", None),
            ],
        },
        1: {
            "cause": "timed out in #3",
            "records": [
                rec(1, "all_reduce", "a"),
                rec(2, "all_gather", "b"),
                rec(3, "reduce_scatter", "step 2", None, 40),
            ],
        },
        3: {"cause": "failed", "records": [rec(1, "all_reduce", "a"), rec(2, "all_gather", "b")]},
    }
    text = _incident.diagnose(reports, "0", 4, now=5.0)
    assert (
        "first differ at collective #3 on process group '0': rank 0 issued #3 all_gather of 10 float32 "
        "(state_dict gather); rank 1 issued #3 reduce_scatter of 40 float32 (step 2); rank 3 never issued it "
        "(its last: #2 all_gather of 10 float32 (b))" in text
    ), text
    assert (
        "rank 0: last started #3 all_gather of 10 float32 (state_dict gather), not completed after 5 s; "
        "last completed #2" in text
    ), text
    assert "Rank 2 did not answer" in text
    same = {r: reports[0] for r in (0, 1)}
    assert _incident.first_difference(same, "0") is None
