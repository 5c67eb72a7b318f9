"""Job-wide pause and resume: every rank or none, over ``torch.distributed``.

Each rank calls the same function with the same arguments, as with any collective::

    import torch_memory_saver.distributed as tms_dist

    out = tms_dist.pause("kv_cache")            # every rank of the default group
    print(out)                                  # one line: bytes per rank and in all, slowest rank
    tms_dist.resume("kv_cache", group=tp_group)

Only the ranks of the group call it: a process outside the group is refused
(:class:`InvalidArgumentError`, nothing done), as it has no rank to agree with.

Every rank acts on its own process, then the outcome is agreed over the group (one
``all_gather_object`` on the group's backend, gloo or nccl). If every rank succeeded, each gets
the same :class:`Outcome`. If any rank failed, every rank undoes what the call changed on it (a
pause is undone by resuming what it paused, the failed rank's partial pause included; a resume by
pausing what it resumed), the ranks agree once more on how the undo went, and every rank raises
the same :class:`DistributedError` naming the failed ranks and their messages. So the job is never
left half paused: every rank ends where it started, or the error says which rank could not undo
and why. A Ctrl-C (``KeyboardInterrupt``) or ``SystemExit`` during the call fails its rank like
any failure: the ranks still agree and undo (one that lands in the agreement itself is undone
by its rank as when the group fails), then that rank raises it, with that
:class:`DistributedError` as its ``__cause__`` (an undo it interrupted says ``"failed: ..."``).

- Whether the failed rank's own call changed anything, and so needs undoing there, is what the
  library says that call changed all the same (``tms_last_changed``), not the tag's state, which
  the program's other threads may change meanwhile (allocating, freeing, pausing or resuming in
  it): a call that failed having changed nothing is left alone, one that changed something is
  undone. Only where the library does not say (the call failed before reaching it) is a pause
  judged from the tag's active bytes before and after, and a resume or chunk call undone as
  below.
- Backups are never lost by the undo: undoing a pause resumes from the backups the pause just
  wrote; undoing a resume pauses again, writing backups where the region keeps them.
- A pause records which allocations and chunks were active (as ``pause(tag,
  save_chunk_state=True)`` does) and its undo brings back only those, so an allocation that was
  paused before the call stays paused. The record is the job's own: one the program made with
  ``pause(save_chunk_state=True)`` is left as it was.
- A resume is undone tag by tag: a tag wholly paused before is paused again, a wholly active one
  was not changed. A tag that was partly active before the call cannot be undone exactly
  (pausing it would also pause what was active before), nor one whose memory a non-blocking
  resume of the rank's own was restoring, nor one the program's other threads allocated or
  freed memory in during the call (a pause would take what they allocated): such a rank skips
  their undo and the error says so (``undo`` of that rank is ``"skipped: ..."``); they stay
  resumed, nothing lost. A chunk call waits first for such a restore to end.
- A chunk call (``pause_chunks``, ``pause_range`` and their resumes) is undone on the chunks it
  was asked for (for a range, those the library said it was to act on) that went its way: a
  chunk another thread of the program paused or resumed meanwhile is left as the program made
  it. A range call of an implementation whose error does not say is not guessed at: the rank
  skips its undo, naming the chunks it leaves.
- Memory a failed non-blocking resume left unrestored (``bytes_unrestored``) is given back by a
  pause (the call's, or a resume's undo), which settles that failure: no undo brings it back, so
  that rank's ``undo`` says ``"done, but not as before for ..."`` and the error does not claim
  every rank is as before.
- Timeouts are the group's (``init_process_group(timeout=...)``). If the collective itself fails
  (a rank died, a timeout), no rank can know the others' outcomes: each surviving rank undoes its
  own action and raises :class:`DistributedError` with the group's error as ``__cause__``, saying
  it has not seen the others. A success is confirmed by one more collective before any rank
  returns it, so a rank that was late (the others gave up on it and undid theirs) fails that
  confirmation and undoes its own too, instead of returning success in a half-paused job. What
  happens to a rank that dies mid-operation is the operating system's: its device memory goes
  back to the driver, its disk backup files are left for ``tmsctl clean``.

Everything here needs ``torch.distributed`` only for the collective, and numpy, which
``all_gather_object`` reads the gathered bytes with (torch itself does not install it; without
it every call raises :class:`UnsupportedError` before acting); the rest is the package's own API
on each rank.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, NoReturn, Optional

from .arguments import JOB_RECORD, RANGE_ASKED, _check_indices, chunk_arguments
from .errors import CHANGED, InvalidArgumentError, InvalidStateError, TorchMemorySaverError, UnsupportedError

__all__ = [
    "pause",
    "resume",
    "pause_chunks",
    "resume_chunks",
    "pause_range",
    "resume_range",
    "Outcome",
    "RankOutcome",
    "DistributedError",
]

# One rank's outcome in, every rank's outcomes (in group rank order) out.
Gather = Callable[[dict], List[dict]]


@dataclass
class RankOutcome:
    """What one rank did. ``bytes`` is device memory released (pause) or taken back (resume);
    ``undo`` is None where no undo was needed, else ``"done"``, ``"skipped: why"``,
    ``"failed: message"`` or ``"done, but not as before for ..."`` (after a ``"skipped: why; "``
    where part of it was skipped)."""

    rank: int
    host: str
    pid: int
    ok: bool
    bytes: int
    seconds: float
    error: Optional[str] = None
    message: Optional[str] = None
    undo: Optional[str] = None


@dataclass
class Outcome:
    """Every rank's outcome of one job-wide operation, the same on every rank. ``result`` is
    this rank's own return value where the operation has one (the chunk ``range`` of
    ``pause_range``/``resume_range``)."""

    op: str
    what: str
    ranks: List[RankOutcome]
    result: Any = field(default=None, compare=False)

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.ranks)

    @property
    def failed(self) -> List[RankOutcome]:
        return [r for r in self.ranks if not r.ok]

    @property
    def total_bytes(self) -> int:
        return sum(r.bytes for r in self.ranks)

    @property
    def slowest(self) -> RankOutcome:
        return max(self.ranks, key=lambda r: r.seconds)

    def __str__(self) -> str:
        verb = "released" if self.op.startswith("pause") else "taken back"
        n = len(self.ranks)
        s = self.slowest
        return (
            f"{self.op} of {self.what} on {n} rank{'s' if n != 1 else ''}: {_gib(self.total_bytes)} {verb} "
            f"in all ({_gib(self.total_bytes // max(n, 1))} per rank on average), slowest rank {s.rank} "
            f"in {s.seconds:.3f} s"
        )


class DistributedError(TorchMemorySaverError):
    """A job-wide operation failed on some rank (or the group itself failed). Raised on every
    rank with the same message. ``outcome`` holds every rank's :class:`RankOutcome`, the undo's
    included (None when the group failed before the ranks could agree); ``failed`` maps each
    failed rank to its message."""

    def __init__(self, message: str, outcome: Optional[Outcome]) -> None:
        super().__init__(message)
        self.outcome = outcome

    @property
    def failed(self) -> dict:
        if self.outcome is None:
            return {}
        return {r.rank: f"{r.error}: {r.message}" for r in self.outcome.failed}


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB"


def _saver() -> Any:
    """The process-wide instance, as the package holds it at each call. The package's __init__
    puts its lookup here: it imports this module, so this module cannot import it."""
    raise RuntimeError("torch_memory_saver.distributed is used through the package, which was not set up")


def _torch_group(group: Any) -> "tuple[Gather, int]":
    """The gather over ``group`` (the default group if None) and this process's global rank."""
    try:
        import torch.distributed as dist
    except ImportError as e:
        raise UnsupportedError(
            f"torch_memory_saver.distributed needs PyTorch (torch.distributed), which cannot be imported: {e}"
        ) from None

    if not dist.is_available() or not dist.is_initialized():
        raise InvalidStateError(
            "torch_memory_saver.distributed needs torch.distributed initialised "
            "(torch.distributed.init_process_group) in every rank"
        )
    try:
        import numpy  # noqa: F401
    except ImportError as e:
        # Found out here, before acting: all_gather_object would fail only after every rank
        # had acted, and each would then undo.
        raise UnsupportedError(
            "torch_memory_saver.distributed needs numpy: torch.distributed.all_gather_object, which the "
            "ranks agree through, reads the gathered bytes with it (pip install numpy)"
        ) from e

    # A rank outside the group gets -1: its collectives over it do nothing, so it would act
    # with no rank to agree with. Refused alone, before acting: no rank of the group waits for it.
    size = dist.get_world_size(group)
    if size < 1:
        raise InvalidArgumentError(
            f"this process (global rank {dist.get_rank()}) is not a member of the group it was given: a job-wide "
            "call is made by the ranks of its group only (torch.distributed's collectives do nothing on another "
            "rank, so this one would act with no rank to agree with)"
        )

    def gather(mine: dict) -> List[dict]:
        out: List[Any] = [None] * size
        dist.all_gather_object(out, mine, group=group)
        return out

    return gather, dist.get_rank()


