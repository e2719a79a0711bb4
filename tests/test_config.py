"""The settings (config.py): defaults, and a clear error naming every bad or unknown one."""

from __future__ import annotations

import pytest
from celery import Celery

import celery_throttle
from celery_throttle import ThrottleConfigError
from celery_throttle.config import read_config


@pytest.mark.parametrize(
    ("setting", "value", "message"),
    [
        ("throttle_queues", {"llm": "bogus"}, r"throttle_queues\['llm'\]: invalid rate 'bogus'"),
        ("throttle_queues", {"llm": {"rate": "1/s", "brust": 2}}, r"throttle_queues\['llm'\]"),
        ("throttle_queues", ["llm"], "expected a dict"),
        ("throttle_on_error", "ignore", "throttle_on_error='ignore'"),
        ("throttle_max_wait", "10", "throttle_max_wait='10'"),
        ("throttle_prefix", "{x}", "throttle_prefix"),
        ("throttle_redis_url", "amqp://guest@localhost//", "redis://, rediss:// or unix://"),
        ("throttle_queus", {}, "unknown setting 'throttle_queus'; did you mean 'throttle_queues'"),
    ],
)
def test_bad_settings_fail_at_install(
    app: Celery, setting: str, value: object, message: str
) -> None:
    """install() raises ThrottleConfigError naming the bad or unknown setting."""
    app.conf[setting] = value
    with pytest.raises(ThrottleConfigError, match=message):
        celery_throttle.install(app)



def test_config_defaults(app: Celery) -> None:
    """Defaults: broker URL as store, 'defer', half the visibility timeout as max countdown."""
    app.conf.broker_transport_options = {"visibility_timeout": 600}
    config = read_config(app)
    assert config.redis_url == app.conf.broker_url
    assert config.on_error == "defer"
    assert config.max_countdown == 300.0
    assert "redis://" not in repr(config)  # the URL (and any password) stays out of reprs
