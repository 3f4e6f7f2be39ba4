"""Webhooks without a model (issue 46): the per-server endpoint (`--webhook-url`, the secret from the environment or a
file) gets `video.failed` when a job's life ends so, signed as the openai client verifies; a delivery that never
succeeds stops after `--webhook-attempts` and is counted; a key's endpoint URL must be public https unless its host
is allowed. The deliveries through a real server and the client's calls: tests/server/test_extend_api.py."""

from __future__ import annotations

import json
import time
import types

import pytest
from webhook_receiver import Receiver

from longserve.server.api.errors import APIError
from longserve.server.api.jobs import Job, JobRegistry
from longserve.server.api.lifecycle import JobLifecycle
from longserve.server.api.metrics import ServerMetrics
from longserve.server.api.runner import JobRunner
from longserve.server.api.webhooks import Webhooks, sign


def config(**changes):
    base = {"webhook_url": None, "webhook_secret_file": None, "webhook_allowed_hosts": None, "webhook_attempts": 3}
    return types.SimpleNamespace(**{**base, **changes})


class NoSettings:
    def list(self, kind, owner=...):
        return []


@pytest.fixture
def runner():
    r = JobRunner(JobRegistry(), io_threads=2)
    r.start_loop()
    yield r
    r.close()


def test_the_server_s_endpoint_gets_a_failed_video_signed_and_a_dead_one_is_given_up(runner, tmp_path, monkeypatch):
    from openai import OpenAI

    receiver = Receiver()
    secret_file = tmp_path / "secret"
    secret_file.write_text("whsec_" + "c2VjcmV0LXNlY3JldC1zZWNyZXQtc2VjcmV0LXNlY3I=\n")
    metrics = ServerMetrics(JobRegistry(), types.SimpleNamespace(started=False))
    try:
        hooks = Webhooks(config(webhook_url=receiver.url, webhook_secret_file=str(secret_file)), NoSettings(), runner,
                         metrics.webhooks)
        lifecycle = JobLifecycle(metrics, "tiny-latte", webhooks=hooks)
        lifecycle.failed(Job("video_x", "video", 1.0, "key-1"), "worker_crashed", "a worker died")
        [(headers, body)] = receiver.wait(1)
        event = OpenAI(api_key="unused").webhooks.unwrap(body, headers, secret=secret_file.read_text().strip())
        assert (event.type, event.data.id) == ("video.failed", "video_x")
        assert headers["webhook-signature"] == sign(secret_file.read_text().strip(), headers["webhook-id"],
                                                    int(headers["webhook-timestamp"]), body)
    finally:
        receiver.close()
    # nobody answers there any more: 3 attempts (1 s, 2 s apart), then it is counted as failed
    monkeypatch.setenv("LONGSERVE_WEBHOOK_SECRET", "plain-text-secret")
    dead = Webhooks(config(webhook_url=receiver.url), NoSettings(), runner, metrics.webhooks)
    t0 = time.monotonic()
    status = runner.spawn(dead.deliver("server", receiver.url, "s", "evt_1", b"{}", checked=True)).result(30)
    assert status is None and time.monotonic() - t0 >= 3
    text = metrics.render().decode()
    assert 'longserve_webhook_deliveries_total{outcome="delivered"} 1.0' in text
    assert 'longserve_webhook_deliveries_total{outcome="failed"} 1.0' in text
    with pytest.raises(ValueError, match="secret"):
        monkeypatch.delenv("LONGSERVE_WEBHOOK_SECRET")
        Webhooks(config(webhook_url=receiver.url), NoSettings(), runner)


def test_a_key_s_endpoint_is_public_https_unless_its_host_is_allowed(runner):
    hooks = Webhooks(config(), NoSettings(), runner)
    for url in ("http://example.com/h", "https://127.0.0.1/h", "https://10.1.2.3/h", "https://[::1]/h",
                "https://localhost/h", "https://box.internal/h", "ftp://x/h", "nonsense"):
        with pytest.raises(APIError) as e:
            hooks.check_url(url)
        assert e.value.param == "url", url
    assert hooks.check_url("https://hooks.example.com/h") == "https://hooks.example.com/h"    # no lookup here
    # a name is resolved when delivering: one that points at loopback is not delivered to (localhost: /etc/hosts)
    assert "not a public address" in hooks._private("localhost", 443)
    allowed = Webhooks(config(webhook_allowed_hosts="127.0.0.1,hooks.internal"), NoSettings(), runner)
    assert allowed.check_url("http://127.0.0.1:9/h") == "http://127.0.0.1:9/h"
    assert allowed.check_url("http://hooks.internal/h") == "http://hooks.internal/h"
    assert json.dumps(allowed.endpoints_for(None, "video.completed")) == "[]"
