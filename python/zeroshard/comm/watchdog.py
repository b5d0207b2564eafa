"""When a collective hangs or fails: the watchdog's timeout, the diagnosis
every rank writes and reads through the store, and the debug mode's check.

[Note: watchdog] Every wait on a zeroshard collective is bounded by
``timeout()`` (``zeroshard.set_timeout``, else ``ZEROSHARD_TIMEOUT`` seconds,
else the default process group's own timeout). A rank whose wait runs out,
or whose collective fails in the transport (a peer died), or whose check-in
(see comm.check_in) runs out, opens an *incident*: it posts a report (why,
the collective it was in, its last flight records) under its rank in the
process group's store, which is not the wedged communicator, waits up to
``grace()`` for the other ranks' reports, and raises with a message built
from all of them: what each rank last started and completed, the first
collective where their records differ, and which ranks did not answer (dead,
or busy outside zeroshard). A rank whose wait ran out poisons its own side
of the gloo connections, so its peers' waits fail at once and they join the
incident instead of waiting out their own timeouts. The full reports go to a
file the message names. On CUDA a wait only orders streams (the host never
blocks in it), so a GPU-side hang is torch's NCCL watchdog's to report.

[Note: debug mode] With ``ZEROSHARD_DEBUG=1`` every collective first checks,
through the store, that every rank of its group issues the same (sequence,
kind, size, dtype); a mismatch raises ``CollectiveMismatch`` on every rank at
once, naming both sides, before any data moves. It costs a few store round
trips per collective (see docs/hangs.md, "When something hangs").
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
import time
from datetime import timedelta
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from . import flight
from ..native.ext import _C
from .flight import CollectiveError, Record

PREFIX = "zeroshard/incident/"
RECENT = 64  # flight records each rank posts in its report


class CollectiveTimeout(CollectiveError):
    """A zeroshard collective did not complete within the timeout; the message
    says what every rank was doing and where they diverged."""


class CollectiveMismatch(CollectiveError):
    """ZEROSHARD_DEBUG=1: the ranks of a group issued different collectives at
    one sequence number; the message names both sides."""


_raised: Optional[CollectiveError] = None  # the first hang or failure of a collective here


def raised() -> Optional[CollectiveError]:
    """The error this process raised for a collective that hung or failed, if any:
    its communicator is then broken, so later waits raise it again at once."""
    return _raised


def _broken(err: CollectiveError) -> CollectiveError:
    global _raised
    if _raised is None:
        _raised = err
        _C.abandon_unwaited()  # a dropped handle must not wait on a broken communicator
    return _raised


_override: Optional[float] = None
_group_default: Optional[float] = None


def set_timeout(seconds: Optional[float]) -> None:
    """Seconds any zeroshard collective may wait before every rank raises
    ``CollectiveTimeout``; ``None`` goes back to ``ZEROSHARD_TIMEOUT`` or, without
    it, the default process group's own timeout."""
    global _override
    if seconds is not None and not float(seconds) > 0:
        raise ValueError(
            f"zeroshard.set_timeout({seconds!r}): the timeout must be a positive number "
            "of seconds (or None for the default)"
        )
    _override = None if seconds is None else float(seconds)


def timeout() -> float:
    """The watchdog's timeout in seconds (see [Note: watchdog])."""
    global _group_default
    if _override is not None:
        return _override
    env = os.environ.get("ZEROSHARD_TIMEOUT")
    if env:
        try:
            value = float(env)
        except ValueError:
            value = -1.0
        if not value > 0:
            raise ValueError(
                f"ZEROSHARD_TIMEOUT={env!r} is not a positive number of seconds; unset it or set it to, e.g., 600"
            )
        return value
    if _group_default is None:
        try:
            _group_default = dist.group.WORLD._get_backend(torch.device("cpu")).options._timeout.total_seconds()
        except (RuntimeError, AttributeError):
            _group_default = 1800.0
    return _group_default


CHECK_IN_DEFAULT = 60.0  # seconds: see checkin_timeout


