"""Per-tenant byte quotas per device (``--quota TENANT:DEVICE=BYTES``) and the ledger enforcing them.

A tenant is charged every Storage it creates, by its size rounded up to 512 B
as the pool rounds requests (``Storage.charge``).  Not by the block that serves
it: the pool may hand out a larger block (a remainder it does not split off),
and which block that is depends on what every tenant left in the
pool, so one tenant's refusals would depend on the others.  The charge is known
before the pool is asked, and compaction moving a Storage changes nothing.
Storages never cross tenants (handles, share tokens and names are
tenant-scoped), so the creator is the only tenant that can hold them and the
charge is refunded when the Storage is freed.

``TENANT`` is a tenant of the ``--auth-tokens`` file, or ``*``: every tenant
without a quota of its own on that device (each separately, not together).
Without ``--auth-tokens`` every client is one unnamed tenant, which only ``*``
reaches.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from tensord.errors import FailedPreconditionError, ResourceExhaustedError

from tensord_server.devices.table import canonical_device, parse_bytes
from tensord_server.domain.auth import describe_tenant

# The TENANT of a quota that applies to every tenant lacking its own.
EVERY_TENANT = "*"


@dataclass(frozen=True, slots=True)
class QuotaSpec:
    """One ``--quota`` argument: at most ``limit`` bytes for ``tenant`` on ``device``."""

    tenant: str
    device: str
    limit: int

    def __post_init__(self) -> None:
        assert self.tenant and self.limit >= 0, self

    @property
    def flag(self) -> str:
        """The argument that set this quota, as an error message quotes it."""
        return f"--quota {self.tenant}:{self.device}={self.limit}"


def parse_quota(text: str) -> QuotaSpec:
    """``"alice:cuda:0=40GiB"`` -> QuotaSpec("alice", "cuda:0", 42949672960); ValueError if malformed."""
    tenant, colon, rest = text.partition(":")
    device, equals, size = rest.rpartition("=")
    if not colon or not equals or not tenant.strip() or not device.strip() or not size.strip():
        raise ValueError(
            f"invalid --quota {text!r}: expected TENANT:DEVICE=BYTES, e.g. alice:cuda:0=40GiB "
            "or *:cpu=8GiB"
        )
    try:
        name = canonical_device(device)
    except FailedPreconditionError as exc:
        raise ValueError(f"invalid --quota {text!r}: {exc}") from None
    return QuotaSpec(tenant.strip(), name, parse_bytes(size))


class QuotaTable:
    """The quotas of one server, looked up by (tenant, device).  Immutable."""

    def __init__(self, specs: Iterable[QuotaSpec] = ()) -> None:
        self._specs: dict[tuple[str, str], QuotaSpec] = {}
        for spec in specs:
            key = (spec.tenant, spec.device)
            if key in self._specs:
                raise ValueError(f"--quota {spec.tenant}:{spec.device} is given twice")
            self._specs[key] = spec

    def __iter__(self) -> Iterator[QuotaSpec]:
        return iter(self._specs.values())

    def for_tenant(self, tenant: str, device: str) -> QuotaSpec | None:
        """The tenant's own quota on ``device``, else the ``*`` one, else None (no limit)."""
        own = self._specs.get((tenant, device)) if tenant else None
        return own or self._specs.get((EVERY_TENANT, device))

    def check_against(self, devices: Iterable[str], tenants: Iterable[str] | None) -> None:
        """ValueError for a quota naming a device the server lacks or a tenant no token names.

        ``tenants`` None: no ``--auth-tokens``, so only ``*`` can apply.
        """
        have_devices, known = set(devices), None if tenants is None else set(tenants)
        for spec in self:
            if spec.device not in have_devices:
                raise ValueError(
                    f"{spec.flag}: this server does not own {spec.device} "
                    f"(it has: {', '.join(sorted(have_devices))})"
                )
            if spec.tenant == EVERY_TENANT:
                continue
            if known is None:
                raise ValueError(
                    f"{spec.flag}: without --auth-tokens every client is one unnamed tenant; "
                    f"use '*:{spec.device}=BYTES'"
                )
            if spec.tenant not in known:
                raise ValueError(f"{spec.flag}: no token in --auth-tokens names that tenant")


