"""save_checkpoint(..., background=True): the checkpoint is the state at the call,
byte for byte what a blocking save writes, while training goes on; failures reach
every rank through the Future; the next save, a load and the process's exit wait
for it (gloo, world sizes 2 and 4)."""

import os
import warnings

import pytest
import torch
import torch.distributed as dist

import zeroshard as zs
from support.checks import max_err
from support.ddp_parity import trained_hybrid
from support.disk import HeldWrite, dir_bytes
from support.gpt import build, train
from support.jobs import TINY_SCRIPT
from support.launch import launch

from zeroshard.checkpoint import files


def _background_equals_blocking(kind, root):
    model, opt = build(kind)
    train(model, opt, 3)
    zs.save_checkpoint(os.path.join(root, "blocking"), model, opt, extra={"step": 3})
    extra = {"step": 3}
    with HeldWrite() as held:
        done = zs.save_checkpoint(os.path.join(root, "background"), model, opt, extra=extra, background=True)
        if kind != "ddp" or dist.get_rank() == 0:  # (DDP: rank 0 writes the replicated state)
            assert held.started.wait(60)  # the thread is at the write; training changes the state
        extra["step"] = 99
        train(model, opt, 2, first_step=3)
        assert not done.done()
        held.release()
        assert done.result(timeout=120) is None
    dist.barrier()
    same = dir_bytes(os.path.join(root, "blocking")) == dir_bytes(os.path.join(root, "background"))
    again, again_opt = build(kind, seed=7)
    got = zs.load_checkpoint(os.path.join(root, "background"), again, again_opt)
    train(again, again_opt, 2, first_step=3)
    return same, got, max_err(again.state_dict(), model.state_dict())


@pytest.mark.parametrize("kind", ["ddp", 2, 3], ids=["ddp", "zero2", "zero3"])
def test_a_background_save_writes_the_state_at_the_call_while_training_goes_on(tmp_path, kind):
    for same, got, err in launch("pool", 2).run(_background_equals_blocking, kind, str(tmp_path)):
        assert same  # byte for byte the blocking save's files
        assert got == {"step": 3}
        assert err == 0.0  # resumed from it, the two steps after it match


def _failures(root):
    rank = dist.get_rank()
    model, opt = build(2)
    train(model, opt, 2)
    path = os.path.join(root, "ck")
    zs.save_checkpoint(path, model, opt, extra={"step": 2})
    train(model, opt, 1, first_step=2)
    real, msgs = files.write_safetensors, {}

    def disk_full(*args, **kw):
        raise OSError(28, "No space left on device")

    if rank == 1:
        files.write_safetensors = disk_full
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            done = zs.save_checkpoint(path, model, opt, extra={"step": 3}, background=True)
            try:
                done.result(timeout=120)
            except Exception as e:  # noqa: BLE001
                msgs["one_rank"] = f"{type(e).__name__}: {e}"
        msgs["warned"] = any("background save" in str(w.message) and path in str(w.message) for w in seen)
    finally:
        files.write_safetensors = real
    again, again_opt = build(2, seed=7)
    msgs["still"] = zs.load_checkpoint(path, again, again_opt)
    msgs["left"] = sorted(os.listdir(root))
    dist.barrier()
    mine = os.path.join(root, "mine")
    if rank == 0:
        os.makedirs(mine)
        open(os.path.join(mine, "notes.txt"), "w").write("keep me")
    dist.barrier()
    try:
        zs.save_checkpoint(mine, model, opt, background=True).result(timeout=120)
    except zs.CheckpointError as e:
        msgs["not_a_checkpoint"] = str(e)
    msgs["kept"] = open(os.path.join(mine, "notes.txt")).read()
    return msgs


def test_a_failed_background_save_raises_from_result_on_every_rank(tmp_path):
    m0, m1 = launch("pool", 2).run(_failures, str(tmp_path))
    assert m1["one_rank"] == "OSError: [Errno 28] No space left on device", m1
    assert m0["one_rank"] == "CheckpointError: rank 1 failed: OSError: [Errno 28] No space left on device", m0
    for m in (m0, m1):
        assert m["warned"], m
        assert m["still"] == {"step": 2}, m  # the previous checkpoint is intact
        assert m["left"] == ["ck"], m  # and the partial directory is gone
        assert "not a zeroshard checkpoint; refusing" in m["not_a_checkpoint"], m
        assert m["kept"] == "keep me", m


