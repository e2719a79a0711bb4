"""The records a decision is about: the limits, and what the gate answers.

Plain frozen dataclasses, below the gate and the waiting helpers in the
layers (they import only rates, keys and values), so that every layer above
may use them.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import ClassVar

from ..values import check_cost, positive_int, seconds, to_us
from .keys import (
    bucket_key,
    held_key,
    key_digest,
    learned_key,
    leases_key,
    line_key,
    meta_key,
    seat_line_key,
    turns_key,
    validate_name,
)
from .rates import Rate, parse_rate

__all__ = ["DEFAULT_LEASE", "FLOOR_SHARE", "AnyLimit", "BucketState", "Concurrency", "Decision",
           "Learned", "LeaseState", "Limit", "Reservation", "declared", "pauses_for_refusal",
           "rates_of", "seats_of"]

#: A lease a heartbeat does not extend ends this long after it was taken.
DEFAULT_LEASE = 30.0

#: A limit that learns its rate never goes below its rate / this, unless given a floor.
FLOOR_SHARE = 10

@dataclass(frozen=True, slots=True)
class Limit:
    """One bucket to pass: ``name`` (and ``key``) at ``rate`` with ``burst``, charged ``cost``.

    ``burst`` starts may happen at the same instant; over any window of length
    ``w`` at most ``burst - 1 + ceil(w * rate)`` units pass.  ``cost`` units are
    charged per start; a cost above the burst could never pass and is refused.

    ``adaptive``: the provider's quota is not known: decide at a rate learned
    in the store from the provider's quota refusals (``lua/learn.lua``), never
    above ``rate`` (the ceiling) nor below ``floor`` (default: a tenth of
    ``rate``).  The bound above then holds at the learned rate of each moment.
    """

    name: str
    rate: Rate
    burst: int = 1
    key: object = field(default=None, repr=False)  # may be a secret: never shown
    cost: int = 1
    # Fair share: tasks waiting in line for this limit are served by this
    # value in turn (room/lines.py).  Not part of the limit's identity: the
    # bucket, and every decision on it, are the same whatever it is.
    fair: object = field(default=None, repr=False, compare=False)
    adaptive: bool = False
    floor: Rate | None = None

    #: Admitted under a holder's name, who gives a lease back (see :class:`Concurrency`).
    leased: ClassVar[bool] = False

    def __post_init__(self) -> None:
        validate_name(self.name)
        object.__setattr__(self, "rate", parse_rate(self.rate))
        check_cost(self.cost, positive_int("burst", self.burst), self.name)
        if not isinstance(self.adaptive, bool):
            raise TypeError(f"invalid adaptive {self.adaptive!r}: expected True or False")
        if self.floor is not None:
            if not self.adaptive:
                raise ValueError(f"a floor ({self.floor}) but no learning: give "
                                 "adaptive=True, or no floor")
            floor = parse_rate(self.floor)
            if floor.interval_us < self.rate.interval_us:
                raise ValueError(f"invalid floor '{floor}': above the rate {self.rate}")
            object.__setattr__(self, "floor", floor)
        if self.key is not None:
            key_digest(self.key)  # a TypeError naming the type, now rather than at the call
        if self.fair is not None:
            key_digest(self.fair)

    @property
    def interval_us(self) -> int:
        """The spacing of starts (microseconds), carried with a booking."""
        return self.rate.interval_us

    @property
    def interval_field(self) -> str:
        """Its interval as every gate command reads it (``lua/limits.lua``): the interval
        (us), or for a limit that learns, its ceiling's and its floor's: ``"T/F"``."""
        if not self.adaptive:
            return str(self.rate.interval_us)
        floor = (self.floor.interval_us if self.floor is not None
                 else self.rate.interval_us * FLOOR_SHARE)
        return f"{self.rate.interval_us}/{floor}"

    def script_args(self) -> tuple[bytes, bytes, bytes]:
        """Its three ARGV in every gate command (``lua/limits.lua``): interval (us), burst, cost."""
        return _encoded(self.interval_field, self.burst, self.cost)

    def key_in(self, prefix: str) -> bytes:
        """The bucket's key, the one KEYS entry a decision needs of this limit."""
        return _key_bytes(bucket_key, prefix, self.name, self.key)

    def side_keys(self, prefix: str) -> tuple[bytes, ...]:
        """Keys besides :meth:`key_in` that a call on this limit touches: the learned
        rate's record of a limit that learns (``lua/learn.lua``), else none."""
        return (_key_bytes(learned_key, prefix, self.name, self.key),) if self.adaptive else ()

    def line_in(self, prefix: str) -> bytes:
        """The line of tasks waiting for this limit (``room/lines.py``)."""
        return _key_bytes(line_key, prefix, self.name, self.key)

    def held_in(self, prefix: str) -> bytes:
        """Why a provider's report holds this limit back, while it does (``Gate.follow``)."""
        return _key_bytes(held_key, prefix, self.name, self.key)

    def turns_in(self, prefix: str) -> bytes:
        """The turns of its fair line (``room/lines.py``)."""
        return _key_bytes(turns_key, prefix, self.name, self.key)


