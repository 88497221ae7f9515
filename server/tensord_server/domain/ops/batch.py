"""A pipelined Batch: a session's queued ops, applied in the order they were issued.

The SDK queues the ops whose result it can compute itself (views, detach, in-place
writes, releases) and sends them in one Batch.  Each op runs through the same op-family
method as its unary RPC, so its cost is checked exactly as there, and the elements all of them touch are added up against one budget
(``--max-batch-elements``), each op's before it runs; a view's results then take the ids the client chose.  The first op that
fails stops the batch (the rest may depend on it: CUDA's asynchronous error model),
and the outcome names it so the client can raise it at its next call that waits.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from tensord.errors import DeadlineExceededError, InvalidArgumentError

from tensord_server.domain import limits
from tensord_server.domain.kernels import Scalar
from tensord_server.domain.ops.context import Issued
from tensord_server.domain.ops.copies import Copies
from tensord_server.domain.ops.views import REGISTRY_ONLY_VIEWS, ViewOp, Views, view_in_run
from tensord_server.domain.ops.writes import Writes
from tensord_server.domain.sessions import HandleRun, Session, SessionManager, check_chosen_id


@dataclass(frozen=True)
class QueuedView:
    handle: str
    op: ViewOp
    results: tuple[str, ...]  # the client-chosen ids, one per result


@dataclass(frozen=True)
class QueuedFill:
    handle: str
    value: Scalar


@dataclass(frozen=True)
class QueuedCopy:
    dst: str
    src: str


@dataclass(frozen=True)
class QueuedSetItem:
    handle: str
    index: tuple[Any, ...]
    value: Scalar | None
    src_handle: str | None


@dataclass(frozen=True)
class QueuedRelease:
    handles: tuple[str, ...]


@dataclass(frozen=True)
class QueuedReshape:
    """A reshape (or flatten) the client knows must copy: checked as the Reshape RPC."""

    handle: str
    shape: tuple[int, ...]
    results: tuple[str, ...]  # the client-chosen id of the copy


@dataclass(frozen=True)
class QueuedDeleteName:
    """A name's delete whose answer the client does not wait for (DeleteName's rules)."""

    name: str


@dataclass(frozen=True)
class QueuedDeleteNames:
    """Names' deletes whose answer the client does not wait for (DeleteNames' rules: all
    or none)."""

    names: tuple[str, ...]


QueuedOp = (
    QueuedView
    | QueuedFill
    | QueuedCopy
    | QueuedSetItem
    | QueuedRelease
    | QueuedReshape
    | QueuedDeleteName
    | QueuedDeleteNames
)


@dataclass(frozen=True)
class BatchOutcome:
    applied: int
    failed_index: int | None = None
    error: BaseException | None = None
    # what the applied copying ops issued, in op order (the client learns their Storages)
    copies: tuple[Issued, ...] = ()


def check_batch(ops: Sequence[QueuedOp]) -> None:
    """Bound the batch before any op runs: its length, the tensors its views return and
    the handles it releases (all ops together), and every chosen id's format."""
    limits.check_batch_ops(len(ops))
    results = released = 0
    for op in ops:
        if isinstance(op, QueuedView | QueuedReshape):
            results += len(op.results)
            for handle_id in op.results:
                check_chosen_id(handle_id)
        elif isinstance(op, QueuedRelease):
            released += len(op.handles)
    limits.check_batch_counts(results, released)


# The most ops of one run applied under one acquisition of the table and registry locks:
# a run of metadata-only ops holds them for tens of microseconds per op, so other sessions'
# calls wait at most this many ops' worth.
RUN_OPS = 64
# The most handles one run registers and releases together (a view's results, a release's
# handles): a split or a release names up to 65,536, each ~15 us under the locks, so 64 such
# ops held them for seconds; an op naming more than this runs alone, outside any run.
RUN_HANDLES = 256


