"""What one call's Python work costs on the server, per item of the counts a request names.

    python benchmarks/bench_call_costs.py            # the table
    python benchmarks/bench_call_costs.py --scale 4  # larger counts (slower, steadier)

Each call runs in this process the way a gRPC worker runs it, minus gRPC core: the request's
bytes through the service's own method handler (decode and bound, the store's work, the
reply encoded), against a TensorStore on the host.  Each case is timed at a small and a
large count; the cost per item is the difference over the difference of the counts, and the
last columns are what one call costs at the limit ``limits.py`` sets for that count (the
budget it states), and at the wire's list limit.
"""

from __future__ import annotations

import argparse
import gc
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
from tensord import protocol
from tensord import schema as pb
from tensord_server.domain import limits
from tensord_server.domain.names import NameItem
from tensord_server.domain.sessions import Session
from tensord_server.domain.store import TensorStore
from tensord_server.rpc.codec import decode_message
from tensord_server.rpc.handlers import TensordService

REPEATS = 5


class _Aborted(Exception):
    pass


class _Metadatum:
    def __init__(self, key: str, value: str) -> None:
        self.key, self.value = key, value


class _Context:
    """What a handler asks of its grpc.ServicerContext."""

    def __init__(self, session_id: str) -> None:
        self._metadata = (_Metadatum(protocol.SESSION_KEY, session_id),)
        self.code: grpc.StatusCode | None = None
        self.details = ""
        self.tenant = ""  # the rpc layer authenticates before the call (rpc.calls)

    def invocation_metadata(self) -> tuple[_Metadatum, ...]:
        return self._metadata

    def set_trailing_metadata(self, metadata: Any) -> None:
        pass

    def abort(self, code: grpc.StatusCode, details: str) -> None:
        self.code, self.details = code, details
        raise _Aborted(details)

    def is_active(self) -> bool:
        return True

    def add_callback(self, callback: Callable[[], None]) -> bool:
        return True


@dataclass
class Bench:
    store: TensorStore
    session: Session
    service: TensordService

    def call(self, method: str, request: Any) -> tuple[float, str]:
        """Seconds the handler took (the request's bytes decoded and bounded, the service's
        method, the reply encoded), and its refusal's text (empty: it answered)."""
        handler = getattr(self.service, method)
        data = request.SerializeToString()
        context = _Context(self.session.id)
        context.tenant = self.session.tenant
        gc.collect()
        start = time.perf_counter()
        try:
            reply = handler(decode_message(type(request), data), context)
            reply.SerializeToString()
        except _Aborted:
            pass
        except Exception as exc:  # the service's refusal (the rpc layer maps it to a status)
            context.details = str(exc)
        return time.perf_counter() - start, context.details

    def tensor(self, n: int) -> str:
        return self.store.factories.arange(self.session, 0, n, 1, "float32", "cpu").handle

    def handles(self, n: int) -> list[str]:
        """``n`` fresh handles on one tensor, made outside the timing."""
        ref = self.store.sessions.lookup(self.session, self.tensor(1))
        return self.store.sessions.register_all(self.session, [ref] * n)


def _ids(n: int) -> list[str]:
    return [secrets.token_urlsafe(16) for _ in range(n)]


# Each case: (method, what its count is, the limit limits.py sets for it, build(bench, n) ->
# the request).  A build runs outside the timing.
def _cat(b: Bench, n: int) -> Any:
    h = b.tensor(1)
    return "Cat", pb.CatRequest(handles=[h] * n)


def _stack(b: Bench, n: int) -> Any:
    h = b.tensor(1)
    return "Stack", pb.CatRequest(handles=[h] * n)


def _release(b: Bench, n: int) -> Any:
    return "Release", pb.ReleaseRequest(handles=b.handles(n))


def _release_unknown(b: Bench, n: int) -> Any:
    return "Release", pb.ReleaseRequest(handles=_ids(n))