@dataclass(frozen=True, slots=True, init=False)
class Concurrency:
    """At most ``seats`` holders of ``name`` (and ``key``) at once, each on a lease.

    A holder (a task id) takes a seat when admitted and gives it back with
    :meth:`Gate.release`; :meth:`Gate.extend` renews the lease while it runs.
    A holder that never does either (its worker was killed) loses the seat
    ``lease`` seconds after it last renewed it.
    """

    name: str
    seats: int
    key: object = field(default=None, repr=False)  # may be a secret: never shown
    lease: float = DEFAULT_LEASE

    leased: ClassVar[bool] = True
    #: A concurrency limit spaces no starts.
    interval_us: ClassVar[int] = 0

    def __init__(self, name: str, seats: int | None = None, key: object = None,
                 lease: float = DEFAULT_LEASE, *, slots: int | None = None) -> None:
        """``slots``: deprecated (0.1.0's name of ``seats``)."""
        if slots is not None:
            if seats is not None:
                raise TypeError("Concurrency() takes seats or slots (its former name), "
                                "not both")
            _renamed("Concurrency(slots=...)", "Concurrency(seats=...)")
            seats = slots
        if seats is None:
            raise TypeError("Concurrency() needs seats: how many may hold it at once")
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "seats", seats)
        object.__setattr__(self, "key", key)
        object.__setattr__(self, "lease", lease)
        self._validate()

    @property
    def slots(self) -> int:
        """Deprecated (0.1.0's name): :attr:`seats`."""
        _renamed("Concurrency.slots", "Concurrency.seats")
        return self.seats

    def _validate(self) -> None:
        validate_name(self.name)
        positive_int("concurrency", self.seats)
        if self.key is not None:
            key_digest(self.key)
        if not 0.1 <= seconds("lease", self.lease) <= 86400:
            raise ValueError(f"invalid lease {self.lease!r}: expected seconds from 0.1 "
                             "to 86400")

    @property
    def lease_us(self) -> int:
        """The lease in microseconds."""
        return to_us(self.lease)

    def script_args(self) -> tuple[bytes, bytes, bytes]:
        """Its three ARGV in every gate command (``lua/limits.lua``): 0, seats, lease (us)."""
        return _encoded(0, self.seats, self.lease_us)

    def key_in(self, prefix: str) -> bytes:
        """The leases' key (a sorted set: holder -> lease expiry)."""
        return _key_bytes(leases_key, prefix, self.name, self.key)

    def side_keys(self, prefix: str) -> tuple[bytes, ...]:
        """The meta hash: average run, holders' starts, pacing cursor, pause."""
        return (_key_bytes(meta_key, prefix, self.name, self.key),)

    def line_in(self, prefix: str) -> bytes:
        """The line of tasks waiting in line for a seat (``room/lines.py``)."""
        return _key_bytes(seat_line_key, prefix, self.name, self.key)

    def turns_in(self, prefix: str) -> bytes:
        """A seat's line is never fair and has no turns: its line stands in their place
        among a script's keys (``keys.LINES``), where nothing reads or writes turns."""
        return self.line_in(prefix)


