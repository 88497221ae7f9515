"""The SDK keeps each request within the protocol's limits (tensord.protocol): what can be
split (a view op's many results) goes as several requests; the rest is refused at the
call, naming the limit, with nothing sent or queued: the server would refuse the request,
and a pipelined op it refuses fails at a later, unrelated call."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import tensord
import torch
from tensord import protocol
from tensord.wire import connection, pipeline


def _refused_at_the_call(client: tensord.Client, call: Callable[[], Any], limit: str) -> None:
    """``call`` raises torch's RuntimeError naming ``limit`` and its value; nothing was queued
    (the next wait raises nothing) and the client keeps working."""
    with pytest.raises(RuntimeError, match=rf"the limit is {getattr(protocol, limit)} .*{limit}"):
        call()
    client.synchronize()
    assert client.zeros(3).fill_(2).tolist() == [2.0, 2.0, 2.0]


@pytest.mark.slow
@pytest.mark.parametrize(
    "op",
    [
        lambda x, n: x.unbind(0),
        lambda x, n: x.split(1),
        lambda x, n: x.split(2),
        lambda x, n: x.chunk(n),
        lambda x, n: x.tensor_split(n),
        lambda x, n: x.tensor_split(n + 7),
        lambda x, n: x.tensor_split(n // 2 - 70),
        lambda x, n: x.hsplit(n),
    ],
    ids=["unbind", "split", "split2", "chunk", "tensor_split", "empties", "uneven", "hsplit"],
)
def test_a_view_op_returning_more_tensors_than_one_request_may_matches_torch(
    client: tensord.Client, op: Callable[[Any, int], Any]
) -> None:
    """Past protocol.MAX_VIEW_RESULTS the call goes as several requests: any count works,
    with torch's layouts."""
    n = 3 * protocol.MAX_VIEW_RESULTS + 5
    data = np.arange(n, dtype=np.float32)
    ours, theirs = op(client.tensor(data), n), op(torch.from_numpy(data), n)
    assert len(ours) == len(theirs) > protocol.MAX_VIEW_RESULTS
    for a, b in zip(ours, theirs, strict=True):
        assert (a.shape, a.stride(), a.storage_offset()) == (
            b.shape,
            b.stride(),
            b.storage_offset(),
        )
    for a, b in zip(ours[-3:], theirs[-3:], strict=True):
        assert a.tolist() == b.tolist()


@pytest.mark.slow
@pytest.mark.parametrize(
    "op",
    [lambda x: x.unbind(0), lambda x: x.split(1), lambda x: x.chunk(400000)],
    ids=["unbind", "split", "chunk"],
)
def test_a_view_op_past_the_sessions_handle_limit_fails_at_the_call(
    make_server: Any, op: Callable[[Any], Any]
) -> None:
    """Its requests are waited for: the refusal is the call's, never a later call's."""
    server = make_server(max_handles_per_session=5000)
    with tensord.connect(server.address) as client:
        wide = client.zeros(1).expand(400000)
        with pytest.raises(tensord.TensordError, match="--max-handles-per-session 5000"):
            op(wide)
        client.synchronize()
        assert client.zeros(3).fill_(2).tolist() == [2.0, 2.0, 2.0]


@pytest.mark.slow
@pytest.mark.parametrize(
    "call",
    [
        lambda c: c.zeros([1] * 65),
        lambda c: c.empty([1] * 65),
        lambda c: c.zeros(1).view([1] * 65),
        lambda c: c.zeros(1).expand([1] * 65),
        lambda c: c.zeros([1] * 64).unsqueeze(0),
        lambda c: c.zeros(2)[(None,) * 70],
        lambda c: c.zeros(2, 3).t().reshape([1] * 59 + [6] + [1] * 5),
        lambda c: c.zeros(1).repeat([1] * 65),
        lambda c: c.zeros(1).resize_([1] * 65),
    ],
    ids=["zeros", "empty", "view", "expand", "unsqueeze", "index", "reshape", "repeat", "resize_"],
)
def test_a_result_past_the_dims_limit_is_refused_at_the_call(
    client: tensord.Client, call: Callable[[tensord.Client], Any]
) -> None:
    _refused_at_the_call(client, lambda: call(client), "MAX_DIMS")


def test_cat_and_stack_read_their_input_limit_from_the_protocol(
    client: tensord.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past protocol.MAX_CAT_INPUTS, whatever it is when called (never a copy of it)."""
    parts = [client.zeros(2) for _ in range(4)]
    monkeypatch.setattr(protocol, "MAX_CAT_INPUTS", 3)
    _refused_at_the_call(client, lambda: client.cat(parts), "MAX_CAT_INPUTS")
    _refused_at_the_call(client, lambda: client.stack(parts), "MAX_CAT_INPUTS")
    assert client.cat(parts[:3]).shape == (6,)


def test_a_split_into_more_sections_than_a_split_request_lists_matches_torch(
    client: tensord.Client,
) -> None:
    sections = [1, 2] * 50  # 100 sections: more than Split.sections may list (MAX_DIMS)
    assert len(sections) > protocol.list_limit("IntList", "values")
    data = np.arange(150 * 2, dtype=np.float32).reshape(150, 2)
    expected = torch.from_numpy(data).split(sections)
    got = client.tensor(data).split(sections)
    assert len(got) == len(expected)
    for ours, theirs in zip(got, expected, strict=True):
        assert ours.shape == theirs.shape and ours.stride() == theirs.stride()
        np.testing.assert_array_equal(ours.numpy(), theirs.numpy())
    parts = client.tensor(data).tensor_split(100)
    assert [p.shape[0] for p in parts] == [
        p.shape[0] for p in torch.from_numpy(data).tensor_split(100)
    ]


def test_a_queue_past_the_batch_limit_is_sent_in_several_batches(
    fresh_server: Any,
) -> None:
    """A flush scheduler that runs late lets the queue grow past MAX_BATCH_OPS: the ops are
    still sent, in order, each Batch within the limit."""
    client = tensord.connect(fresh_server.address)
    try:
        held: list[Callable[[], None]] = []
        client.schedule_flushes(held.append)  # the queue is sent only at the wait below
        x = client.tensor(np.arange(8, dtype=np.float32))
        views = [x[i % 8] for i in range(protocol.MAX_BATCH_OPS + 500)]
        assert held  # a flush was asked for and never ran
        client.synchronize()
        assert [v.item() for v in views[-8:]] == [
            float(i % 8) for i in range(len(views) - 8, len(views))
        ]
    finally:
        client.close()


def test_release_and_batch_sizes_fit_the_protocol() -> None:
    assert protocol.list_limit("ReleaseRequest", "handles") >= connection.RELEASE_BATCH
    assert protocol.list_limit("ReleaseRequest", "handles") >= pipeline.PIPELINE_BATCH * 4
    assert pipeline.PIPELINE_BATCH_MAX < protocol.MAX_BATCH_OPS


def test_the_server_takes_its_list_limits_from_the_protocol() -> None:
    from tensord_server.domain import limits

    assert limits.MAX_DIMS is protocol.MAX_DIMS
    assert limits.MAX_LIST_LEN is protocol.MAX_LIST_LEN
    assert limits.MAX_VIEW_RESULTS is protocol.MAX_VIEW_RESULTS