def _empty_export_release(b: Bench, n: int) -> Any:
    empty = pb.EmptyRequest(shape=[1], dtype="float32", device="cpu")
    return "EmptyExport", pb.EmptyExportRequest(empty=empty, release_handles=b.handles(n))


def _release_exports(b: Bench, n: int) -> Any:
    closed = [pb.ClosedImport(segment_id=i, exports=1) for i in range(n)]
    return "ReleaseExports", pb.ReleaseExportsRequest(
        export_ids=_ids(n), mapped_segments=list(range(n)), closed_imports=closed
    )


def _unbind(b: Bench, n: int) -> Any:
    return "View", pb.ViewRequest(handle=b.tensor(n), unbind=pb.Unbind(dim=0))


def _split(b: Bench, n: int) -> Any:
    return "View", pb.ViewRequest(handle=b.tensor(n), split=pb.Split(split_size=1, dim=0))


def _index_items(b: Bench, n: int) -> Any:
    items = [pb.IndexItem(slice=pb.Slice())] * n
    return "View", pb.ViewRequest(handle=b.tensor(1), index=pb.Index(items=items))


def _setitem_items(b: Bench, n: int) -> Any:
    items = [pb.IndexItem(slice=pb.Slice())] * n
    return "SetItem", pb.SetItemRequest(
        handle=b.tensor(1), index=items, scalar=pb.Scalar(float_value=1.0)
    )


def _advanced_items(b: Bench, n: int) -> Any:
    item = pb.AdvancedIndexItem(basic=pb.IndexItem(slice=pb.Slice()))
    return "AdvancedIndex", pb.AdvancedIndexRequest(handle=b.tensor(1), index=[item] * n)


def _advanced_set_items(b: Bench, n: int) -> Any:
    item = pb.AdvancedIndexItem(basic=pb.IndexItem(slice=pb.Slice()))
    return "AdvancedSetItem", pb.AdvancedSetItemRequest(
        handle=b.tensor(1), index=[item] * n, scalar=pb.Scalar(float_value=1.0)
    )


def _batch(
    op: Callable[[Bench, str, int], pb.BatchOp], indexed: bool = True
) -> Callable[[Bench, int], Any]:
    """A Batch of ``n`` ops on one base tensor: of ``n`` elements if the ops index it, else
    of 16 (so the elements each op touches do not grow with ``n``)."""

    def build(b: Bench, n: int) -> Any:
        base = b.tensor(max(n, 1) if indexed else 16)
        return "Batch", pb.BatchRequest(ops=[op(b, base, i) for i in range(n)])

    return build


def _getitem_op(b: Bench, base: str, i: int) -> pb.BatchOp:
    index = pb.Index(items=[pb.IndexItem(integer=i)])
    return pb.BatchOp(view=pb.ViewRequest(handle=base, index=index), results=_ids(1))


def _narrow_op(b: Bench, base: str, i: int) -> pb.BatchOp:
    narrow = pb.Narrow(dim=0, start=i, length=1)
    return pb.BatchOp(view=pb.ViewRequest(handle=base, narrow=narrow), results=_ids(1))


def _fill_op(b: Bench, base: str, i: int) -> pb.BatchOp:
    return pb.BatchOp(fill=pb.FillRequest(handle=base, value=pb.Scalar(float_value=1.0)))


def _setitem_op(b: Bench, base: str, i: int) -> pb.BatchOp:
    item = pb.SetItemRequest(
        handle=base, index=[pb.IndexItem(integer=i)], scalar=pb.Scalar(float_value=1.0)
    )
    return pb.BatchOp(set_item=item)


def _copy_op(b: Bench, base: str, i: int) -> pb.BatchOp:
    return pb.BatchOp(copy=pb.CopyRequest(dst=base, src=base))


