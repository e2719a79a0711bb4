"""The admission decision (integration/admission.py): one row per action and per edge.

The decision takes what is known about a task and the gate's answer and
returns what to do; nothing here touches Celery, the store or a clock, so
each row is the answer itself.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from celery_throttle import Concurrency, Decision, Limit, Reservation, parse_rate
from celery_throttle.core.waiting import Outcome
from celery_throttle.integration import admission
from celery_throttle.integration.admission import (
    CountDown,
    Drop,
    JoinLine,
    Known,
    Sleep,
    Start,
    StoreFailed,
    TimeOut,
    WaitForStore,
)

RATE = Limit("api", parse_rate("2/s"))  # 0.5 s between starts
FAST = Limit("fast", parse_rate("100/s"))
SEATS = Concurrency("seats", 3)
NOW = 1_000_000_000  # the server's clock at the answer (us)
SEC = 1_000_000


def known(**changes: object) -> Known:
    base: dict[str, object] = {"limits": [RATE], "max_sleep": 0.5, "horizon": 60.0,
                               "shortest": 0.5}
    return Known(**{**base, **changes})  # type: ignore[arg-type]


def refusal(wait: float, *, booked: int = 1, limit: object = RATE, queued: bool = False,
            early: bool = False) -> Decision:
    """The gate's refusal: ``wait`` seconds, a start booked in ``booked`` (-1: nothing
    booked, a wait beyond the horizon)."""
    booking = None if booked < 0 else Reservation(start=NOW + int(wait * SEC), booked=booked)
    return Decision(allowed=False, retry_after=wait, limit=limit,  # type: ignore[arg-type]
                    reservation=booking, now=NOW, queued=queued, early=early)


# --- refused: every refusal, before anything is waited ------------------------------

@pytest.mark.parametrize(("case", "facts", "answer", "expected"), [
    ("a start booked close by is slept in the process",
     {}, refusal(0.3), Sleep(0.3)),
    ("a start booked further than max_sleep: a countdown to it (room closed)",
     {}, refusal(5.0), CountDown(5.0, "api", 5.0, Reservation(NOW + 5 * SEC, 1))),
    ("... and in line where the room is open, the booking given back",
     {"in_line": True}, refusal(5.0), JoinLine(RATE, 5.0, Reservation(NOW + 5 * SEC, 1))),
    ("nothing booked (beyond the horizon): a countdown to when a start is within reach",
     {"horizon": 10.0}, refusal(100.0, booked=-1), CountDown(90.0, "api", 100.0)),
    ("nothing booked just past the horizon: no shorter countdown than max_sleep",
     {"horizon": 10.0}, refusal(10.1, booked=-1), CountDown(0.5, "api", 10.1)),
    ("tasks in line already: behind them, whatever the wait",
     {"in_line": True}, refusal(0.1, booked=-1, queued=True), JoinLine(RATE, 0.1)),
    ("tasks in line: behind them even past its expiry (the line drops it then)",
     {"in_line": True, "to_expiry": 0.05}, refusal(0.1, booked=-1, queued=True),
     JoinLine(RATE, 0.1)),
    ("a full concurrency limit's paced return: in the seat's line where it is open",
     {"limits": [SEATS], "in_line": True}, refusal(0.2, booked=0, limit=SEATS),
     JoinLine(SEATS, 0.2)),
    ("... slept in the process where the room is closed",
     {"limits": [SEATS]}, refusal(0.2, booked=0, limit=SEATS), Sleep(0.2)),
    ("its start lies past its expiry: dropped, never run",
     {"to_expiry": 2.0}, refusal(3.0), Drop("expired", 3.0)),
    ("expiry inside a wait it sleeps: the same, however short the wait",
     {"to_expiry": 0.1}, refusal(0.3), Drop("expired", 0.3)),
    ("its max_wait would pass: timed out, naming the limit and the whole wait",
     {"max_wait": 10.0, "since": NOW - 8 * SEC}, refusal(3.0), TimeOut("api", 11.0, 10.0)),
    ("within its max_wait: it waits",
     {"max_wait": 10.0, "since": NOW - 8 * SEC}, refusal(1.5),
     CountDown(1.5, "api", 1.5, Reservation(NOW + int(1.5 * SEC), 1))),
    ("an early answer (its start moved later) names no limit: the booked limit's name",
     {"limits": [FAST, RATE]}, refusal(2.0, booked=2, limit=None, early=True),
     CountDown(2.0, "api", 2.0, Reservation(NOW + 2 * SEC, 2))),
    ("... and in line, the line of the first rate limit",
     {"limits": [SEATS, RATE], "in_line": True}, refusal(2.0, booked=2, limit=None,
                                                       early=True),
     JoinLine(RATE, 2.0, Reservation(NOW + 2 * SEC, 2))),
    ("a copy sent for a start sleeps up to the dispatch lead, past max_sleep",
     {"max_sleep": admission.longest_sleep(0.5, 1.0, sent_for_a_start=True)}, refusal(1.05),
     Sleep(1.05)),
])
def test_a_refusal_is_decided_before_it_is_waited(case: str, facts: dict[str, object],
                                                   answer: Decision, expected: object) -> None:
    assert admission.refused(known(**facts), answer) == expected, case


# --- settled: where the task goes once its plan in the process ended ----------------

@pytest.mark.parametrize(("case", "facts", "outcome", "expected"), [
    ("admitted: it starts, late by what the plan measured",
     {}, Outcome(Decision(allowed=True, retry_after=0.0), late=0.04), Start(late=0.04)),
    ("a lost claim after its sleeps (booked again further out): a countdown to it",
     {}, Outcome(refusal(0.4)), CountDown(0.4, "api", 0.4, Reservation(NOW + 400_000, 1))),
    ("... or the line, where it is open",
     {"in_line": True}, Outcome(refusal(0.4)),
     JoinLine(RATE, 0.4, Reservation(NOW + 400_000, 1))),
    ("a refusal with tasks in line: joins it",
     {"in_line": True}, Outcome(refusal(7.0, booked=-1, queued=True)), JoinLine(RATE, 7.0)),
    ("the refusal that ended it lies past its expiry: dropped, never run",
     {"to_expiry": 2.0}, Outcome(refusal(3.0)), Drop("expired", 3.0)),
    ("... or past its max_wait: timed out",
     {"max_wait": 10.0, "since": NOW - 8 * SEC}, Outcome(refusal(3.0)),
     TimeOut("api", 11.0, 10.0)),
])
def test_a_plan_s_end_is_a_start_an_end_or_a_wait_out_of_the_process(
        case: str, facts: dict[str, object], outcome: Outcome, expected: object) -> None:
    assert admission.settled(known(**facts), outcome) == expected, case


def test_a_task_that_could_not_join_its_line_counts_down_with_nothing_booked() -> None:
    # The store failed as it joined: its booking was given back, so it comes back to when
    # a start is within reach, as if the room were closed.
    facts = known(in_line=True, horizon=0.5)
    assert admission.unlined(facts, refusal(5.0)) == CountDown(4.5, "api", 5.0)


# --- a copy's arrival ----------------------------------------------------------------

@pytest.mark.parametrize(("case", "call", "expected"), [
    ("a fresh task: goes on", lambda: admission.arrived(""), None),
    ("a second copy of one entry dispatched from the line: dropped",
     lambda: admission.arrived("c", first=False), Drop("second copy")),
    ("... even one whose max_wait passed in line (the first copy says so)",
     lambda: admission.arrived("t", first=False), Drop("second copy")),
    ("its max_wait passed in line: timed out",
     lambda: admission.arrived("t", limit="api", waited=12.0, max_wait=10.0),
     TimeOut("api", 12.0, 10.0)),
    ("served for its turn: goes on to take it", lambda: admission.arrived("c"), None),
    ("on time for its turn (woken early counts as on time)",
     lambda: admission.turn(-0.01, 0.25), Start(late=0.0)),
    ("late for its turn within the grace: starts, late by that much",
     lambda: admission.turn(0.2, 0.25), Start(late=0.2)),
    ("a late copy, past the grace: its turn is lost, it asks again",
     lambda: admission.turn(0.3, 0.25), None),
])
def test_an_arrival_goes_on_or_ends(case: str, call: object, expected: object) -> None:
    assert call() == expected, case  # type: ignore[operator]


@pytest.mark.parametrize(("pointer", "expected"), [
    ("go", None),
    ("ended", Drop("ended")),
    ("stale", Drop("stale")),
    ("running", Drop("running")),
    ("late", Drop("stale")),  # (a second "late": the first one asks the gate again)
])
def test_the_copy_pointer_s_verdict(pointer: str, expected: object) -> None:
    assert admission.verdict(pointer) == expected


# --- the store down, at any step --------------------------------------------------------

@pytest.mark.parametrize(("policy", "deferrals", "expected"), [
    ("allow", 0, Start(held=False)),
    ("fail", 0, StoreFailed()),
    ("defer", 0, WaitForStore(1.0)),
    ("defer", 3, WaitForStore(8.0)),
    ("defer", 5, WaitForStore(30.0)),  # 32 s, capped
    ("defer", 40, WaitForStore(30.0)),
])
def test_the_store_down_is_the_policy_s_call(policy: str, deferrals: int,
                                             expected: object) -> None:
    assert admission.store_down(policy, deferrals, jitter=1.0) == expected


def test_the_store_down_backoff_is_jittered_down_to_half() -> None:
    assert admission.store_down("defer", 3, jitter=0.5) == WaitForStore(4.0)


# --- the numbers the decision is made with ------------------------------------------

@pytest.mark.parametrize(("case", "args", "expected"), [
    ("the horizon as set", (3600.0, None, None, None), 3600.0),
    ("no start past its expiry", (3600.0, 20.0, None, None), 20.0),
    ("an expired task books nothing", (3600.0, -5.0, None, None), 0.0),
    ("no start past its max_wait", (3600.0, None, 30.0, None), 30.0),
    ("in line: only a start the line would hand out now", (3600.0, 20.0, 30.0, 0.5), 0.5),
])
def test_how_far_ahead_a_start_is_booked(case: str, args: tuple[float, float | None,
                                                                float | None, float | None],
                                         expected: float) -> None:
    assert admission.booking_horizon(*args) == expected, case


@pytest.mark.parametrize(("case", "limits", "booked", "configured", "expected"), [
    ("half a start's length", [RATE], 1, None, 0.25),
    ("capped for a slow limit", [Limit("slow", parse_rate("1/m"))], 1, None, 0.25),
    ("a floor at a high rate", [FAST], 1, None, 0.02),
    ("the limits it is booked in decide", [FAST, RATE], 1, None, 0.02),
    ("booked in none: every rate limit", [FAST, RATE], 0, None, 0.25),
    ("seats have no start length", [SEATS], 0, None, 0.02),
    ("throttle_claim_grace overrides", [RATE], 1, 0.1, 0.1),
])
def test_how_late_a_booked_start_may_be_taken(case: str, limits: list[Limit], booked: int,
                                              configured: float | None,
                                              expected: float) -> None:
    assert admission.grace(limits, booked, configured) == pytest.approx(expected), case


def test_the_decision_s_module_imports_nothing_of_celery_or_redis() -> None:
    source = Path(admission.__file__).read_text()
    imported = {node.module or "" for node in ast.walk(ast.parse(source))
                if isinstance(node, ast.ImportFrom)}
    imported |= {alias.name for node in ast.walk(ast.parse(source))
                 if isinstance(node, ast.Import) for alias in node.names}
    assert not {name for name in imported
                if name.split(".")[0] in ("celery", "kombu", "redis")}, imported
