"""Refusal log lines are budgeted per tenant: no client sets the log's volume."""

from __future__ import annotations

import logging
import time

import grpc
import pytest
from conftest import SessionStub, start_server
from tensord import schema as pb
from tensord_server.observability.log_budget import LogBudget
from tensord_server.observability.metrics import observer_for


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_burst_goes_out_then_the_rate_and_the_next_line_says_what_was_left_out() -> None:
    clock = FakeClock()
    budget = LogBudget(burst=3, per_s=2.0, clock=clock)
    assert [budget.take("a") for _ in range(5)] == [0, 0, 0, None, None]
    clock.now += 0.25  # half a line's worth: still nothing
    assert budget.take("a") is None
    clock.now += 0.25
    assert budget.take("a") == 3  # the three lines left out since the last one
    assert budget.take("a") is None
    clock.now += 10.0  # refills to the burst, no further
    assert [budget.take("a") for _ in range(4)] == [1, 0, 0, None]
    clock.now -= 5.0  # a clock stepping back credits nothing, then or after
    assert budget.take("a") is None
    clock.now += 5.4  # less than a line's worth past the latest time seen
    assert budget.take("a") is None


def test_each_key_has_its_own_budget() -> None:
    clock = FakeClock()
    budget = LogBudget(burst=1, per_s=1.0, clock=clock)
    assert budget.take("flood") == 0 and budget.take("flood") is None
    assert budget.take("quiet") == 0
    assert budget.take(None) == 0  # unauthenticated callers share one key


def test_a_budget_needs_a_burst_and_a_rate() -> None:
    for burst, per_s in ((0, 1.0), (1, 0.0), (1, -1.0)):
        with pytest.raises(ValueError, match="burst >= 1 and per_s > 0"):
            LogBudget(burst=burst, per_s=per_s)


def refusal_records(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [
        r
        for r in caplog.records
        if r.name == "tensord.events" and r.fields.get("event") in ("oom", "refused")  # type: ignore[attr-defined]
    ]


def test_one_tenants_flood_of_refusals_is_budgeted_and_anothers_refusal_still_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """400 refused requests from one tenant in well under a second: at most the burst and
    a second's rate are logged, the next line after a pause counts the rest (so every
    refusal is accounted for), and another tenant's refusal meanwhile is logged."""
    running = start_server(
        devices=("cpu=8MiB",), auth_tokens={"flood-token": "flood", "quiet-token": "quiet"}
    )
    huge = pb.EmptyRequest(shape=[1 << 40], dtype="float32", device="cpu")
    sent = 0
    try:
        with (
            caplog.at_level(logging.INFO, logger="tensord.events"),
            grpc.insecure_channel(running.address) as channel,
        ):
            flood = SessionStub(channel, "flood", token="flood-token")
            quiet = SessionStub(channel, "quiet", token="quiet-token")
            started = time.monotonic()
            for _ in range(400):
                with pytest.raises(grpc.RpcError):
                    flood.Empty(huge, metadata=flood.md, timeout=10)
                sent += 1
            flooded_for = time.monotonic() - started
            with pytest.raises(grpc.RpcError):
                quiet.Empty(huge, metadata=quiet.md, timeout=10)
            time.sleep(0.3)  # three lines' worth of budget again
            with pytest.raises(grpc.RpcError):
                flood.Empty(huge, metadata=flood.md, timeout=10)
            sent += 1
            flood.close()
            quiet.close()
        left_out_metric = observer_for(running.daemon).registry.get_sample_value(
            "tensord_refusal_log_lines_left_out_total", {"tenant": "flood"}
        )
    finally:
        running.stop()
    records = refusal_records(caplog)
    flooded = [r for r in records if r.fields["tenant"] == "flood"]  # type: ignore[attr-defined]
    assert [r.fields["tenant"] for r in records].count("quiet") == 1  # type: ignore[attr-defined]
    most = LogBudget().burst + LogBudget().per_s * (flooded_for + 0.3) + 1
    assert len(flooded) <= most < sent, (len(flooded), flooded_for)
    # every refusal is a line or counted in a later line's left_out (the last flood call,
    # after the pause, is logged: nothing is pending), and in the metric
    counts = [r.fields.get("left_out", 0) for r in flooded]  # type: ignore[attr-defined]
    assert len(flooded) + sum(counts) == sent
    assert left_out_metric == sum(counts)
    saying = [r for r, count in zip(flooded, counts, strict=True) if count]
    assert saying and all("more refusals of this tenant" in r.getMessage() for r in saying)
