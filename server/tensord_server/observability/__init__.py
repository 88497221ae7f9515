"""Observability for ``tensord serve``: Prometheus metrics, a live pool dashboard, structured logs.

Everything here reads the TensorStore from outside, at the moment it is asked: the
Prometheus collector reads the pools and tables at scrape time, the rpc layer reports
each finished call (:meth:`Observer.finished`), and the dashboard serves JSON snapshots of the
pools to a page shipped in ``static/`` (no asset comes from the internet).
The hooks into the rest of the server are two: ``rpc.calls`` reports to
:func:`observer_for`'s Observer and ``tools/serve.py`` starts :class:`HttpEndpoints` (its flags are
in ``tools/serve_observability.py``).  The package is a layer of its own, between the domain
and the gRPC service: it reads the domain and the pools, never the service.
"""

from tensord_server.observability.dashboard import HttpEndpoints, dashboard_state
from tensord_server.observability.logs import configure_logging
from tensord_server.observability.metrics import Observer, observer_for

__all__ = [
    "HttpEndpoints",
    "Observer",
    "configure_logging",
    "dashboard_state",
    "observer_for",
]