def _reshape_op(b: Bench, base: str, i: int) -> pb.BatchOp:
    return pb.BatchOp(reshape=pb.ReshapeRequest(handle=base, shape=[-1]), results=_ids(1))


def _batch_release(b: Bench, n: int) -> Any:
    return "Batch", pb.BatchRequest(
        ops=[pb.BatchOp(release=pb.ReleaseRequest(handles=b.handles(n)))]
    )


def _batch_unbind(b: Bench, n: int) -> Any:
    op = pb.BatchOp(
        view=pb.ViewRequest(handle=b.tensor(n), unbind=pb.Unbind(dim=0)), results=_ids(n)
    )
    return "Batch", pb.BatchRequest(ops=[op])


def _dims(name: str) -> Callable[[Bench, int], Any]:
    def build(b: Bench, n: int) -> Any:
        h = b.store.factories.empty(b.session, (1,) * max(n, 1), None, "float32", "cpu").handle
        if name == "Repeat":
            return "Repeat", pb.RepeatRequest(handle=h, repeats=[1] * n)
        if name == "Resize":
            return "Resize", pb.ResizeRequest(handle=h, size=[1] * n)
        if name == "Permute":
            return "View", pb.ViewRequest(handle=h, permute=pb.Permute(dims=list(range(n))))
        return "Reshape", pb.ReshapeRequest(handle=h, shape=[1] * n)

    return build


def _walk(b: Bench, n: int) -> Any:
    """A Batch that the bounds walk refuses only at its end: every op's lists walked."""
    ops = [pb.BatchOp(release=pb.ReleaseRequest(handles=_ids(16))) for _ in range(n - 1)]
    ops.append(pb.BatchOp(view=pb.ViewRequest(handle="x" * 5000, t=pb.T())))
    return "Batch", pb.BatchRequest(ops=ops)


def _named(b: Bench, n: int) -> list[str]:
    """``n`` new names of one tensor, put outside the timing."""
    handle = b.tensor(1)
    names = _ids(n)
    b.store.names.put_many(b.session, [NameItem(name, handle, False) for name in names])
    return names


def _put_names(b: Bench, n: int) -> Any:
    handle = b.tensor(1)
    items = [pb.PutNameRequest(name=name, handle=handle) for name in _ids(n)]
    return "PutNames", pb.PutNamesRequest(items=items)


def _put_names_staged(b: Bench, n: int) -> Any:
    staging = b.tensor(n)  # a float32 each
    items = [
        pb.PutNameRequest(
            name=name,
            staged=pb.StagedTensor(handle=staging, byte_offset=4 * i, shape=[1], dtype="float32"),
        )
        for i, name in enumerate(_ids(n))
    ]
    return "PutNames", pb.PutNamesRequest(items=items)


def _get_names(b: Bench, n: int) -> Any:
    return "GetNames", pb.GetNamesRequest(names=_named(b, n))


def _delete_names(b: Bench, n: int) -> Any:
    return "DeleteNames", pb.DeleteNamesRequest(names=_named(b, n))