def _next_calls_wait(root):
    model, opt = build(3)
    train(model, opt, 1)
    path = os.path.join(root, "ck")
    with HeldWrite() as held:
        zs.save_checkpoint(path, model, opt, extra={"step": 1}, background=True)
        assert held.started.wait(60)
        held.release(after=0.5)
        train(model, opt, 1, first_step=1)
        # the second save waits for the first (released by the timer), then runs; its
        # write is held too, until after the load below has started
        second = zs.save_checkpoint(path, model, opt, extra={"step": 2}, background=True)
        held.release(after=0.5)
        again, again_opt = build(3, seed=7)
        got = zs.load_checkpoint(path, again, again_opt)  # waits for the second; no result() called
    return second.done(), got, max_err(again.state_dict(), model.state_dict())


def test_the_next_save_and_a_load_wait_for_a_background_save(tmp_path):
    for done, got, err in launch("pool", 2).run(_next_calls_wait, str(tmp_path)):
        assert done and got == {"step": 2} and err == 0.0


def _hybrid_background(root, stage):
    model, opt = trained_hybrid(stage, steps=2)
    zs.save_checkpoint(os.path.join(root, "blocking"), model, opt, extra={"rank": dist.get_rank()})
    zs.save_checkpoint(
        os.path.join(root, "background"), model, opt, extra={"rank": dist.get_rank()}, background=True
    ).result(timeout=120)
    dist.barrier()
    return dir_bytes(os.path.join(root, "blocking")) == dir_bytes(os.path.join(root, "background"))


def test_a_hybrid_background_save_is_the_blocking_one(tmp_path):
    assert launch("pool", 4).run(_hybrid_background, str(tmp_path), 3) == [True] * 4


_SCRIPT = TINY_SCRIPT + (
    "opt.zero_grad(); model(x).pow(2).mean().backward(); opt.step()\n"
    "zs.save_checkpoint(sys.argv[1], model, opt, extra=dist.get_rank(), background=True)\n"
)


def _run_script(tmp_path, text):
    script = tmp_path / "train.py"
    script.write_text(text)
    out = launch(  # (ranks forked from a server that imported torch: they end as `python script` would)
        "forked",
        str(script),
        2,
        [str(tmp_path / "ck")],
        env={"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"},
        timeout=180,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return out


def test_a_script_that_exits_right_after_a_background_save_completes_it(tmp_path):
    """The process's exit waits for the write; nothing calls result()."""
    _run_script(tmp_path, _SCRIPT)
    model, opt = build("plain")
    assert sorted(os.listdir(tmp_path / "ck")) == [
        "extra0.pt",
        "extra1.pt",
        "manifest.json",
        "rank0.safetensors",
        "rank1.safetensors",
    ]
    with pytest.raises(zs.CheckpointError, match="another model"):  # complete: its manifest is read
        zs.load_checkpoint(str(tmp_path / "ck"), model, opt)
    assert torch.load(tmp_path / "ck" / "extra1.pt") == 1


def test_destroying_the_process_group_under_a_background_save_says_what_to_do(tmp_path):
    """No crash and no hang: the save fails, saying to call result() first, and leaves
    no checkpoint."""
    slow_write = (
        "import time; import zeroshard.checkpoint.files as files\n"  # the destroy comes mid-save
        "w = files.write_safetensors\n"
        "files.write_safetensors = lambda *a, **k: (time.sleep(1), w(*a, **k))[1]\n"
    )
    head, save = _SCRIPT.rsplit("zs.save_checkpoint", 1)
    out = _run_script(tmp_path, head + slow_write + "zs.save_checkpoint" + save + "dist.destroy_process_group()\n")
    assert (
        out.stderr.count("call result() on the Future save_checkpoint returned before destroy_process_group()") == 2
    ), out.stderr[-3000:]
    assert not os.path.exists(tmp_path / "ck")
