"""Reaching a tensor across sessions: share tokens (share, revoke, attach) and names (get_name).

The rules (tenants, uses, ttl) are the session manager's; this family turns its
answers into issued handles.
"""

from __future__ import annotations

from tensord_server.domain.ops import Issued
from tensord_server.domain.sessions import Session, SessionManager


class Sharing:
    """Share tokens and names over one :class:`SessionManager`."""

    def __init__(self, sessions: SessionManager) -> None:
        self.sessions = sessions

    def share(
        self, session: Session, handle: str, uses: int | None = 1, ttl: float | None = None
    ) -> tuple[str, float]:
        """A share token (see SessionManager.share) and the ttl it got."""
        return self.sessions.share(session, handle, uses, ttl)

    def revoke(self, session: Session, token: str) -> bool:
        return self.sessions.revoke(session, token)

    def attach(self, session: Session, token: str) -> Issued:
        return Issued(*self.sessions.attach(session, token))

    def get_name(self, session: Session, name: str) -> Issued:
        return Issued(*self.sessions.get_name(session, name))
