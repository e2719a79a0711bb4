"""Each example runs end to end on the embedded Redis and reports success."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("example", ["examples.llm_quota", "examples.external_api",
                                     "examples.web_api"])
def test_example_runs(example: str, redis_url: str) -> None:
    """`python -m <example>` exits 0: its own checks (no 429, limits kept) passed."""
    env = {**os.environ, "REDIS_URL": redis_url, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", example], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=180, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def test_docker_compose_names_real_commands() -> None:
    """docker-compose.yml: the services exist, 2 worker replicas, every module it runs exists."""
    import re

    import yaml

    spec = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = spec["services"]
    assert set(services) == {"redis", "provider", "worker", "producer"}
    assert services["worker"]["deploy"]["replicas"] == 2
    assert services["redis"]["image"].startswith("redis:")
    env = services["worker"]["environment"]
    assert env["DEMO_REDIS"] == "redis://redis:6379"
    assert env["DEMO_PROVIDER"] == "http://provider:8080"
    modules = []
    for name in ("provider", "worker", "producer"):
        command = " ".join(services[name]["command"])
        modules += re.findall(r"python -m ([\w.]+)", command)
        modules += re.findall(r"celery -A ([\w.]+)", command)
    assert sorted(modules) == ["examples.demo", "examples.demo.app", "examples.provider"]
    for module in modules:
        path = ROOT / module.replace(".", "/")
        assert path.with_suffix(".py").exists() or (path / "__main__.py").exists(), module
    assert "--external" in " ".join(services["producer"]["command"])


def test_remote_provider_reads_a_real_provider() -> None:
    """RemoteProvider (the compose producer's view) sees what the HTTP server counted."""
    import json
    import urllib.error
    import urllib.request

    from examples.provider import MockProvider, RemoteProvider

    provider = MockProvider(limit=2, window=60, latency=0).start()
    try:
        remote = RemoteProvider(provider.url)
        def call() -> int:
            request = urllib.request.Request(f"{provider.url}/v1/summarize",
                                             data=json.dumps({"prompt": "hi"}).encode())
            with urllib.request.urlopen(request, timeout=5) as response:
                return int(response.status)

        assert [call(), call()] == [200, 200]
        with pytest.raises(urllib.error.HTTPError) as refused:
            call()
        assert refused.value.code == 429
        assert refused.value.headers["Retry-After"] == "60"
        refused.value.close()
        stats = remote.stats()
        assert (len(stats["accepted"]), len(stats["refused"])) == (2, 1)
        remote.reset()
        assert remote.stats()["accepted"] == []
    finally:
        provider.stop()
