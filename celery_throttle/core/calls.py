"""What a gate sends and how it reads the answer: :class:`GateCalls`, without the I/O.

The commands' scripts (``lua/*.lua``), their KEYS and ARGV as the scripts
name them, and their replies read into the records of ``limits.py``; the
sync :class:`~celery_throttle.Gate` and the async
:class:`~celery_throttle.AsyncGate` add the I/O.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable, Sequence
from typing import Any, Literal, TypeVar

from ..values import US_PER_SECOND, from_us, seconds, text, to_us, units
from .keys import bell_key, epoch_key, freed_key, validate_prefix
from .limits import (
    ADMITTED,
    AnyLimit,
    BucketState,
    Concurrency,
    Decision,
    Learned,
    LeaseState,
    Limit,
    Reservation,
    rates_of,
)
from .logs import logger
from .packed import AsyncPackedPath, Call, PackedPath, Plain
from .scripts import script

__all__ = ["COMMANDS", "Clock", "F", "GateCalls"]

#: The gate's commands, one script each (Gate and AsyncGate both run them): name -> the
#: script, with the libraries it includes (the rate bucket, the lease, the epoch: shared
#: with the waiting room's dispatch) in front.  "decide" is the hot path.
COMMANDS = {name: script(__package__, f"{name}.lua") for name in (
    "decide", "release", "renew", "pause", "resume", "settle", "follow", "cancel", "inspect")}

# Reply status codes of decide.lua (0 denied and 2 reserved are told apart by the booking).
_ALLOWED, _EARLY, _QUEUED = 1, 3, 4
_NEVER = -1
# The booked-limits mask travels as an integer (exact in a Lua double).
_MAX_LIMITS = 50


Clock = Literal["server", "local"] | Callable[[], float]
F = TypeVar("F", bound=Callable[..., Any])


class GateCalls:
    """What a gate sends and how it reads the answer, without the I/O.

    :class:`Gate` (redis-py) and :class:`~celery_throttle.AsyncGate`
    (``redis.asyncio``) are this plus the I/O of each method (a script call,
    or for a plain decision the packed path of ``packed.py``), so both send
    the same script the same arguments and read its replies one way.
    """

    def __init__(self, prefix: str, clock: Clock) -> None:
        if clock not in ("server", "local") and not callable(clock):
            raise ValueError(f"invalid clock {clock!r}: expected 'server', 'local' or a callable")
        self.prefix = validate_prefix(prefix)
        self.clock = clock
        # The packed hot path (packed.py), when the client can take it: the gate sets it.
        self._packed: PackedPath | AsyncPackedPath | None = None

    def __repr__(self) -> str:
        # No client in the repr: a client's names host and db, a URL may hold a password.
        clock = self.clock if isinstance(self.clock, str) else "caller"
        return f"{type(self).__name__}(prefix={self.prefix!r}, clock={clock!r})"

    def key_of(self, limit: AnyLimit) -> str:
        """The Redis key of ``limit``'s bucket (a concurrency limit's: its leases)."""
        return limit.key_in(self.prefix).decode()

    def _plain(self, limits: Sequence[AnyLimit], reserve: float | None, grace: float,
               claim: Reservation | None, holder: str, in_line: bool = False,
               near: float = 0.0) -> Plain | None:
        """A plain decision's cache key and its packed command (or, the first time, its KEYS
        and ARGV, validated before any I/O); None: not a plain decision, the full path."""
        if self._packed is None or claim is not None or holder or self.clock != "server":
            return None
        key = (tuple(limits), reserve, grace, in_line, near)
        try:
            packed = self._packed.cached(key)  # the one hash of the key
        except TypeError:  # an unhashable key value (bytearray): the full path
            return None
        return key, packed if packed is not None else self._decide_call(
            limits, reserve, None, grace, "", in_line, near)

    def _decide_call(self, limits: Sequence[AnyLimit], reserve: float | None,
                     claim: Reservation | None, grace: float, holder: str,
                     in_line: bool = False, near: float = 0.0) -> Call:
        if not limits or len(limits) > _MAX_LIMITS:
            raise ValueError(f"acquire_many takes 1 to {_MAX_LIMITS} limits, got {len(limits)}")
        if not holder and any(lim.leased for lim in limits):
            raise ValueError("a Concurrency limit needs a holder (the lease owner's id)")
        keys = self._keys(limits)
        if in_line:
            keys += [lim.line_in(self.prefix) for lim in limits]
        args = list(_decide_head(now=self._now_us(),
                                 horizon=_NEVER if reserve is None else to_us(reserve),
                                 claim=claim, grace=to_us(grace), holder=holder,
                                 near=to_us(near)))
        return keys, args + self._limit_args(limits)

    @staticmethod
    def _decision(limits: Sequence[AnyLimit], reply: Any) -> Decision:
        if reply == _ALLOWED:  # the hot path replies with a bare integer
            return ADMITTED
        status, wait_us, blocking, start_us, now_us, mask, epoch, shift = reply[:8]
        if len(reply) > 8:  # (simply admitted, and learned rates moved: say so)
            _say_moves(limits, reply[8:], "raised", "used while the provider accepted")
            return ADMITTED
        blocked = limits[blocking - 1] if blocking else None
        retry_after = from_us(wait_us)
        booking = (Reservation(start=start_us, booked=mask, epoch=epoch, shift=shift)
                   if start_us else None)
        if status == _ALLOWED:  # a claim honoured, at once or for its booked start just ahead
            return Decision(True, retry_after, reservation=booking, now=now_us)
        if status == _EARLY:
            return Decision(False, retry_after, reservation=booking, now=now_us, early=True)
        if status == _QUEUED:
            return Decision(False, retry_after, limit=blocked, now=now_us, queued=True)
        return Decision(False, retry_after, limit=blocked, reservation=booking, now=now_us)

    def _call(self, limits: Sequence[AnyLimit], *head: object) -> Call:
        """KEYS and ARGV of a command that takes ``limits`` (``lua/limits.lua``) after its
        own ARGV ``head`` (its script names them; now, the first, is added here)."""
        args = [str(self._now_us()).encode(), *(str(v).encode() for v in head)]
        return self._keys(limits), args + self._limit_args(limits)

    def _release_call(self, limits: Sequence[AnyLimit], holder: str, ran_us: int) -> Call:
        keys, args = self._call(limits, holder, ran_us)
        # A seat given back: the tasks in line for one are due at once.
        keys += [lim.line_in(self.prefix) for lim in limits if lim.leased]
        keys += [freed_key(self.prefix).encode(), bell_key(self.prefix).encode()]
        return keys, args

    def _paused_call(self, limits: Sequence[AnyLimit], *head: object) -> Call:
        if not limits:
            raise ValueError("pause and resume need at least one limit")
        return self._call(limits, *head)

    def _pause_call(self, limits: Sequence[AnyLimit], pause: float,
                    refused_after: float | None) -> Call:
        """The "pause" call: ``pause`` seconds; ``refused_after``: the provider refused, for
        its quota, a request admitted that many seconds ago (the limits that learn cut)."""
        age = -1 if refused_after is None else to_us(seconds("refused_after", refused_after))
        return self._paused_call(limits, to_us(seconds("pause", pause)), age)

    @staticmethod
    def _pause_reply(limits: Sequence[AnyLimit], reply: Any) -> float:
        _say_moves(limits, reply[1:], "cut", "the provider refused a request for its quota")
        return from_us(int(reply[0]))

    def _cancel_call(self, limits: Sequence[AnyLimit], booking: Reservation) -> Call:
        return self._call(limits, booking.start, booking.booked, booking.epoch)

    def _settle_call(self, limit: Limit, actual: int, charged: int | None) -> Call | None:
        diff = (units("actual cost", actual)
                - (limit.cost if charged is None else units("charged cost", charged)))
        if diff == 0:
            return None
        args = [str(self._now_us()).encode(), limit.interval_field.encode(),
                str(limit.burst).encode(), str(diff).encode()]
        return self._keys([limit]), args

    def _follow_call(self, limits: Sequence[AnyLimit], remaining: int,
                     reset: float) -> Call | None:
        """The "follow" call for the rate limits among ``limits`` that the report can
        bind, or None (decided here, without a round trip).

        A report binds a limit only if its own pace could spend more than
        ``remaining`` before ``reset``: (remaining + 1 - burst) intervals
        end before it.  Otherwise the script would leave the bucket alone
        (starts booked in it only make that more certain).
        """
        left = units("remaining", remaining)
        reset_us = to_us(seconds("reset", reset))
        bound = [lim for lim in rates_of(limits)
                 if (left + 1 - lim.burst) * lim.rate.interval_us < reset_us]
        if not bound:
            return None
        args = [str(self._now_us()).encode(), str(reset_us).encode()]
        for lim in bound:
            args += [lim.interval_field.encode(), str(lim.burst).encode(),
                     str(left).encode()]
        return self._keys(bound) + [lim.held_in(self.prefix) for lim in bound], args

    def _inspect_call(self, limit: AnyLimit) -> Call:
        keys, args = self._call([limit])
        return keys + self._held_keys(limit), args

    @staticmethod
    def _bucket_state(limit: Limit, reply: Any) -> BucketState:
        exists, ahead, next_free, pttl, now, paused, held, left, at, interval = (
            int(v) for v in reply[:10])
        learned = None
        if interval:
            why, moved, before = text(reply[10]), int(reply[11]), text(reply[12])
            learned = Learned(rate=US_PER_SECOND / interval, why=why,
                              since=from_us(now - moved) if moved else 0.0,
                              before=float(before or 0))
        used = ahead / (interval or limit.rate.interval_us)  # the bucket's content, in starts
        booked = max(0, math.ceil(used - 1e-9) - limit.burst)
        return BucketState(limit=limit, exists=bool(exists), used=used,
                           next_free=from_us(next_free), booked_ahead=booked,
                           ttl=max(0, pttl) / 1000, now=now, paused=from_us(paused),
                           held=from_us(held) if left >= 0 else 0.0,
                           held_remaining=left if left >= 0 else None,
                           held_since=from_us(now - at) if left >= 0 else 0.0,
                           learned=learned)

    @staticmethod
    def _lease_state(limit: Concurrency, reply: Any) -> LeaseState:
        held, paused, run, _now = (int(v) for v in reply)
        return LeaseState(limit=limit, held=held, paused=from_us(paused),
                          average_run=from_us(run))

    def _reset_keys(self, limit: AnyLimit) -> list[bytes]:
        return [limit.key_in(self.prefix), *limit.side_keys(self.prefix),
                *self._held_keys(limit)]

    def _held_keys(self, limit: AnyLimit) -> list[bytes]:
        """A rate limit's hold note (``Gate.follow``); a concurrency limit has none."""
        return [limit.held_in(self.prefix)] if isinstance(limit, Limit) else []

    def _keys(self, limits: Sequence[AnyLimit]) -> list[bytes]:
        """The limits' KEYS of every command (``lua/limits.lua``): each limit's key, the
        epoch, then each limit's side keys."""
        keys = [lim.key_in(self.prefix) for lim in limits]
        keys.append(_epoch_key(self.prefix))
        keys += [k for lim in limits for k in lim.side_keys(self.prefix)]
        return keys

    @staticmethod
    def _limit_args(limits: Sequence[AnyLimit]) -> list[bytes]:
        return [arg for lim in limits for arg in lim.script_args()]

    def _now_us(self) -> int:
        if self.clock == "server":
            return 0  # the script reads TIME
        now = time.time() if self.clock == "local" else self.clock()
        return int(now * US_PER_SECOND)


