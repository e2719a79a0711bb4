"""Celery's revoke command, heard by the app's listeners after Celery's own handling."""

from __future__ import annotations

from celery import Celery
from celery.utils.collections import AttributeDict
from celery.worker import state as worker_state
from celery.worker.control import Panel

from celery_throttle.integration import revokes


def _app() -> Celery:
    return Celery("t", broker="memory://", backend="cache+memory://", set_as_current=False)


def test_a_revoke_command_reaches_the_apps_listeners_after_celerys_own() -> None:
    app, other = _app(), _app()
    heard: list[list[str]] = []
    elsewhere: list[list[str]] = []
    revokes.listen(app, heard.append)
    revokes.listen(other, elsewhere.append)
    revokes.listen(app, heard.append)  # (wrapped once, whatever the listeners)
    command = Panel.data["revoke"]
    try:
        reply = command(AttributeDict(app=app, hostname="n1", consumer=None),
                        task_id=["r-1", "r-2"])
        assert "flagged as revoked" in reply["ok"]  # Celery's own reply
        assert "r-1" in worker_state.revoked
        assert "r-2" in worker_state.revoked
        assert [sorted(ids) for ids in heard] == [["r-1", "r-2"], ["r-1", "r-2"]]
        assert elsewhere == []  # another app's node
        command(AttributeDict(app=app, hostname="n1", consumer=None), task_id="r-3")
        assert heard[-1] == ["r-3"]
    finally:
        revokes.unlisten(app, heard.append)
        revokes.unlisten(app, heard.append)
        revokes.unlisten(other, elsewhere.append)
        worker_state.revoked.clear()
    command(AttributeDict(app=app, hostname="n1", consumer=None), task_id="r-4")
    assert heard[-1] == ["r-3"]  # no listener left
    worker_state.revoked.clear()


def test_a_failing_listener_leaves_the_revoke_done() -> None:
    app = _app()

    def broken(ids: list[str]) -> None:
        raise RuntimeError("store down")

    revokes.listen(app, broken)
    try:
        reply = Panel.data["revoke"](AttributeDict(app=app, hostname="n1", consumer=None),
                                     task_id=["r-5"])
        assert "flagged as revoked" in reply["ok"]
        assert "r-5" in worker_state.revoked
    finally:
        revokes.unlisten(app, broken)
        worker_state.revoked.clear()