class Batches:
    """Pipelined Batches over the op families their ops belong to.  Thread-safe."""

    def __init__(
        self,
        sessions: SessionManager,
        views: Views,
        copies: Copies,
        writes: Writes,
        delete_name: Callable[[str, str], None],
        delete_names: Callable[[Sequence[str], str], None],
        max_batch_elements: int | None,
    ) -> None:
        self.sessions = sessions
        # (name, tenant): the name table's delete (a table above the op families, given)
        self.delete_name = delete_name
        self.delete_names = delete_names
        self.views = views
        self.copies = copies
        self.writes = writes
        # elements the ops of one Batch may touch together (None: no budget)
        self.max_batch_elements = max_batch_elements

    def run(
        self,
        session: Session,
        ops: Sequence[QueuedOp],
        keep_going: Callable[[], bool] = lambda: True,
    ) -> BatchOutcome:
        """Apply ``ops`` in order; stop at the first failure and say which op it was.

        Views and releases (ops that touch no bytes) go in runs of up to RUN_OPS under one
        acquisition of the locks (:meth:`SessionManager.handle_run`), with each op's checks
        as its own RPC's; the other ops run one by one through their op family.
        ``keep_going`` is asked before each op or run (the service passes whether the call
        is still active): a caller that cancelled or ran out of time stops the work there,
        so a batch costs at most one op's bounded work, or one run's metadata work, after
        its caller is gone.
        """
        check_batch(ops)
        copies: list[Issued] = []
        index = 0
        # every op's element check also charges the batch's budget, before that op's work
        with limits.batch_budget(self.max_batch_elements):
            while index < len(ops):
                if not keep_going():
                    return BatchOutcome(
                        applied=index,
                        failed_index=index,
                        error=DeadlineExceededError(
                            f"the Batch's caller is gone: ops {index} and later were not applied"
                        ),
                        copies=tuple(copies),
                    )
                end = _run_end(ops, index)
                try:
                    if end > index:
                        with self.sessions.handle_run(session) as run:
                            while index < end:  # index: the failed op's, if one fails
                                _apply_in_run(run, ops[index])
                                index += 1
                        continue
                    copied = self._apply(session, ops[index])
                    if copied is not None:
                        copies.append(copied)
                    index += 1
                except Exception as exc:  # the client raises it, typed, at its next wait
                    return BatchOutcome(
                        applied=index, failed_index=index, error=exc, copies=tuple(copies)
                    )
        return BatchOutcome(applied=len(ops), copies=tuple(copies))

    def _apply(self, session: Session, op: QueuedOp) -> Issued | None:
        """Run one op; what it issued when it made a new Storage (the client learns it)."""
        if isinstance(op, QueuedReshape):
            return self._reshape(session, op)
        if isinstance(op, QueuedView):
            self._view(session, op)
        elif isinstance(op, QueuedFill):
            self.writes.fill(session, op.handle, op.value)
        elif isinstance(op, QueuedCopy):
            self.writes.copy(session, op.dst, op.src)
        elif isinstance(op, QueuedSetItem):
            self.writes.setitem(
                session, op.handle, op.index, value=op.value, src_handle=op.src_handle
            )
        elif isinstance(op, QueuedDeleteName):
            self.delete_name(op.name, session.tenant)
        elif isinstance(op, QueuedDeleteNames):
            self.delete_names(op.names, session.tenant)
        else:
            self.sessions.release(session, op.handles)
        return None

    def _reshape(self, session: Session, op: QueuedReshape) -> Issued:
        """The copy under the id the client chose (the Reshape RPC's checks and cost bounds)."""
        if len(op.results) != 1:
            raise InvalidArgumentError(
                f"a pipelined reshape makes one tensor but the batch named {len(op.results)} "
                "result handles"
            )
        issued = self.copies.reshape(session, op.handle, op.shape)
        if issued.handle == op.handle:  # never renames the input (a reshape never returns it)
            raise InvalidArgumentError("a pipelined reshape returned its input")
        try:
            self.sessions.rename(session, [issued.handle], op.results)
        except BaseException:
            # never a handle the client does not know
            self.sessions.release(session, [issued.handle])
            raise
        return Issued(op.results[0], issued.ref)

    def _view(self, session: Session, op: QueuedView) -> None:
        # a view registers the chosen ids itself (no random id drawn, then renamed)
        issued = [i.handle for i in self.views.view(session, op.handle, op.op, op.results)]
        if issued == list(op.results):
            return
        try:  # a flatten that copied: its result came back under a new id
            if len(issued) != len(op.results):
                raise InvalidArgumentError(
                    f"the view op {op.op.name} made {len(issued)} tensors but the batch named "
                    f"{len(op.results)} result handles"
                )
            self.sessions.rename(session, issued, op.results)
        except BaseException:
            self.sessions.release(session, issued)  # never a handle the client does not know
            raise


def _run_handles(op: QueuedOp) -> int | None:
    """The handles ``op`` registers or releases if it touches only the handle tables and
    reference counts (a view in a run makes exactly as many tensors as it names: checked
    before any is built); None if it does not."""
    if isinstance(op, QueuedView):
        return len(op.results) if op.op.name in REGISTRY_ONLY_VIEWS else None
    return len(op.handles) if isinstance(op, QueuedRelease) else None


def _run_end(ops: Sequence[QueuedOp], start: int) -> int:
    """The end of the run of registry-only ops from ``start`` (``start``: none there), at
    most RUN_OPS ops naming at most RUN_HANDLES handles together."""
    end, last, handles = start, min(len(ops), start + RUN_OPS), 0
    while end < last:
        named = _run_handles(ops[end])
        if named is None or handles + named > RUN_HANDLES:
            break
        handles += named
        end += 1
    return end


def _apply_in_run(run: HandleRun, op: QueuedOp) -> None:
    if isinstance(op, QueuedView):
        view_in_run(run, op.handle, op.op, op.results)
    else:
        assert isinstance(op, QueuedRelease), op
        run.release(op.handles)