def _tag_stats(tag: Optional[str]) -> Dict[str, dict]:
    """Each tag's numbers (``tag``'s, or every tag's if None), by name."""
    return {t["tag"]: t for t in _saver().stats()["tags"] if tag is None or t["tag"] == tag}


def _active_of(tags: Dict[str, dict]) -> int:
    """Device bytes mapped for the tags of ``tags`` (from :func:`_tag_stats`)."""
    return sum(t["bytes_active"] for t in tags.values())


def _active_bytes(tag: Optional[str]) -> int:
    """Device bytes mapped for ``tag`` (every tag if None)."""
    return _active_of(_tag_stats(tag))


def _describe_undo(undo: Callable[[], Optional[str]], stop: List[BaseException]) -> str:
    try:
        return undo() or "done"
    except Exception as e:  # an undo that fails is reported, never raised over the agreement
        return f"failed: {type(e).__name__}: {e}"
    except BaseException as e:  # a Ctrl-C too: reported, then raised by _agree once the ranks agreed
        stop.append(e)
        return f"failed: {type(e).__name__}: interrupted, perhaps part done"


def _said(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


def _stopped(stop: List[BaseException], e: BaseException) -> None:
    """Keep ``e`` in ``stop`` where it is no Exception: a Ctrl-C (KeyboardInterrupt), a
    SystemExit. The first such is raised once the ranks have agreed and undone."""
    if not isinstance(e, Exception):
        stop.append(e)


def _raise(error: DistributedError, cause: Optional[BaseException], stop: List[BaseException]) -> NoReturn:
    """Raise ``error`` (from ``cause``), or, where a Ctrl-C (or SystemExit) came during the call,
    that interrupt, with ``error`` as its cause: the program is interrupted and told what is left."""
    if not stop:
        raise error from cause
    if cause is not None and cause is not stop[0]:
        error.__cause__ = cause
    raise stop[0] from error


def _gather_step(gather: Gather, mine: dict, step: List[str]) -> List[dict]:
    """``gather(mine)``, checked to come from every rank at the same ``step`` (op, what, which
    collective of the call): a rank late by a step pairs its collective with the others' next
    one, whose data is of another step. Raised as the group's failure where it is not."""
    everyone = gather({**mine, "step": step})
    if not isinstance(everyone, list) or not all(isinstance(d, dict) and d.get("step") == step for d in everyone):
        raise InvalidStateError(
            f"the ranks were not at the same step ({step[2]} of {step[0]} of {step[1]}): a rank is late, or the "
            "ranks called different operations"
        )
    return [{k: v for k, v in d.items() if k != "step"} for d in everyone]


def _agree(
    op: str,
    what: str,
    act: Callable[[], Any],
    undo: Callable[[], Optional[str]],
    measure: Callable[[], int],
    gather: Gather,
    rank: int,
) -> Outcome:
    """Act here, agree over the group, undo everywhere if any rank failed. ``undo`` returns None
    (or a ``"skipped: why"`` note) or raises. A Ctrl-C (KeyboardInterrupt) or SystemExit on
    the way fails this rank like any failure: the ranks still agree and undo (or, where the
    group fails, this rank undoes its own), then it is raised, the :class:`DistributedError`
    the others raise as its cause."""
    stop: List[BaseException] = []
    try:
        before = measure()
    except BaseException as e:  # the action below fails too, and says why through the agreement
        _stopped(stop, e)
        before = 0
    t0 = time.perf_counter()
    err: Optional[BaseException] = stop[0] if stop else None
    result = None
    if err is None:
        try:
            result = act()
        except BaseException as e:  # reported to every rank; raised below as DistributedError
            _stopped(stop, e)
            err = e
    seconds = time.perf_counter() - t0
    try:
        after = measure()
    except BaseException as e:  # a failed stats read must not take the agreement down
        _stopped(stop, e)
        after = before
    if err is None and stop:
        err = stop[0]  # interrupted once it had acted: this rank failed, and undoes it
    changed = before - after if op.startswith("pause") else after - before
    mine = {
        "rank": rank,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "ok": err is None,
        "bytes": max(changed, 0),
        "seconds": seconds,
        "error": None if err is None else type(err).__name__,
        "message": None if err is None else str(err) or ("" if isinstance(err, Exception) else "interrupted"),
    }
    try:
        everyone = _gather_step(gather, mine, [op, what, "outcome"])
    except BaseException as e:
        _stopped(stop, e)
        note = _describe_undo(undo, stop)
        _raise(
            DistributedError(
                f"{op} of {what}: the group failed before the ranks could agree ({_said(e)}); "
                f"rank {rank} {'failed itself (' + mine['error'] + ': ' + str(mine['message']) + '), ' if err else ''}"
                f"undid its own {op} ({note}). It has not seen the other ranks: each undoes its own when its "
                "agreement fails (a late rank once it gets there; a rank that died gave its memory back), so "
                "the job may be partly changed until they have: check every rank",
                None,
            ),
            e,
            stop,
        )
    outcome = Outcome(op, what, [RankOutcome(**d) for d in everyone], result)
    if outcome.ok:
        # Once more, so that no rank returns success while another, which gave up waiting
        # for a late one, undid its own: a rank returns only having seen every rank agree.
        try:
            _gather_step(gather, {"rank": rank, "confirmed": True}, [op, what, "confirmation"])
        except BaseException as e:
            _stopped(stop, e)
            note = _describe_undo(undo, stop)
            _raise(
                DistributedError(
                    f"{op} of {what} succeeded on every rank, but the group failed before every rank "
                    f"confirmed it ({_said(e)}); rank {rank} undid its own {op} ({note}). It has "
                    "not seen the other ranks: each undoes its own when its agreement fails, so the job may "
                    "be partly changed until they have: check every rank",
                    outcome,
                ),
                e,
                stop,
            )
        return outcome
    mine["undo"] = _describe_undo(undo, stop)
    try:
        everyone = _gather_step(gather, mine, [op, what, "undo"])
    except BaseException as e:
        _stopped(stop, e)
        _raise(
            DistributedError(
                f"{op} of {what} failed on rank(s) {', '.join(str(r.rank) for r in outcome.failed)}, and the "
                f"group failed while the ranks undid it ({_said(e)}); rank {rank}'s undo: {mine['undo']}",
                outcome,
            ),
            e,
            stop,
        )
    outcome = Outcome(op, what, [RankOutcome(**d) for d in everyone], result)
    failed = "; ".join(f"rank {r.rank} ({r.host}, pid {r.pid}): {r.error}: {r.message}" for r in outcome.failed)
    undone = [r for r in outcome.ranks if r.undo == "done"]
    not_undone = [r for r in outcome.ranks if r.undo != "done"]
    tail = (
        f"every rank undid it ({len(undone)} of {len(outcome.ranks)}), so every rank is as before the call"
        if not not_undone
        else "not every rank could undo it: "
        + "; ".join(f"rank {r.rank}: {r.undo}" for r in not_undone)
        + f"; the other {len(undone)} rank(s) are as before the call"
    )
    _raise(
        DistributedError(f"{op} of {what} failed on {len(outcome.failed)} rank(s): {failed}. {tail}", outcome), err, stop
    )


def _what_tag(tag: Optional[str]) -> str:
    return "every tag" if tag is None else f"tag {tag!r}"


def _norm_tag(tag: Optional[str]) -> Optional[str]:
    # "" means every tag, as in pause("") and resume("").
    return None if tag == "" else tag


def _no_check() -> None:
    pass


def _restoring(t: dict) -> bool:
    """Memory of the tag that a non-blocking resume of the rank's own is restoring: the program
    waits for it, and a pause would take it from under it."""
    return bool(t.get("restoring_allocations", 0))


def _unrestored(t: dict) -> bool:
    """Memory of the tag that a failed non-blocking resume left unrestored (held, neither active
    nor paused): a pause gives it back and settles that failure, which no undo brings back."""
    return bool(t.get("bytes_unrestored", 0) or t.get("failed_restore"))


def _allocations_of(t: dict) -> tuple:
    """What tells that allocations of the tag were made or freed between two reads of its
    numbers: their count, and the serial of the newest (one made in place of a freed one, of
    its size and at its address, has a new serial)."""
    return t["allocations"], t["newest_allocation"]


def _not_undone(what: List[str]) -> Optional[str]:
    if not what:
        return None
    return (
        f"done, but not as before for {', '.join(what)}: a failed non-blocking resume had left its memory "
        "unrestored before the call; it is paused now (that memory given back, that failure settled)"
    )


def _said_changed(error: Optional[BaseException]) -> Optional[bool]:
    """Whether this rank's own call, which failed raising ``error``, changed anything, as the
    library said (``errors.CHANGED``); None where it did not say (it was not the library's
    failure, or an implementation that does not tell). The tag's state cannot tell: the
    program's other threads may allocate, free, pause or resume in it meanwhile."""
    said = getattr(error, CHANGED, None)
    return None if said is None else any(said.values())


class _OwnCall:
    """This rank's own call inside an agreement, run once through it: what it returned or
    raised, for the undo (which asks whether a failed call changed anything)."""

    def __init__(self) -> None:
        self.started = False
        self.finished = False
        self.result: Any = None
        self.error: Optional[BaseException] = None

    def __call__(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        self.started = True
        try:
            self.result = fn(*args, **kwargs)
        except BaseException as e:
            self.error = e
            raise
        self.finished = True
        return self.result

    @property
    def failed(self) -> bool:
        """Started, and did not return (it raised, or was interrupted)."""
        return self.started and not self.finished


def _pause_tag(tag: Optional[str], gather: Gather, rank: int, check: Callable[[], None] = _no_check) -> Outcome:
    """Pause ``tag`` on every rank, or none; ``check`` runs first, and where it raises, this
    rank fails having changed nothing."""
    tms = _saver()
    tag = _norm_tag(tag)
    here: dict = {}
    own = _OwnCall()

    def act() -> None:
        check()
        here["tags"] = _tag_stats(tag)
        here["before"] = _active_of(here["tags"])
        own(tms.pause, tag, save_chunk_state=JOB_RECORD)

    def undo() -> Optional[str]:
        if "before" not in here:
            return None
        if own.failed:
            changed = _said_changed(own.error)
            if changed is None:  # judged from the tag's active bytes, where the library did not say
                changed = _active_bytes(tag) != here["before"]
            # A pause that failed having changed nothing may have recorded nothing either, and a
            # restoring resume without a record resumes everything: leave such a rank alone.
            if not changed:
                return None
        tms.resume(tag, restore_chunk_state=JOB_RECORD)
        # Memory a failed non-blocking resume left unrestored was given back by the pause, and
        # its failure settled: the record restores it paused, which it was not.
        return _not_undone([repr(n) for n, t in here["tags"].items() if _unrestored(t)])

    return _agree("pause", _what_tag(tag), act, undo, lambda: _active_bytes(tag), gather, rank)


def _resume_tag(tag: Optional[str], gather: Gather, rank: int, check: Callable[[], None] = _no_check) -> Outcome:
    """Resume ``tag`` on every rank, or none; ``check`` as for :func:`_pause_tag`."""
    tms = _saver()
    tag = _norm_tag(tag)
    here: Dict[str, dict] = {}
    own = _OwnCall()

    def act() -> None:
        check()
        here.update(_tag_stats(tag))
        own(tms.resume, tag)

    def undo() -> Optional[str]:
        # This rank's own resume that failed having changed nothing, as the library says, needs
        # no undo: a pause would take what the program allocated in the tag meanwhile.
        if own.failed and _said_changed(own.error) is False:
            return None
        # Each tag is undone on its own: one wholly paused before is paused again (one a failed
        # non-blocking resume left unrestored too, said to be not as before); one wholly active
        # (allocations kept resident aside, which stay mapped through a pause) was not changed;
        # one partly active, or being restored, cannot be undone exactly (a pause would take
        # what was active before too) and is left resumed, and said so.
        # One whose allocations the program's other threads changed meanwhile is left resumed
        # too: a pause would take what they allocated, which may have no backup.
        partly, restoring, unsettled, moved = [], [], [], []
        now = _tag_stats(tag) if here else {}
        for name, t in here.items():
            active = t["active_allocations"] - t.get("resident_allocations", 0)
            if _restoring(t):
                restoring.append(repr(name))
            elif t.get("partial_allocations", 0) or (active and t["paused_allocations"]):
                partly.append(repr(name))
            elif t["paused_allocations"] and name in now and _allocations_of(now[name]) != _allocations_of(t):
                moved.append(repr(name))
            elif t["paused_allocations"]:
                tms.pause(name)
                if _unrestored(t):
                    unsettled.append(repr(name))
        notes = []
        if partly:
            notes.append(
                f"{', '.join(partly)} had active memory before the resume, which a pause would take too; "
                "left resumed"
            )
        if moved:
            notes.append(
                f"the program allocated or freed memory in {', '.join(moved)} during the call (a pause would "
                "take what it allocated too); left resumed"
            )
        if restoring:
            notes.append(
                f"{', '.join(restoring)} had memory a non-blocking resume was restoring; left as the resume "
                "made it"
            )
        skipped = f"skipped: {'; '.join(notes)}" if notes else None
        return "; ".join(n for n in (skipped, _not_undone(unsettled)) if n) or None

    return _agree("resume", _what_tag(tag), act, undo, lambda: _active_bytes(tag), gather, rank)


def _chunk_op(
    pause_: bool,
    target: Any,
    act: Callable[[], Any],
    asked: Callable[[Any, Optional[BaseException]], Optional[Iterable[int]]],
    what: str,
    op: str,
    gather: Gather,
    rank: int,
) -> Outcome:
    """``act`` (a pause of chunks where ``pause_``, else a resume) on every rank, or none.
    ``asked(result, error)``: the chunks ``act`` was to act on, from what it returned or raised;
    None where that cannot be told."""
    tms = _saver()
    before: List[bool] = []
    own = _OwnCall()

    def act_here() -> Any:
        # Inside the action, so that a bad target fails this rank through the agreement
        # instead of leaving the others waiting in it. Chunks a non-blocking resume is still
        # restoring would read as paused: it is waited for first (its failure, if any, is
        # this rank's).
        if any(_restoring(t) for t in tms.stats()["tags"]):
            tms.wait()
        before.extend(tms.get_chunk_states(target))
        return own(act)

    def undo() -> Optional[str]:
        if not before:
            return None  # failed before changing anything
        if own.failed and _said_changed(own.error) is False:
            # This rank's own call changed nothing, as the library says: a chunk it was asked
            # for that moved since was moved by the program.
            return None
        now = tms.get_chunk_states(target)
        # Only what the call can have moved: a chunk it was asked for, gone its way. Another
        # thread of the program may have paused or resumed other chunks meanwhile: its own.
        moved = [i for i, (b, n) in enumerate(zip(before, now)) if b == pause_ and n != b]
        wanted = asked(own.result, own.error)
        if wanted is None:
            if not moved:
                return None
            return (
                f"skipped: the {op} failed without saying which chunks it was to act on, so chunks "
                f"{moved}, {'paused' if pause_ else 'resumed'} since, may be the program's own; left so"
            )
        wanted = set(wanted)
        mine = [i for i in moved if i in wanted]
        if mine:
            (tms.resume_chunks if pause_ else tms.pause_chunks)(target, mine)
        return None

    return _agree(op, what, act_here, undo, lambda: _active_bytes(None), gather, rank)


def _indices_asked(indices: List[Any]) -> Callable[[Any, Optional[BaseException]], List[int]]:
    """The chunks a chunk call was asked for: none where the indices are refused (the call
    refuses them too, before acting)."""

    def asked(result: Any, error: Optional[BaseException]) -> List[int]:
        try:
            return _check_indices(indices)
        except (TypeError, ValueError):
            return []

    return asked


def _range_asked(result: Any, error: Optional[BaseException]) -> Optional[Iterable[int]]:
    """The chunks a range call was to act on: the ``range`` it returned, or the one its error
    carries (the library says it before acting); None where the error carries none."""
    if error is None:
        return result
    return getattr(error, RANGE_ASKED, None)


def _target(tag_or_tensor: Any) -> str:
    """What a chunk call acts on, the same on every rank: it names the call the ranks agree on
    (and check they are at), and each rank's tensor lies at an address of its own."""
    if isinstance(tag_or_tensor, str):
        return f"tag {tag_or_tensor!r}"
    if not callable(getattr(tag_or_tensor, "data_ptr", None)):  # refused as the package's own calls refuse it
        raise TypeError(f"expected a tag or a torch.Tensor, not {type(tag_or_tensor).__name__}")
    return "each rank's tensor"


def _not_over_nccl(tag: Optional[str], group: Any) -> Callable[[], None]:
    """Refuse a pause or resume that suspends NCCL's communicators (the tag ``"nccl"``, or
    every tag with ``nccl_in_all_tags``) agreeing over a group whose collectives run on NCCL:
    the ranks could not agree over a suspended communicator.

    The tag is an argument, the same on every rank, so every rank refuses it here alike, before
    any collective. ``nccl_in_all_tags`` is each rank's own setting: refused here, a rank with
    it on would raise alone while the others acted and waited for it in the agreement until
    the group's timeout. So it is checked by the returned function, which the action runs
    first: that rank fails without acting, and every rank learns it through the agreement.
    Only a rank with it on whose communicators are suspended already refuses here: it cannot
    take part in a collective over NCCL at all."""
    tag = _norm_tag(tag)
    if tag != "nccl" and tag is not None:
        return _no_check
    import torch.distributed as dist

    try:
        backend = str(dist.get_backend(group)).lower()
    except Exception:  # noqa: BLE001 - _torch_group says what is wrong with the group
        return _no_check
    if "nccl" not in backend or "gloo" in backend:
        return _no_check
    advice = "pass a group of another backend, e.g. group=torch.distributed.new_group(backend='gloo')"
    if tag == "nccl":
        raise InvalidArgumentError(
            f"{_what_tag(tag)} suspends NCCL's communicators, so the ranks cannot agree over an NCCL group: "
            f"{advice}"
        )

    def in_all_tags() -> bool:
        return bool(_saver().nccl_in_all_tags)

    try:
        suspended = in_all_tags() and _tag_stats("nccl").get("nccl", {}).get("paused_allocations", 0) > 0
    except Exception:  # noqa: BLE001 - read again by the check, whose failure the ranks agree on
        suspended = False
    if suspended:
        raise InvalidArgumentError(
            "every tag includes NCCL's communicators on this rank (nccl_in_all_tags), and they are "
            "suspended: it cannot take part in the ranks' agreement over an NCCL group (the other ranks "
            f"wait for it there until the group's timeout): {advice}"
        )

    def check() -> None:
        if in_all_tags():
            raise InvalidArgumentError(
                "every tag includes NCCL's communicators on this rank (nccl_in_all_tags), which it would "
                f"suspend or resume, so the ranks cannot agree over an NCCL group: {advice}"
            )

    return check


def pause(tag: Optional[str] = None, group: Any = None) -> Outcome:
    """Pause ``tag`` (every tag if None) on every rank of ``group`` (the default group if None),
    or on none: see the module's documentation. Returns every rank's :class:`Outcome`; raises
    :class:`DistributedError` on every rank if any rank failed. The tag ``"nccl"`` (NCCL's
    communicators) needs a ``group`` that is not NCCL's (gloo): NCCL's suspend waits for every
    rank of each communicator, and the ranks then agree over that group. So does every tag
    where a rank has ``nccl_in_all_tags`` on: over an NCCL group such a rank fails without
    acting, and every rank raises :class:`DistributedError` naming it (one whose communicators
    are suspended already cannot take part, and raises ``InvalidArgumentError`` at once)."""
    gather = _torch_group(group)
    return _pause_tag(tag, *gather, check=_not_over_nccl(tag, group))


def resume(tag: Optional[str] = None, group: Any = None) -> Outcome:
    """Resume ``tag`` (every tag if None) on every rank of ``group``, or on none (the tag
    ``"nccl"``, and every tag where a rank has ``nccl_in_all_tags`` on, as for :func:`pause`)."""
    gather = _torch_group(group)
    return _resume_tag(tag, *gather, check=_not_over_nccl(tag, group))


def pause_chunks(
    tag_or_tensor: Any = None,
    indices: Optional[Iterable[int]] = None,
    group: Any = None,
    *,
    tag: Any = None,
    chunk_indices: Optional[Iterable[int]] = None,
) -> Outcome:
    """``pause_chunks`` on every rank of ``group``, or on none (``tag=`` and ``chunk_indices=`` as
    the package's own take them)."""
    return _chunks_of(True, tag_or_tensor, indices, group, tag, chunk_indices)


def resume_chunks(
    tag_or_tensor: Any = None,
    indices: Optional[Iterable[int]] = None,
    group: Any = None,
    *,
    tag: Any = None,
    chunk_indices: Optional[Iterable[int]] = None,
) -> Outcome:
    """``resume_chunks`` on every rank of ``group``, or on none (``tag=`` and ``chunk_indices=`` as
    the package's own take them)."""
    return _chunks_of(False, tag_or_tensor, indices, group, tag, chunk_indices)


def _chunks_of(
    pause_: bool, tag_or_tensor: Any, indices: Any, group: Any, tag: Any, chunk_indices: Any
) -> Outcome:
    """``pause_chunks`` (``pause_``) or ``resume_chunks`` on every rank of ``group``, or none."""
    op = "pause_chunks" if pause_ else "resume_chunks"
    target, indices = chunk_arguments(op, tag_or_tensor, indices, tag, chunk_indices)
    idx = list(indices)
    return _chunk_op(
        pause_,
        target,
        lambda: getattr(_saver(), op)(target, idx),
        _indices_asked(idx),
        f"{len(idx)} chunks of {_target(target)}",
        op,
        *_torch_group(group),
    )


def pause_range(tensor: Any, start: int, end: int, group: Any = None) -> Outcome:
    """``pause_range`` on every rank of ``group``, or on none; ``Outcome.result`` is this rank's
    chunk ``range``."""
    return _chunk_op(
        True,
        tensor,
        lambda: _saver().pause_range(tensor, start, end),
        _range_asked,
        f"bytes [{start}, {end}) of {_target(tensor)}",
        "pause_range",
        *_torch_group(group),
    )


def resume_range(tensor: Any, start: int, end: int, group: Any = None) -> Outcome:
    """``resume_range`` on every rank of ``group``, or on none."""
    return _chunk_op(
        False,
        tensor,
        lambda: _saver().resume_range(tensor, start, end),
        _range_asked,
        f"bytes [{start}, {end}) of {_target(tensor)}",
        "resume_range",
        *_torch_group(group),
    )
