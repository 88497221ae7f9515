"""Reaching a tensor across sessions: share tokens (share, revoke, attach) and names (get_name,
list_names).

The rules (tenants, uses, ttl) are the session manager's; this family turns its
answers into issued handles, and its names into pages (domain/paging.py).
"""

from __future__ import annotations

from tensord_server.domain import paging
from tensord_server.domain.ops.context import Issued
from tensord_server.domain.sessions import Session, SessionManager

# The listing's kind in its page tokens.
NAMES_LISTING = "names"


class Sharing:
    """Share tokens and names over one :class:`SessionManager`."""

    def __init__(self, sessions: SessionManager, tokens: paging.PageTokens) -> None:
        self.sessions = sessions
        self.tokens = tokens

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

    def list_names(self, tenant: str, page_size: int, page_token: str) -> tuple[list[str], str]:
        """A page of the tenant's names, sorted, and the next page's token ("" after the
        last): at most ``page_size`` names (paging's rules) and paging.MAX_PAGE_BYTES of
        answer.  The token is the last name returned: the next page starts after it."""
        limit = paging.page_size(page_size)
        place = self.tokens.open(NAMES_LISTING, (tenant,), page_token)
        after = None if place is None else place.decode()
        budget = paging.MAX_PAGE_BYTES - paging.PAGE_FRAMING_BYTES
        names, more = self.sessions.names_page(tenant, after, limit, budget)
        if not more:
            return names, ""
        return names, self.tokens.issue(NAMES_LISTING, (tenant,), names[-1].encode())
