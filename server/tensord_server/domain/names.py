"""Named tensors: a tenant's tensors kept under names, beyond any session.

``put(name)`` keeps what a handle names under ``name`` until ``delete(name)`` (or the
server's shutdown), whatever the session that put it does; any session of the same tenant
gets a handle on it by name.  Names are per tenant: another tenant's name is NOT_FOUND, as
if it did not exist, and ``--max-names-per-tenant`` bounds how many one tenant keeps.
A listing goes a page at a time, sorted (:mod:`tensord_server.domain.paging`).

``put_many``, ``get_many`` and ``delete_many`` do many names under one acquisition of the
table's lock, all or nothing: the first item that fails leaves every name as it was and
raises that item's error, its text prefixed ``item N ('name'): `` (:func:`item_error`).

In a cluster (:meth:`TensorNames.join`) a name is unique per tenant across every node:
``put`` claims it in the cluster's :class:`~tensord_server.domain.directory.NameDirectory`
first, ``get`` and ``delete`` of a name another node holds raise OwnedElsewhereError
naming it, and the listing is the cluster's.  The tensor stays on the node that put it.
A batch's claims are one round trip each: a claim refused takes back the claims made
before it, but an ``overwrite`` that took a name from another node is not given back,
and a delete that cannot reach the cluster halfway leaves the names before it deleted.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import NamedTuple

from tensord.errors import (
    AlreadyExistsError,
    InvalidArgumentError,
    NodeLostError,
    NotFoundError,
    OwnedElsewhereError,
    ResourceExhaustedError,
    TensordError,
)

from tensord_server.domain import paging
from tensord_server.domain.directory import NameDirectory
from tensord_server.domain.ops.context import Issued
from tensord_server.domain.sessions import Session, SessionManager
from tensord_server.domain.storage import StorageRegistry, TensorRef
from tensord_server.pool import CountingLock

# The listing's kind in its page tokens.
NAMES_LISTING = "names"


class NameItem(NamedTuple):
    """One item of a batched put: the name, the handle it names, whether it may replace;
    or, with ``ref``, the tensor it names (one the caller made and holds, no handle)."""

    name: str
    handle: str
    overwrite: bool
    ref: TensorRef | None = None


def item_error(index: int, name: str, exc: Exception) -> Exception:
    """``exc`` as the error of item ``index`` of a batch: the same class (so the same status
    code and type) and the same facts, its text prefixed ``item N ('name'): ``."""
    text = f"item {index} ({name!r}): {exc}"
    if isinstance(exc, TensordError):
        facts = {f: getattr(exc, f, None) for f in exc.detail_fields}
        return type(exc)(text, **facts)
    try:
        return type(exc)(text)
    except Exception:  # a class that takes other arguments: its kind, as a bad argument
        return InvalidArgumentError(text)


def _check_name(name: str) -> None:
    if not name:
        raise ValueError("a tensor name must not be empty")


class TenantNames:
    """One tenant's named tensors.  Guarded by the TensorNames lock."""

    __slots__ = ("order", "refs")

    def __init__(self) -> None:
        self.refs: dict[str, TensorRef] = {}  # name -> the tensor it keeps alive
        # the same names, sorted (code points: UTF-8's byte order): a page is a bisect away
        self.order: list[str] = []

    def add(self, name: str, ref: TensorRef) -> None:
        if name not in self.refs:
            bisect.insort(self.order, name)
        self.refs[name] = ref

    def pop(self, name: str) -> TensorRef | None:
        ref = self.refs.pop(name, None)
        if ref is not None:
            del self.order[bisect.bisect_left(self.order, name)]
        return ref


