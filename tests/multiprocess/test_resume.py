"""zeroshard.resume: the newest complete checkpoint under a path, loaded at any
world size and stage; torn ones skipped with a warning naming them; None to
start fresh (see [Note: resume] in checkpoint/resume.py)."""

import os
import warnings

import pytest
import torch

import zeroshard as zs
from support.checks import max_err
from support.gpt import build, reference, train
from support.launch import launch


def _resume(path, kind=3, steps=0):
    """resume() into a fresh model; (extra, warnings, error against the uninterrupted run after ``steps`` more)."""
    model, opt = build(kind, seed=7)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        extra = zs.resume(path, model, opt)
    err = None
    if extra is not None and steps:
        train(model, opt, steps, first_step=extra["step"])
        err = max_err(model.state_dict(), reference(extra["step"] + steps)[0].state_dict())
    return extra, [str(w.message) for w in caught if "zeroshard.resume" in str(w.message)], err


def _save_steps(root, kind, at):
    """Train, saving ``root/step_{k}`` after each k in ``at`` (and ``root/last``, replaced each time)."""
    model, opt = build(kind)
    done = 0
    for k in at:
        train(model, opt, k - done, first_step=done)
        done = k
        zs.save_checkpoint(os.path.join(root, f"step_{k:06d}"), model, opt, extra={"step": k})
        zs.save_checkpoint(os.path.join(root, "last"), model, opt, extra={"step": k})


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Checkpoints after 2 and 4 steps of ZeRO-3 at world size 2: ``dirs/step_*`` and ``one/last``."""
    root = tmp_path_factory.mktemp("resume")
    launch("pool", 2).run(_save_steps, str(root / "dirs"), 3, [2, 4])
    os.makedirs(root / "one")
    os.rename(root / "dirs" / "last", root / "one" / "last")
    return root


def test_fresh_start_returns_none(tmp_path):
    os.makedirs(tmp_path / "empty")
    for path in (tmp_path / "missing", tmp_path / "empty"):
        for extra, warned, _ in launch("pool", 2).run(_resume, str(path)):
            assert extra is None and warned == []


@pytest.mark.parametrize("where", ["dirs", "one/last"])
def test_resumes_the_newest(saved, where):
    for extra, warned, err in launch("pool", 2).run(_resume, str(saved / where), 3, 2):
        assert extra == {"step": 4} and warned == [] and err <= 1e-5


@pytest.mark.parametrize("kind", [2, 3])
def test_resumes_at_another_world_size_and_stage(saved, kind):
    for extra, _, err in launch("pool", 3).run(_resume, str(saved / "dirs"), kind, 2):
        assert extra == {"step": 4} and err <= 1e-5


def _truncate(ckpt):
    f = os.path.join(ckpt, "rank1.safetensors")
    os.truncate(f, os.path.getsize(f) // 2)


def _no_manifest(ckpt):
    os.remove(os.path.join(ckpt, "manifest.json"))


def _corrupt_byte(ckpt):
    f = os.path.join(ckpt, "rank0.safetensors")
    with open(f, "r+b") as fh:
        fh.seek(os.path.getsize(f) - 10)
        b = fh.read(1)
        fh.seek(-1, 1)
        fh.write(bytes([b[0] ^ 0xFF]))


@pytest.mark.parametrize("tear", [_truncate, _no_manifest, _corrupt_byte])
def test_a_torn_newest_is_skipped_with_a_warning_naming_it(saved, tmp_path, tear):
    import shutil

    root = tmp_path / "dirs"
    shutil.copytree(saved / "dirs", root)
    newest = str(root / "step_000004")
    tear(newest)
    os.utime(
        os.path.join(newest, "manifest.json") if os.path.exists(os.path.join(newest, "manifest.json")) else newest
    )  # still the newest
    got = launch("pool", 2).run(_resume, str(root), 3, 2)
    for extra, _, err in got:
        assert extra == {"step": 2} and err <= 1e-5  # the one before it, loaded
    warned = got[0][1]
    assert len(warned) == 1 and newest in warned[0] and "skipping" in warned[0], warned


def test_a_half_written_save_is_skipped(saved, tmp_path):
    """An interrupted save's partial directory, and a directory of files with no manifest."""
    import shutil

    root = tmp_path / "dirs"
    shutil.copytree(saved / "dirs", root)
    shutil.copytree(saved / "dirs" / "step_000004", root / ".step_000006.partial-0123456789ab")
    os.remove(root / ".step_000006.partial-0123456789ab" / "manifest.json")
    os.makedirs(root / "step_000008")
    open(root / "step_000008" / "rank0.safetensors", "wb").close()
    got = launch("pool", 2).run(_resume, str(root))
    assert all(extra == {"step": 4} for extra, _, _ in got)
    warned = got[0][1]
    assert len(warned) == 2 and any(".step_000006.partial-" in w for w in warned), warned
    assert any(str(root / "step_000008") in w for w in warned), warned


def _into_another_model(path):
    try:
        zs.resume(path, torch.nn.Linear(3, 3))
    except zs.CheckpointError as e:
        return str(e)


def test_checkpoints_of_another_model_raise(saved):
    """Never a fresh start over checkpoints that exist but do not load."""
    for msg in launch("pool", 2).run(_into_another_model, str(saved / "one" / "last")):
        assert msg and "another model" in msg, msg
