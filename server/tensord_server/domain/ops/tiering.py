"""Tier hints: prefetch spilled Storages, pin a Storage to its device.

Neither moves bytes on the caller's thread but a pin's own restore: a prefetch takes a
hold on each spilled Storage (so none is freed or spilled again meanwhile) and hands it
to the spiller's restore workers, which drop it once the Storage is back.
"""

from __future__ import annotations

from collections.abc import Sequence

from tensord.errors import InvalidArgumentError, PermissionDeniedError
from tensord.protocol import MAX_RELEASE_HANDLES

from tensord_server.domain.ops.context import OpContext
from tensord_server.domain.sessions import Session
from tensord_server.domain.spiller import Spiller


class Tiering:
    """x.prefetch(), client.prefetch(tensors), x.pin_to_device(), x.unpin_from_device()."""

    def __init__(self, ops: OpContext, spiller: Spiller) -> None:
        self.ops = ops
        self.spiller = spiller

    def prefetch(self, session: Session, handles: Sequence[str]) -> int:
        """Queue a restore of each spilled Storage of ``handles``; the count queued (a hint
        past the server's queue bound is dropped: the op that needs it restores it)."""
        if len(handles) > MAX_RELEASE_HANDLES:
            raise InvalidArgumentError(
                f"a prefetch names {len(handles)} handles, more than MAX_RELEASE_HANDLES "
                f"({MAX_RELEASE_HANDLES})"
            )
        storages = self.ops.storages
        with self.ops.sessions.held(session, *handles, restore=False) as refs:
            spilled = list(
                {id(r.storage): r.storage for r in refs if not r.storage.resident}.values()
            )
            storages.hold_all(spilled)  # the restore workers' own, released by them
        return self.spiller.prefetch(spilled)

    def pin(self, session: Session, handle: str, pinned: bool) -> None:
        """Keep the handle's Storage on its device (restored first), or let it spill again."""
        with self.ops.sessions.held(session, handle, restore=pinned) as (ref,):
            if ref.storage.tenant != session.tenant:
                raise PermissionDeniedError(
                    "a Storage shared by another tenant cannot be pinned to its device"
                )
            self.ops.storages.set_pinned(ref.storage, pinned)