def checkin_timeout() -> float:
    """Seconds a check-in (comm.check_in) waits for the other ranks: the watchdog's
    timeout where the user set one (``set_timeout``, ``ZEROSHARD_TIMEOUT``), else 60 s,
    so that a call only some ranks enter (code under ``if rank == 0:``) fails within a
    minute rather than the process group's 30 ([Note: rank-0 code] in comm/collectives.py)."""
    if _override is not None or os.environ.get("ZEROSHARD_TIMEOUT"):
        return timeout()
    return min(CHECK_IN_DEFAULT, timeout())


def grace() -> float:
    """Seconds a rank that opened an incident waits for the others' reports."""
    return min(10.0, max(2.0, timeout() / 10))


def debug() -> bool:
    return os.environ.get("ZEROSHARD_DEBUG", "") not in ("", "0")


def describe(rec) -> str:
    """A record (a Record or its dict) in words."""
    if rec is None:
        return "none"
    if isinstance(rec, Record):
        rec = dataclasses.asdict(rec)
    return f"#{rec['seq']} {rec['kind']} of {rec['numel']} {rec['dtype']} ({rec['what'] or 'unlabelled'})"


def timed_out(rec: Record) -> CollectiveTimeout:
    """The error for a wait on ``rec`` that ran out; opens an incident."""
    head = (
        f"collective {describe(rec)} on process group '{rec.group}' did not complete "
        f"within {timeout():g} s (ZEROSHARD_TIMEOUT or zeroshard.set_timeout())."
    )
    text, _ = incident(f"timed out in {describe(rec)}", rec.group, rec)
    return _broken(CollectiveTimeout(_on_rank(head) + "\n" + text))


def transport_failed(rec: Record, err: BaseException) -> CollectiveError:
    """The error for ``rec`` failing in gloo/NCCL (a peer died); opens an incident."""
    head = (
        f"collective #{rec.seq} on process group '{rec.group}' ({rec.kind} of {rec.numel} {rec.dtype}: "
        f"{rec.what or 'unlabelled'}) failed in the transport: {err}\nAnother rank of the group stopped "
        "answering (it crashed, was killed, ran out of memory, timed out, or took another branch and "
        "waits elsewhere). zeroshard.flight_record() lists this rank's collectives up to this one."
    )
    text, peer_timed_out = incident(
        f"failed in {describe(rec)}: {(str(err).splitlines() or [''])[0][:200]}", rec.group, rec
    )
    # a peer whose wait ran out closed its connections: the root cause is the hang
    return _broken((CollectiveTimeout if peer_timed_out else CollectiveError)(_on_rank(head) + "\n" + text))


def check_in_timed_out(head: str, group: str, rec: Record) -> CollectiveTimeout:
    """The error for a check-in (comm.check_in) that ran out; opens an incident."""
    return CollectiveTimeout(head + "\n" + incident(f"timed out in check-in {rec.what!r}", group, rec)[0])


def _on_rank(msg: str) -> str:
    return f"[rank {dist.get_rank()}/{dist.get_world_size()}] {msg}"


def incident(cause: str, group: str, rec: Optional[Record]) -> Tuple[str, bool]:
    """Post this rank's report, read the others', write them all to a file;
    returns the diagnosis and whether another rank timed out (see [Note: watchdog])."""
    rank = dist.get_rank()
    mine = {
        "rank": rank,
        "cause": cause,
        "time": time.time(),
        "stuck": dataclasses.asdict(rec) if rec is not None else None,
        "records": flight.recent(RECENT),
    }
    reports, store_error = _exchange(mine)
    lines = [diagnose(reports, group, dist.get_world_size(), time.time())]
    if store_error:
        lines.append(
            f"The store is unreachable ({store_error}): its host (rank 0's process, or torchrun's "
            "agent) has exited, so the other ranks' reports cannot be read."
        )
    path = _write(reports, "\n".join(lines))
    lines.append(
        f"Every answering rank's last {RECENT} collectives: {path} (this rank's whole flight "
        "record included); see docs/hangs.md ('When something hangs')."
    )
    others_timed_out = any(v["cause"].startswith("timed out") for r, v in reports.items() if r != rank)
    return "\n".join(lines), others_timed_out