#: Either kind of limit; :meth:`Gate.acquire_many` decides them together.
AnyLimit = Limit | Concurrency


def declared(name: str, rate: str | Rate | None, burst: int = 1, key: object = None,
             cost: int = 1, concurrency: int | None = None, lease: float = DEFAULT_LEASE,
             fair: object = None, adaptive: bool = False,
             floor: Rate | None = None) -> list[AnyLimit]:
    """The limits one declaration makes under ``name``: a rate limit (``rate``, with its
    ``burst``, ``cost``, ``fair`` key value, learning below it if ``adaptive``), a
    concurrency limit (``concurrency`` seats, each for a ``lease``), or both, in that
    order, for key value ``key``."""
    if rate is None and concurrency is None:
        raise ValueError("give a rate, a concurrency, or both")
    limits: list[AnyLimit] = []
    if rate is not None:
        limits.append(Limit(name, parse_rate(rate), burst, key, cost, fair, adaptive, floor))
    if concurrency is not None:
        limits.append(Concurrency(name, concurrency, key, lease))
    return limits


def pauses_for_refusal(limits: Iterable[AnyLimit], seconds: float, named: bool
                       ) -> list[tuple[list[AnyLimit], float]]:
    """How a provider's quota refusal pauses ``limits``: groups of (limits, seconds).

    A limit that learns its rate is cut by the refusal (``Gate.pause``'s
    ``refused_after``), and paused only for a wait the provider ``named``;
    the others are paused ``seconds`` (a default when none was named).
    """
    given = list(limits)
    learning: list[AnyLimit] = [lim for lim in given if isinstance(lim, Limit) and lim.adaptive]
    if named or not learning:
        return [(given, seconds)]
    fixed = [lim for lim in given if lim not in learning]
    return [(learning, 0.0), *([(fixed, seconds)] if fixed else [])]


def rates_of(limits: Iterable[AnyLimit]) -> list[Limit]:
    """The rate limits among ``limits``, in their order."""
    return [lim for lim in limits if isinstance(lim, Limit)]


def seats_of(limits: Iterable[AnyLimit]) -> list[Concurrency]:
    """The concurrency limits among ``limits`` (each a number of seats), in their order."""
    return [lim for lim in limits if isinstance(lim, Concurrency)]


@dataclass(frozen=True, slots=True)
class Reservation:
    """A booked start: ``start`` (server clock, microseconds) and the limits it is booked in.

    ``booked`` has bit ``i`` set for ``limits[i]`` of the call that booked it;
    the other limits are charged when the reservation is claimed.  ``epoch``
    identifies the store's lifetime: after a Redis restart or flush the
    buckets are empty and older reservations are void.  ``shift``: the booked
    limits' settlement shift when it was booked (microseconds): settlements
    that charged more than their estimates since then move the booked start later.
    """

    start: int
    booked: int
    epoch: int = 0
    shift: int = 0

    @property
    def slot(self) -> int:
        """Deprecated (0.1.0's name): :attr:`start`."""
        _renamed("Reservation.slot", "Reservation.start")
        return self.start


@dataclass(frozen=True, slots=True)
class Decision:
    """The gate's answer.

    ``allowed``: start now, or, for a claim admitted for its booked start just ahead of
    it (or a start booked within ``near``), after ``retry_after`` seconds (the
    booked start is the start's, so start then, not earlier; ``reservation`` names
    it, to claim again if the caller wakes too late for it).  Otherwise
    ``retry_after`` seconds is the exact wait, ``limit`` the limit that
    forced it and, when the call asked for a
    reservation and got one (or claimed one too early), ``reservation`` is the
    booked start to hand back as ``claim=`` when the job returns.  ``now`` is
    the decision's clock (microseconds), 0 on a plain "allowed" (kept off the
    hot path's reply).
    """

    allowed: bool
    retry_after: float
    limit: AnyLimit | None = None
    reservation: Reservation | None = None
    now: int = 0
    early: bool = False
    queued: bool = False  # in line: ``limit`` has waiting tasks; join its line

    @property
    def reserved(self) -> bool:
        """A start is booked for this caller (it must wait ``retry_after``, then claim it)."""
        return not self.allowed and self.reservation is not None

    @property
    def start(self) -> int | None:
        """The booked (or claimed) start, server clock microseconds."""
        return self.reservation.start if self.reservation is not None else None

    @property
    def slot(self) -> int | None:
        """Deprecated (0.1.0's name): :attr:`start`."""
        _renamed("Decision.slot", "Decision.start")
        return self.start