def _decide_head(*, now: int, horizon: int, claim: Reservation | None, grace: int,
                 holder: str, near: int) -> tuple[bytes, ...]:
    """ARGV[1..9] of decide.lua (its header names them), microseconds throughout."""
    if now == 0 and claim is None and not holder:
        return _plain_head(horizon, grace, near)  # most calls: the few distinct ones
    start, mask, epoch, shift = ((claim.start, claim.booked, claim.epoch, claim.shift)
                                if claim is not None else (0, 0, 0, 0))
    return (*(str(v).encode() for v in (now, horizon, start, grace, mask, epoch)),
            holder.encode(), str(near).encode(), str(shift).encode())


@functools.lru_cache(maxsize=256)
def _plain_head(horizon: int, grace: int, near: int) -> tuple[bytes, ...]:
    return (b"0", str(horizon).encode(), b"0", str(grace).encode(), b"0", b"0", b"",
            str(near).encode(), b"0")


@functools.lru_cache(maxsize=64)
def _epoch_key(prefix: str) -> bytes:
    return epoch_key(prefix).encode()


def _say_moves(limits: Sequence[AnyLimit], moves: Sequence[Any], verb: str,
               because: str) -> None:
    """Log the learned rates' moves a script replied ("i before after" each), at INFO."""
    for move in moves:
        i, before, after = text(move).split()
        logger.info("throttle: learned rate of %s %s from %.4g/s to %.4g/s (%s)",
                    limits[int(i) - 1].name, verb, float(before), float(after), because)
