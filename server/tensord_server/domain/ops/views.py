"""View ops: new tensors on the same Storage, whose layouts the shared layout engine computes.

No bytes move (but flatten of a tensor no view can express copies, as torch's
does); the cost a client controls (how many tensors, how many dims) is refused
before any view is built.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from tensord import dtypes
from tensord.layout import Layout, check_view_dtype_bits, complex_view, view_result_count

from tensord_server.domain import kernels, limits
from tensord_server.domain.ops.context import Issued, OpContext
from tensord_server.domain.ops.copies import reshape_copy
from tensord_server.domain.sessions import HandleRun, Session, check_result_count
from tensord_server.domain.storage import TensorRef


@dataclass(frozen=True, slots=True)
class ViewOp:
    """One layout-engine call: ``Layout.<name>(*args, **kwargs)`` (plus the dtype/grad ops)."""

    name: str
    args: tuple[Any, ...] = ()
    kwargs: tuple[tuple[str, Any], ...] = ()


def index_key(index: tuple[Any, ...]) -> Any:
    """x[index] as torch reads it: one item alone takes torch's single-index fast path
    (``x[1]``, not ``x[(1,)]``)."""
    return index[0] if len(index) == 1 else index


def apply_view(ref: TensorRef, op: ViewOp) -> list[TensorRef] | None:
    """The tensors a view op makes (no bytes move); None when torch would copy (flatten)."""
    layout, kwargs = ref.layout, dict(op.kwargs)
    if op.name == "view_dtype":
        check_view_dtype_bits(ref.conj, ref.neg)
        new = dtypes.dtype_from_name(op.args[0])
        old = ref.dtype
        viewed = layout.view_dtype(
            old.itemsize, new.itemsize, old_name=old.scalar_type, new_name=new.scalar_type
        )
        # view(dtype) is not differentiable: torch's result never requires grad
        return [TensorRef(ref.storage, viewed, new, False)]
    if op.name == "detach":
        return [dataclasses.replace(ref, requires_grad=False)]
    if op.name == "set_requires_grad":
        requires_grad, by_write = op.args
        if not by_write:  # a write's flag takes any dtype (torch: x.fill_(t) of an int x)
            kernels.check_requires_grad(
                ref.dtype, requires_grad, kernels.REQUIRES_GRAD_INPLACE_TEXT
            )
        return [dataclasses.replace(ref, requires_grad=bool(requires_grad))]
    if op.name == "complex_view":
        return [complex_view_of(ref, op.args[0])]
    if op.name == "expand":
        kwargs["type_name"] = ref.dtype.legacy_type
    if op.name == "as_strided":
        kwargs["storage_elements"] = ref.storage_elements
        kwargs["itemsize"] = ref.dtype.itemsize
    if op.name not in VIEW_OPS:
        raise ValueError(f"unknown view op {op.name!r}")
    result = getattr(layout, op.name)(*op.args, **kwargs)
    if result is None:
        return None
    layouts = result if isinstance(result, tuple) else (result,)
    return [ref.with_layout(lay) for lay in layouts]


def complex_view_of(ref: TensorRef, name: str) -> TensorRef:
    """x.real, x.imag, view_as_real, view_as_complex, x.conj(): the same Storage
    under the layout, dtype and lazy bits the layout engine gives; differentiable views,
    so requires_grad stays."""
    dtype = ref.dtype
    lazy = complex_view(name, ref.layout, dtype.name, dtype.scalar_type, ref.conj, ref.neg)
    new_dtype = dtypes.dtype_from_name(lazy.dtype)
    return TensorRef(ref.storage, lazy.layout, new_dtype, ref.requires_grad, lazy.conj, lazy.neg)


VIEW_OPS = frozenset(
    {
        "view",
        "narrow",
        "select",
        "__getitem__",
        "transpose",
        "t",
        "permute",
        "movedim",
        "expand",
        "squeeze",
        "unsqueeze",
        "flatten",
        "unflatten",
        "split",
        "chunk",
        "unbind",
        "diagonal",
        "as_strided",
    }
)


def flattened_shape(shape: tuple[int, ...], op: ViewOp) -> tuple[int, ...]:
    """The shape torch.flatten gives: the layout engine's flatten of a contiguous tensor
    (always a view), so the rule lives in one place."""
    flat = Layout.contiguous(shape).flatten(*op.args)
    assert flat is not None  # a contiguous tensor always flattens as a view
    return flat.shape


class Views:
    """The view ops over one :class:`OpContext`."""

    def __init__(self, ops: OpContext) -> None:
        self.ops = ops

    def view(
        self, session: Session, handle: str, op: ViewOp, chosen: Sequence[str] | None = None
    ) -> list[Issued]:
        """``chosen``: the results' ids, as a pipelined client chose them; a view
        registers them directly.  A flatten that copies ignores them (its caller renames)."""
        sessions = self.ops.sessions
        # metadata only: no kernel context, and a spilled Storage stays where it is
        with sessions.held(session, handle, restore=False) as (ref,):
            check_view_cost(ref.layout, op, lambda wanted: sessions.check_room(session, wanted))
            results = apply_view(ref, op)
            if results is None:  # flatten of a non-viewable tensor copies, as reshape does
                self.ops.storages.ensure_resident([ref.storage])
                return [reshape_copy(self.ops, session, ref, flattened_shape(ref.layout.shape, op))]
            handles = self.ops.sessions.register_all(session, results, chosen)
            return [Issued(h, r) for h, r in zip(handles, results, strict=True)]


# Views that never touch bytes, so a Batch may apply a run of them under one lock
# acquisition; flatten is not one: a tensor no view can express is copied.
REGISTRY_ONLY_VIEWS = frozenset(VIEW_OPS - {"flatten"}) | {
    "view_dtype",
    "detach",
    "set_requires_grad",
    "complex_view",
}


def view_in_run(run: HandleRun, handle: str, op: ViewOp, chosen: Sequence[str]) -> None:
    """A pipelined view in a Batch's run (``op.name`` in REGISTRY_ONLY_VIEWS): the checks
    and results of :meth:`Views.view`, its handles registered under the ids ``chosen``."""
    ref = run.lookup(handle)
    if op.name == "__getitem__" and type(op.args[0]) is int:  # x[i]: one result, a dim fewer
        results = [ref.with_layout(ref.layout[op.args[0]])]
    else:
        count = check_view_cost(ref.layout, op, run.check_room)
        if count is not None:  # refused before building them all
            check_result_count(count, chosen)
        viewed = apply_view(ref, op)
        assert viewed is not None, op  # only flatten copies, and it never runs here
        results = viewed
    run.register(results, chosen)


def check_view_cost(layout: Layout, op: ViewOp, check_room: Callable[[int], None]) -> int | None:
    """What a view op will produce, refused before any view is built: the number of
    tensors (split/chunk/unbind, against the limit and the session's room: ``check_room``)
    and the dims of an index (each None adds one; the rest is cheap and checked on issue).
    Returns that number of tensors (None: one, or an error the layout engine raises)."""
    count = view_result_count(layout, op.name, op.args)
    if count is not None:
        limits.check_view_results(count)
        check_room(count)
    if op.name == "__getitem__":
        limits.check_result_ndim(limits.index_result_ndim(layout.ndim, op.args[0]))
    return count
