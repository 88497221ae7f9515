"""tensord's Locust users, for running Locust directly from a checkout::

    pip install -e '.[loadtest]'
    tensord serve &
    locust -f loadtest/locustfile.py --headless -u 20 -t 30s --host 127.0.0.1:50051

The users, their workloads and their configuration (``TENSORD_*`` environment
variables) live in :mod:`tensord_server.tools.loadtest.locustfile`, which
``tensord loadtest`` runs too: this file only brings its user classes into the
namespace Locust searches, so there is one source.
"""

from tensord_server.tools.loadtest.locustfile import *  # noqa: F403
