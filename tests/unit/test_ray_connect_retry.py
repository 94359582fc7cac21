"""connect_ray: a Ray Client connection whose per-client server failed to start is tried
again (the head's transient fault); other failures are one clear error, at once."""
from __future__ import annotations

import pytest

ray = pytest.importorskip("ray")

from deepinfer.cluster import ray_launcher  # noqa: E402

START_FAILURE = ConnectionError("Initialization failure from server:\nTraceback ...\n"
                                "RuntimeError: Starting Ray client server failed.")


def _fake_init(monkeypatch, failures: list[Exception]) -> list[dict]:
    calls: list[dict] = []

    def init(**kwargs):
        calls.append(kwargs)
        if failures:
            raise failures.pop(0)

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", init)
    return calls


def test_a_client_server_start_failure_is_tried_again(monkeypatch):
    calls = _fake_init(monkeypatch, [START_FAILURE, START_FAILURE])
    assert ray_launcher.connect_ray("ray://head:10001") is True
    assert [c["address"] for c in calls] == ["ray://head:10001"] * 3


def test_it_gives_up_after_the_last_attempt_with_one_line(monkeypatch):
    _fake_init(monkeypatch, [START_FAILURE] * ray_launcher.RAY_CLIENT_ATTEMPTS)
    with pytest.raises(ValueError, match=r"^cannot connect to Ray at ray://head:10001: "
                                         r"Initialization failure from server: \.\.\. "
                                         r"RuntimeError: Starting Ray client server failed\.$"):
        ray_launcher.connect_ray("ray://head:10001")


@pytest.mark.parametrize("address,error", [
    ("ray://head:10001", ConnectionError("ray client connection timeout")),  # a wrong address
    ("10.0.0.1:6379", START_FAILURE),  # not Ray Client
])
def test_other_failures_are_not_retried(monkeypatch, address, error):
    calls = _fake_init(monkeypatch, [error])
    with pytest.raises(ValueError, match="cannot connect to Ray"):
        ray_launcher.connect_ray(address)
    assert len(calls) == 1