@dataclass(frozen=True, slots=True)
class TenantUsage:
    """What one tenant holds on one device."""

    current: int  # its live Storages' charges (sizes rounded up to 512 B)
    peak: int  # the most it held at once since the server started
    storages: int  # live Storages
    limit: int | None  # its quota (None: no limit)


class TenantLedger:
    """Bytes and Storages per (tenant, device), charged as Storages are made.  Thread-safe.

    Invariant: a tenant with a quota never holds more than its limit on that device.
    """

    def __init__(self, quotas: QuotaTable | None = None) -> None:
        self.quotas = quotas if quotas is not None else QuotaTable()
        self._lock = threading.Lock()  # guards the three dicts
        self._bytes: dict[tuple[str, str], int] = {}
        self._peak: dict[tuple[str, str], int] = {}
        self._count: dict[tuple[str, str], int] = {}

    def precheck(self, tenant: str, device: str, nbytes: int) -> None:
        """Refuse a request that cannot fit before the pool does any work for it."""
        quota = self.quotas.for_tenant(tenant, device)
        if quota is not None:
            with self._lock:
                self._refuse_over(quota, tenant, device, nbytes)

    def charge(self, tenant: str, device: str, nbytes: int) -> None:
        """Add a new Storage's charge to the tenant's bytes; ResourceExhaustedError (nothing
        charged) if over."""
        quota = self.quotas.for_tenant(tenant, device)
        key = (tenant, device)
        with self._lock:
            if quota is not None:
                self._refuse_over(quota, tenant, device, nbytes)
            held = self._bytes.get(key, 0) + nbytes
            self._bytes[key] = held
            self._count[key] = self._count.get(key, 0) + 1
            self._peak[key] = max(self._peak.get(key, 0), held)
            assert quota is None or held <= quota.limit, (key, held, quota)

    def grow(self, tenant: str, device: str, nbytes: int) -> None:
        """A live Storage's charge changes by ``nbytes`` (resize_/set_ grew it; negative:
        undone); ResourceExhaustedError (nothing charged) if over."""
        quota = self.quotas.for_tenant(tenant, device)
        key = (tenant, device)
        with self._lock:
            if quota is not None and nbytes > 0:
                self._refuse_over(quota, tenant, device, nbytes)
            held = self._bytes.get(key, 0) + nbytes
            assert held >= 0, (key, held)
            self._bytes[key] = held
            self._peak[key] = max(self._peak.get(key, 0), held)

    def refund(self, tenant: str, device: str, nbytes: int) -> None:
        key = (tenant, device)
        with self._lock:
            held = self._bytes[key] - nbytes
            self._count[key] -= 1
            assert held >= 0 and self._count[key] >= 0, (key, held)
            self._bytes[key] = held

    def usage(self, tenant: str, device: str) -> TenantUsage:
        key = (tenant, device)
        quota = self.quotas.for_tenant(tenant, device)
        with self._lock:
            return TenantUsage(
                self._bytes.get(key, 0),
                self._peak.get(key, 0),
                self._count.get(key, 0),
                None if quota is None else quota.limit,
            )

    def _refuse_over(self, quota: QuotaSpec, tenant: str, device: str, nbytes: int) -> None:
        held = self._bytes.get((tenant, device), 0)
        if held + nbytes > quota.limit:
            raise ResourceExhaustedError(
                f"quota exceeded: {describe_tenant(tenant)} holds {held} bytes on {device} and "
                f"asked for {nbytes} more, over its limit of {quota.limit} bytes ({quota.flag}); "
                "release tensors first"
            )