def meet(prefix: str, ranks: List[int], value: str, seconds: float) -> List[int]:
    """Post ``value`` under ``prefix`` + this rank in the default store and wait up
    to ``seconds`` for every rank of ``ranks`` to post; returns those that did not."""
    store = dist.distributed_c10d._get_default_store()
    store.set(f"{prefix}{dist.get_rank()}", value)
    try:
        store.wait([f"{prefix}{r}" for r in ranks], timedelta(seconds=seconds))
        return []
    except RuntimeError:
        return [r for r in ranks if not store.check([f"{prefix}{r}"])]


def _exchange(mine: dict) -> Tuple[Dict[int, dict], Optional[str]]:
    world = dist.get_world_size()
    try:
        silent = set(meet(PREFIX, list(range(world)), json.dumps(mine), grace()))  # named in the diagnosis
        store = dist.distributed_c10d._get_default_store()
        answered = [r for r in range(world) if r not in silent]  # (one round trip to the store)
        got = dict(zip(answered, map(json.loads, store.multi_get([f"{PREFIX}{r}" for r in answered]))))
        # a report older than this rank's last completed collective is an earlier
        # incident's, which the ranks got past (a caught check-in timeout, say)
        # (approximate across hosts: it compares wall clocks)
        since = flight.last_completed()
        return {r: v for r, v in got.items() if r == mine["rank"] or v["time"] >= since}, None
    except RuntimeError as e:
        return {mine["rank"]: mine}, f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"


GROUPS = 8  # the most rank groups a diagnosis lists (the file has every rank's report)


def ranks_text(ranks) -> str:
    """Ranks in words, runs of consecutive ranks as ranges: "rank 3", "ranks 0-511, 513-1023"."""
    ranks = sorted(ranks)
    runs, lo = [], None
    for i, r in enumerate(ranks):
        lo = r if lo is None else lo
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            runs.append(str(r) if lo == r else f"{lo}-{r}")
            lo = None
    if len(runs) > GROUPS:
        runs = runs[: GROUPS - 1] + [f"... ({len(ranks)} in all)"]
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(runs)


def _grouped(by_rank: Dict[int, str]) -> List[str]:
    """ "<ranks>: <text>" for each distinct text, most ranks first, at most GROUPS of them."""
    groups: Dict[str, List[int]] = {}
    for r, text in sorted(by_rank.items()):
        groups.setdefault(text, []).append(r)
    order = sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[1][0]))
    lines = [f"{ranks_text(rs)}{text}" for text, rs in order[:GROUPS]]
    rest = order[GROUPS:]
    if rest:
        lines.append(f"{sum(len(rs) for _, rs in rest)} more rank(s) in {len(rest)} other state(s): see the file below")
    return lines


def diagnose(reports: Dict[int, dict], group: str, world: int, now: float) -> str:
    """The part of the message built from every answering rank's report (pure): ranks in
    the same state share a line, so its length is bounded whatever the world size."""
    lines = []
    first = first_difference(reports, group)
    if first:
        lines.append(first)
    lines.append(f"What each rank last did on process group '{group}':")
    others = [r for r in sorted(reports) if not any(x["group"] == group for x in reports[r]["records"])]
    states = {}
    for r in sorted(set(reports) - set(others)):
        recs = [x for x in reports[r]["records"] if x["group"] == group]
        started = recs[-1] if recs else None
        done = next((x for x in reversed(recs) if x["end"] is not None), None)
        # (the wait, in whole seconds, so ranks stuck in one collective share a line)
        state = (
            ""
            if started is None or started["end"] is not None
            else f", not completed after {int(now - started['start']):d} s"
        )
        states[r] = (
            f": last started {describe(started)}{state}; last completed {describe(done)}; cause: {reports[r]['cause']}"
        )
    states.update({r: f" (no recent collective on this group): cause: {reports[r]['cause']}" for r in others})
    lines += ["  " + line for line in _grouped(states)]
    silent = [r for r in range(world) if r not in reports]
    if silent:
        lines.append(
            f"{ranks_text(silent).capitalize()} did not answer within {grace():g} s: dead, or busy "
            "outside zeroshard (a long computation, a torch collective, a sleep, a wait on a different "
            "group)."
        )
    return "\n".join(lines)