CASES: list[tuple[str, str, str, Callable[[Bench, int], Any]]] = [
    ("PutNames", "names", "MAX_NAME_ITEMS", _put_names),
    ("PutNames staged", "names", "MAX_NAME_ITEMS", _put_names_staged),
    ("GetNames", "names", "MAX_NAME_ITEMS", _get_names),
    ("DeleteNames", "names", "MAX_NAME_ITEMS", _delete_names),
    ("Cat", "inputs", "MAX_CAT_INPUTS", _cat),
    ("Stack", "inputs", "MAX_CAT_INPUTS", _stack),
    ("Release", "handles", "MAX_RELEASE_HANDLES", _release),
    ("Release (unknown ids)", "handles", "MAX_RELEASE_HANDLES", _release_unknown),
    ("EmptyExport release_handles", "handles", "MAX_RELEASE_HANDLES", _empty_export_release),
    ("ReleaseExports (all 3 lists)", "items", "MAX_RELEASE_HANDLES", _release_exports),
    ("View unbind", "results", "MAX_VIEW_RESULTS", _unbind),
    ("View split", "results", "MAX_VIEW_RESULTS", _split),
    ("View index items", "items", "MAX_INDEX_ITEMS", _index_items),
    ("SetItem index items", "items", "MAX_INDEX_ITEMS", _setitem_items),
    ("AdvancedIndex items", "items", "MAX_INDEX_ITEMS", _advanced_items),
    ("AdvancedSetItem items", "items", "MAX_INDEX_ITEMS", _advanced_set_items),
    ("Batch of x[i] views", "ops", "MAX_BATCH_OPS", _batch(_getitem_op)),
    ("Batch of narrow views", "ops", "MAX_BATCH_OPS", _batch(_narrow_op)),
    ("Batch of fill_", "ops", "MAX_BATCH_OPS", _batch(_fill_op, indexed=False)),
    ("Batch of x[i] = v", "ops", "MAX_BATCH_OPS", _batch(_setitem_op)),
    ("Batch of copy_", "ops", "MAX_BATCH_OPS", _batch(_copy_op, indexed=False)),
    ("Batch of copying reshapes", "ops", "MAX_BATCH_OPS", _batch(_reshape_op, indexed=False)),
    ("Batch release op", "handles", "MAX_RELEASE_HANDLES", _batch_release),
    ("Batch unbind op", "results", "MAX_VIEW_RESULTS", _batch_unbind),
    ("Batch bounds walk (17 items an op)", "ops", "MAX_BATCH_OPS", _walk),
    ("Repeat", "dims", "MAX_DIMS", _dims("Repeat")),
    ("Resize", "dims", "MAX_DIMS", _dims("Resize")),
    ("Reshape", "dims", "MAX_DIMS", _dims("Reshape")),
    ("View permute", "dims", "MAX_DIMS", _dims("Permute")),
]


def _median_time(bench: Bench, build: Callable[[Bench, int], Any], n: int) -> tuple[float, str]:
    times, refusal = [], ""
    for _ in range(REPEATS):
        method, request = build(bench, n)
        seconds, refusal = bench.call(method, request)
        times.append(seconds)
    return min(times), refusal


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=int, default=1, help="multiply the large counts")
    parser.add_argument("--only", default="", help="run the cases whose name has this")
    args = parser.parse_args()
    store = TensorStore(("cpu=4GiB",), lease=3600.0)
    session, _ = store.sessions.open("bench")
    bench = Bench(store, session, TensordService(store))
    print(f"budget per call: {limits.CALL_BUDGET_MS} ms")
    print(
        f"{'call':30} {'count':8} {'us/item':>8} {'limit':>20} {'ms at limit':>11} "
        f"{'ms at 64k':>9}  refused at the large count with"
    )
    for name, what, limit_name, build in CASES:
        if args.only and args.only not in name:
            continue
        limit = getattr(limits, limit_name)
        small = 4 if what == "dims" else 16
        large = limit if what == "dims" else min(limit, 4096) * args.scale
        if large <= small:
            large = small * 4
        t_small, _ = _median_time(bench, build, small)
        t_large, refusal = _median_time(bench, build, large)
        per_item = max(t_large - t_small, 0.0) / (large - small)
        at_limit = (t_small + per_item * (limit - small)) * 1e3
        at_wire = (t_small + per_item * (limits.MAX_LIST_LEN - small)) * 1e3
        print(
            f"{name:30} {what:8} {per_item * 1e6:8.2f} {limit_name + '=' + str(limit):>20} "
            f"{at_limit:11.1f} {at_wire if what != 'dims' else float('nan'):9.0f}  "
            f"{refusal[:60]}"
        )
        # the session's handles stay bounded between cases
        store.sessions.release(session, list(session.handles))


if __name__ == "__main__":
    main()