def _renamed(old: str, new: str) -> None:
    """A name 0.1.0 shipped was used: warn once per call site, as Python's own deprecations do."""
    warnings.warn(f"{old} is deprecated; use {new}", DeprecationWarning, stacklevel=3)


#: The hot path's answer, one shared object: start now.
ADMITTED = Decision(True, 0.0)


@dataclass(frozen=True, slots=True)
class BucketState:
    """What a bucket holds right now, read without changing it (:meth:`Gate.inspect`).

    ``used``: units taken out of the burst (0 = full bucket; with bookings it
    goes past ``burst``).  ``next_free``: seconds until one start of the
    limit's cost would be admitted (0 = now).  ``booked_ahead``: starts booked
    beyond what the burst holds, i.e. deferred tasks waiting in this limit
    with a booked start (tasks booked only in another of their limits, or
    waiting beyond the horizon, are not counted).  ``ttl``: seconds until the
    key expires (the bucket is full again then), 0 when absent.  ``paused``:
    seconds until a pause set by :meth:`Gate.pause` ends (``next_free``
    includes it).  ``held``: seconds until the provider's reset while its
    report holds the limit below its rate (:meth:`Gate.follow` moved it;
    ``next_free`` includes that), with ``held_remaining`` the units the
    provider said were left and ``held_since`` how long ago (seconds).
    ``learned``: a limit that learns its rate, what it learned; else None.
    """

    limit: Limit
    exists: bool
    used: float
    next_free: float
    booked_ahead: int
    ttl: float
    now: int  # the clock the state was read at (microseconds)
    paused: float = 0.0  # seconds until a provider's pause ends (0: not paused)
    held: float = 0.0
    held_remaining: int | None = None
    held_since: float = 0.0
    learned: Learned | None = None


@dataclass(frozen=True, slots=True)
class Learned:
    """The rate a limit that learns decides at now (``lua/learn.lua``): ``rate``, starts
    a second; its last move, ``why`` ("cut": a provider's quota refusal; "raise": used
    while the provider accepted; "": none yet), ``since`` how long ago (seconds), and the
    rate ``before`` it (0.0 without a move)."""

    rate: float
    why: str
    since: float
    before: float


@dataclass(frozen=True, slots=True)
class LeaseState:
    """What a concurrency limit holds right now (:meth:`Gate.inspect_leases`)."""

    limit: Concurrency
    held: int  # unexpired leases
    paused: float  # seconds until a pause ends (0: not paused)
    average_run: float  # seconds, the moving average of released runs (0: none yet)


# The arguments of a limit and its keys are encoded once, not per call: with
# redis-py's pure-Python encoder that is a good part of a decision's cost.
@functools.lru_cache(maxsize=1024)
def _encoded(interval: int | str, burst: int, cost: int) -> tuple[bytes, bytes, bytes]:
    return (str(interval).encode(), str(burst).encode(), str(cost).encode())


@functools.lru_cache(maxsize=65536)
def _cached_key(make: Callable[[str, str, object], str], prefix: str, name: str,
                key: object) -> bytes:
    return make(prefix, name, key).encode()


def _key_bytes(make: Callable[[str, str, object], str], prefix: str, name: str,
               key: object) -> bytes:
    try:
        return _cached_key(make, prefix, name, key)
    except TypeError:  # an unhashable key value (bytearray): hashed every time
        return make(prefix, name, key).encode()
