"""overlap_param_gather=True (stages 1 and 2): step() returns with the parameter
all-gathers in flight and each module's forward waits for its own buckets only.
Against single-process torch AdamW on gloo at world sizes 2 and 3."""

import time

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import zeroshard as zs
from support.checks import rel_err
from support.flat_net import batches, local, make_model, param_groups, reference, train_ours
from support.launch import launch

STEPS = 4


def _parity(stage, clip, micro):
    model, opt, norms = train_ours(STEPS, stage, clip=clip, micro=micro, no_sync=micro > 1, overlap_param_gather=True)
    ref, ref_norms = reference(STEPS, clip=clip, micro=micro)
    opt.wait_params()
    err = max(rel_err(p, q) for p, q in zip(model.parameters(), ref.parameters()))
    return err, [abs(a - b) / b for a, b in zip(norms, ref_norms)]


@pytest.mark.parametrize("stage,clip,micro", [(1, None, 1), (2, None, 1), (2, 0.5, 2), (1, 0.5, 2)])
def test_overlapped_gather_equals_single_process_adamw(dist_pool, stage, clip, micro):
    for err, norm_errs in dist_pool.run(_parity, stage, clip, micro):
        assert err < 1e-5, err
        assert all(e < 1e-5 for e in norm_errs), norm_errs


def _in_flight(stage):
    """After step(): which of its all-gathers no wait has seen done yet; after the next
    forward: how many still are; and the model's parameters after wait_params()."""
    model = make_model()
    opt = zs.ShardedOptimizer(param_groups(model), stage=stage, bucket_mb=1000 / 2**20, overlap_param_gather=True)
    rank, world = dist.get_rank(), dist.get_world_size()
    ((x, y),) = batches(1)[0]
    F.cross_entropy(model(local(x, rank, world)), local(y, rank, world)).backward()
    t0 = time.time()  # (the flight record also holds earlier tests' collectives)

    def this_step():
        return [r for r in zs.flight_record() if r["kind"] == "all_gather" and r["start"] >= t0]

    opt.step()
    gathers = this_step()
    open_after_step = sum(r["end"] is None for r in gathers)
    opt.zero_grad()
    with torch.no_grad():
        model(local(x, rank, world))
    done = {r["what"]: r["end"] is not None for r in this_step()}
    opt.wait_params()
    ref = reference(1)[0]
    return len(gathers), open_after_step, done, max(rel_err(p, q) for p, q in zip(model.parameters(), ref.parameters()))


@pytest.mark.parametrize("stage", [1, 2])
def test_step_returns_with_the_gathers_in_flight_and_forward_waits_for_its_buckets(dist_pool, stage):
    for n, open_after_step, done, err in dist_pool.run(_in_flight, stage):
        assert n > 3  # tiny buckets: many all-gathers
        assert open_after_step == n  # none was waited for inside step()
        # the forward waited for the buckets of the modules it ran (a bucket holding only the
        # unused layer's parameters would still be open)
        assert sum(done.values()) >= n - 1, done
        assert err < 1e-5, err  # after wait_params() every parameter is the stepped one


def _fully_shard_refuses():
    model = zs.FullyShard(make_model(), wrap={nn.Linear})
    zs.ShardedOptimizer(model.parameters(), overlap_param_gather=True)


def test_overlap_with_fully_shard_parameters_is_a_clear_error():
    with pytest.raises(Exception, match="overlap_param_gather is for ZeRO-1/2; FullyShard gathers each unit"):
        launch("pool", 2).run(_fully_shard_refuses)