def first_difference(reports: Dict[int, dict], group: str) -> Optional[str]:
    """The first collective of ``group`` that the reports disagree on, in words (pure)."""
    seqs = {r: {x["seq"]: x for x in rep["records"] if x["group"] == group} for r, rep in reports.items()}
    seqs = {r: s for r, s in seqs.items() if s}
    if len(seqs) < 2:
        return None
    lo, hi = max(min(s) for s in seqs.values()), max(max(s) for s in seqs.values())
    for n in range(lo, hi + 1):
        sides = {r: s.get(n) for r, s in seqs.items()}
        sigs = {None if x is None else (x["kind"], x["numel"], x["dtype"], x["what"]) for x in sides.values()}
        if len(sigs) > 1:
            said = _grouped(
                {
                    r: (
                        f" issued {describe(x)}"
                        if x is not None
                        else f" never issued it (its last: {describe(seqs[r][max(seqs[r])])})"
                    )
                    for r, x in sides.items()
                }
            )
            return f"The ranks first differ at collective #{n} on process group '{group}': " + "; ".join(said) + "."
    return None


def _write(reports: Dict[int, dict], message: str) -> str:
    folder = os.environ.get("ZEROSHARD_RECORD_DIR") or tempfile.gettempdir()
    path = os.path.join(folder, f"zeroshard-flight-rank{dist.get_rank()}-pid{os.getpid()}.json")
    body = {
        "message": message,
        "reports": {str(r): v for r, v in reports.items()},
        "flight_record": flight.flight_record(),
    }
    try:
        with open(path, "w") as f:
            json.dump(body, f, indent=1)
    except OSError as e:
        return f"(not written: {e})"
    return path


def agree(rec: Record, group: Optional[dist.ProcessGroup]) -> None:
    """ZEROSHARD_DEBUG: raise on every rank unless every rank of ``group`` issues
    ``rec``'s (sequence, kind, size, dtype) (see [Note: debug mode])."""
    ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    key = f"zeroshard/debug/{rec.group}/"
    missing = meet(f"{key}{rec.seq}/", ranks, json.dumps([rec.kind, rec.numel, rec.dtype, rec.what]), timeout())
    if missing:
        raise CollectiveTimeout(
            _on_rank(
                f"ZEROSHARD_DEBUG: {ranks_text(missing)} did not issue collective #{rec.seq} on process group "
                f"'{rec.group}' within {timeout():g} s; this rank issued {describe(rec)}.\n"
            )
            + incident(f"timed out in the debug check of {describe(rec)}", rec.group, rec)[0]
        )
    store = dist.distributed_c10d._get_default_store()
    sides = dict(zip(ranks, (json.loads(v) for v in store.multi_get([f"{key}{rec.seq}/{r}" for r in ranks]))))
    if rec.seq > 1:  # every rank has read seq-1's keys before posting seq's
        store.delete_key(f"{key}{rec.seq - 1}/{dist.get_rank()}")
    if any(s[:3] != sides[ranks[0]][:3] for s in sides.values()):
        said = "; ".join(_grouped({r: f": {s[0]} of {s[1]} {s[2]} ({s[3] or 'unlabelled'})" for r, s in sides.items()}))
        raise CollectiveMismatch(
            _on_rank(
                f"ZEROSHARD_DEBUG: the ranks issue different collectives as #{rec.seq} on process group "
                f"'{rec.group}': {said}. They took different branches before this point (a rank-dependent "
                "condition around a backward, step, state_dict or checkpoint call); nothing was exchanged."
            )
        )