class TensorNames:
    """Every tenant's named tensors.  Thread-safe.

    Invariants (under ``_lock``): each name holds one reference on its tensor's Storage;
    a tenant without names has no entry; a tenant's ``order`` is its ``refs``' keys,
    sorted.  Lock order: this lock, then a session's lock (a put looks its handle up)."""

    def __init__(
        self,
        sessions: SessionManager,
        storages: StorageRegistry,
        page_tokens: paging.PageTokens,
        *,
        max_names: int | None = None,
    ) -> None:
        self.sessions = sessions
        self.storages = storages
        self.page_tokens = page_tokens
        self.max_names = max_names  # named tensors per tenant (None: no limit)
        # counts its waiters, as the session table's lock: the background compactor steps
        # aside while a request waits here
        self._lock = CountingLock()
        self._names: dict[str, TenantNames] = {}  # tenant -> its names
        # in a cluster: the directory, and the revision of this node's claim of each name
        # it holds ((tenant, name) -> revision; a change heard of later than it wins)
        self.directory: NameDirectory | None = None
        self._claims: dict[tuple[str, str], int] = {}

    def join(self, directory: NameDirectory) -> None:
        """Share the namespace with a cluster's other nodes from now on (before serving)."""
        self.directory = directory
        directory.on_name_lost(self.forget)

    def put(self, session: Session, name: str, handle: str, overwrite: bool) -> None:
        """Keep ``handle``'s tensor under ``name`` for the session's tenant."""
        _check_name(name)
        old = None
        with self._lock:
            ref = self.sessions.reference(session, handle)  # the name's own reference
            refusal = self._refusal(session.tenant, name, overwrite)
            if refusal is None and self.directory is None:
                old = self._names.setdefault(session.tenant, TenantNames()).refs.get(name)
                self._names[session.tenant].add(name, ref)
        if refusal is None and self.directory is not None:
            # the claim is a round trip to the cluster: made outside the lock, it is the
            # cluster's create-if-absent that settles two puts of one name
            try:
                revision = self.directory.claim(session.tenant, name, overwrite)
            except Exception as exc:
                refusal = exc
            else:
                with self._lock:
                    old = self._names.setdefault(session.tenant, TenantNames()).refs.get(name)
                    self._names[session.tenant].add(name, ref)
                    key = (session.tenant, name)
                    self._claims[key] = max(revision, self._claims.get(key, 0))
        if refusal is not None:
            self.storages.decref(ref.storage)
            raise refusal
        if old is not None:
            self.storages.decref(old.storage)

    def put_many(
        self, session: Session, items: Sequence[NameItem], *, itemized: bool = True
    ) -> None:
        """:meth:`put` of every item, all or none (an item that fails: item_error; its own
        error when not ``itemized``, one item's put).  A name may appear once."""
        tenant = session.tenant
        refs: list[TensorRef] = []
        try:
            with self._lock:
                self._check_puts(session, items, refs, itemized)
                if self.directory is None:
                    olds = self._add_all(tenant, items, refs)
            if self.directory is not None:
                revisions = self._claim_all(tenant, items, itemized)
                with self._lock:
                    olds = self._add_all(tenant, items, refs)
                    for item, revision in zip(items, revisions, strict=True):
                        key = (tenant, item.name)
                        self._claims[key] = max(revision, self._claims.get(key, 0))
        except BaseException:
            for ref in refs:
                self.storages.decref(ref.storage)
            raise
        for old in olds:
            self.storages.decref(old.storage)

    def _check_puts(
        self, session: Session, items: Sequence[NameItem], refs: list[TensorRef], itemized: bool
    ) -> None:
        """(under the lock) Each item's checks in order, its name's reference appended to
        ``refs``: the first that fails raises its item_error."""
        seen: set[str] = set()
        names = self._names.get(session.tenant)
        added = 0
        for index, item in enumerate(items):
            try:
                _check_name(item.name)
                if item.name in seen:
                    raise InvalidArgumentError(f"name {item.name!r} appears twice in one request")
                seen.add(item.name)
                if item.ref is not None:
                    self.storages.incref(item.ref.storage)
                    refs.append(item.ref)
                else:
                    refs.append(self.sessions.reference(session, item.handle))
                refusal = self._refusal(session.tenant, item.name, item.overwrite, added)
                if refusal is not None:
                    raise refusal
                added += names is None or item.name not in names.refs
            except Exception as exc:
                if not itemized:
                    raise
                raise item_error(index, item.name, exc) from None

    def _add_all(
        self, tenant: str, items: Sequence[NameItem], refs: Sequence[TensorRef]
    ) -> list[TensorRef]:
        """(under the lock) Name every item's reference; the references they replaced."""
        if not items:
            return []  # (a tenant without names keeps no entry)
        names = self._names.setdefault(tenant, TenantNames())
        olds = []
        for item, ref in zip(items, refs, strict=True):
            old = names.refs.get(item.name)
            if old is not None:
                olds.append(old)
            names.add(item.name, ref)
        return olds

    def _claim_all(self, tenant: str, items: Sequence[NameItem], itemized: bool) -> list[int]:
        """Claim every item's name in the cluster, in order; a claim refused takes back the
        claims made before it (:meth:`NameDirectory.release` of each) and raises its
        item_error."""
        assert self.directory is not None
        revisions: list[int] = []
        for index, item in enumerate(items):
            try:
                revisions.append(self.directory.claim(tenant, item.name, item.overwrite))
            except Exception as exc:
                for made, revision in zip(items, revisions, strict=False):
                    try:
                        self.directory.release(tenant, made.name, revision)
                    except Exception:  # the cluster's watch settles what stays
                        break
                if not itemized:
                    raise
                raise item_error(index, item.name, exc) from None
        return revisions

    def _refusal(self, tenant: str, name: str, overwrite: bool, added: int = 0) -> Exception | None:
        """Why this node refuses to put ``name`` (None: it does not), ``added`` new names of
        the same request before it.  Under the lock."""
        names = self._names.get(tenant)
        old = names.refs.get(name) if names is not None else None
        held = (len(names.refs) if names is not None else 0) + added
        if old is not None and not overwrite:
            return AlreadyExistsError(f"name {name!r} already exists (pass overwrite=True)")
        if old is None and self.max_names is not None and held >= self.max_names:
            return ResourceExhaustedError(
                f"this tenant has {held} named tensors, the limit "
                f"(--max-names-per-tenant {self.max_names}); delete some first"
            )
        return None

    def _elsewhere(self, tenant: str, name: str) -> Exception:
        """The error for a name this node does not hold: where it is, if the cluster has it."""
        owner = self.directory.owner(tenant, name) if self.directory is not None else None
        if owner is None and self.directory is not None:
            lost = self.directory.lost_owner(tenant, name)
            if lost is not None:
                return NodeLostError(
                    f"the tensor named {name!r} was on node {lost.node!r} ({lost.address}), "
                    "which left the cluster (it stopped, or its lease lapsed): the tensor went with it",
                    node=lost.node,
                    address=lost.address,
                )
        if owner is None or self.directory is None or owner.node == self.directory.node:
            return NotFoundError(f"no tensor named {name!r}")
        return OwnedElsewhereError(
            f"the tensor named {name!r} is on node {owner.node!r} ({owner.address})",
            node=owner.node,
            address=owner.address,
        )

    def forget(self, tenant: str, name: str | None, revision: int | None) -> None:
        """Drop a name this node no longer owns in the cluster, unless its own claim is
        newer than ``revision``; ``name`` None: every name (the membership lapsed)."""
        with self._lock:
            if name is None:
                refs = [ref for names in self._names.values() for ref in names.refs.values()]
                self._names.clear()
                self._claims.clear()
            else:
                claim = self._claims.get((tenant, name))
                names = self._names.get(tenant)
                if claim is None or names is None or (revision is not None and claim >= revision):
                    return
                del self._claims[(tenant, name)]
                ref = names.pop(name)
                if not names.refs:
                    del self._names[tenant]
                refs = [ref] if ref is not None else []
        for ref in refs:
            self.storages.decref(ref.storage)

    def get(self, session: Session, name: str) -> Issued:
        """A new handle in ``session`` on the tensor named ``name`` in its tenant."""
        with self._lock:
            names = self._names.get(session.tenant)
            ref = names.refs.get(name) if names is not None else None
            if ref is not None:
                self.storages.incref(ref.storage)  # a hold for register()
        if ref is None:
            raise self._elsewhere(session.tenant, name)
        try:
            return Issued(self.sessions.register(session, ref), ref)
        finally:
            self.storages.decref(ref.storage)

    def get_many(self, session: Session, names: Sequence[str]) -> list[Issued]:
        """:meth:`get` of every name, all or none: new handles in ``session``, in order."""
        refs: list[TensorRef] = []
        missing = None
        with self._lock:
            table = self._names.get(session.tenant)
            for index, name in enumerate(names):
                ref = table.refs.get(name) if table is not None else None
                if ref is None:
                    missing = index
                    break
                refs.append(ref)
            else:
                for ref in refs:
                    self.storages.incref(ref.storage)  # holds for register_all()
        if missing is not None:
            name = names[missing]
            raise item_error(missing, name, self._elsewhere(session.tenant, name))
        try:
            handles = self.sessions.register_all(session, refs)
        finally:
            for ref in refs:
                self.storages.decref(ref.storage)
        return [Issued(h, r) for h, r in zip(handles, refs, strict=True)]

    def delete_many(self, names: Sequence[str], tenant: str = "") -> None:
        """:meth:`delete` of every name, all or none (a name may appear once)."""
        with self._lock:
            table = self._names.get(tenant)
            failed: tuple[int, Exception | None] | None = None
            seen: set[str] = set()
            for index, name in enumerate(names):
                if name in seen:
                    failed = (
                        index,
                        InvalidArgumentError(f"name {name!r} appears twice in one request"),
                    )
                    break
                seen.add(name)
                held = (
                    (tenant, name) in self._claims
                    if self.directory is not None
                    else table is not None and name in table.refs
                )
                if not held:
                    failed = (index, None)
                    break
            revisions = [self._claims.get((tenant, n), 0) for n in names]
        if failed is not None:
            index, error = failed
            raise item_error(index, names[index], error or self._elsewhere(tenant, names[index]))
        if self.directory is not None:
            for index, (name, revision) in enumerate(zip(names, revisions, strict=True)):
                try:  # the cluster's records go first: one that cannot stays whole here
                    self.directory.release(tenant, name, revision)
                except Exception as exc:
                    raise item_error(index, name, exc) from None
        refs = []
        with self._lock:
            table = self._names.get(tenant)
            for name in names:
                ref = table.pop(name) if table is not None else None
                self._claims.pop((tenant, name), None)
                if ref is not None:
                    refs.append(ref)
            if table is not None and not table.refs:
                del self._names[tenant]
        for ref in refs:
            self.storages.decref(ref.storage)

    def delete(self, name: str, tenant: str = "") -> None:
        if self.directory is not None:
            with self._lock:
                revision = self._claims.get((tenant, name))
            if revision is None:
                raise self._elsewhere(tenant, name)
            # the cluster's record goes first: if it cannot, the name stays whole
            self.directory.release(tenant, name, revision)
        with self._lock:
            names = self._names.get(tenant)
            ref = names.pop(name) if names is not None else None
            if names is not None and not names.refs:
                del self._names[tenant]
            self._claims.pop((tenant, name), None)
        if ref is None and self.directory is None:
            raise NotFoundError(f"no tensor named {name!r}")
        if ref is None:
            return  # the cluster's own record of the delete reached the table first
        self.storages.decref(ref.storage)

    def of(self, tenant: str = "") -> list[str]:
        """All of a tenant's names, sorted (in-process callers; the wire pages them)."""
        with self._lock:
            names = self._names.get(tenant)
            return list(names.order) if names is not None else []

    def page(self, tenant: str, page_size: int, page_token: str) -> tuple[list[str], str]:
        """A page of the tenant's names, sorted, and the next page's token ("" after the
        last): at most ``page_size`` names (paging's rules) and paging.MAX_PAGE_BYTES of
        answer.  The token is the last name returned: the next page starts after it."""
        limit = paging.page_size(page_size)
        place = self.page_tokens.open(NAMES_LISTING, (tenant,), page_token)
        after = None if place is None else place.decode()
        budget = paging.MAX_PAGE_BYTES - paging.PAGE_FRAMING_BYTES
        names, more = self._page(tenant, after, limit, budget)
        if not more:
            return names, ""
        return names, self.page_tokens.issue(NAMES_LISTING, (tenant,), names[-1].encode())

    def _page(
        self, tenant: str, after: str | None, limit: int, max_bytes: int
    ) -> tuple[list[str], bool]:
        """A tenant's names sorted after ``after`` (None: from the first), at most ``limit``
        of them and at most ``max_bytes`` of UTF-8 plus paging.ITEM_FRAMING_BYTES each (at
        least one name however long: one fits any page); and whether more follow.
        In a cluster: the cluster's names."""
        if self.directory is not None:
            listed, more = self.directory.names(tenant, after, limit)
            fitting = _fitting(listed, max_bytes)
            return fitting, more or len(fitting) < len(listed)
        with self._lock:
            names = self._names.get(tenant)
            order = names.order if names is not None else []
            start = 0 if after is None else bisect.bisect_right(order, after)
            page: list[str] = []
            used = 0
            for name in order[start : start + limit]:
                used += len(name.encode()) + paging.ITEM_FRAMING_BYTES
                if used > max_bytes and page:
                    break
                page.append(name)
            return page, start + len(page) < len(order)

    @property
    def lock_waiters(self) -> int:
        """Threads blocked on the lock now (the background compactor steps aside)."""
        return self._lock.waiting

    def close(self) -> None:
        """Release every name (server shutdown, after every session ended)."""
        with self._lock:
            refs = [ref for names in self._names.values() for ref in names.refs.values()]
            self._names.clear()
            self._claims.clear()
        for ref in refs:
            self.storages.decref(ref.storage)


def _fitting(names: list[str], max_bytes: int) -> list[str]:
    """The first of ``names`` whose UTF-8 plus paging.ITEM_FRAMING_BYTES each fit in
    ``max_bytes`` (at least one)."""
    used = 0
    for count, name in enumerate(names):
        used += len(name.encode()) + paging.ITEM_FRAMING_BYTES
        if used > max_bytes and count:
            return names[:count]
    return names
