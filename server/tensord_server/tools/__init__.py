"""The ``tensord`` subcommands other than the library: each module has ``add_arguments`` and ``run``.

- :mod:`.serve`: ``tensord serve``, the server
- :mod:`.admin`: ``tensord stats|summary|snapshot|empty-cache`` against a running server
- :mod:`.replay`: ``tensord replay``, an allocator trace through the pool
- :mod:`.loadtest`: ``tensord loadtest``, the Locust fragmentation load test
"""
