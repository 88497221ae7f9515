"""The thin gRPC layer: decode a request, call the domain, encode the result.

- :mod:`.service`: one handler per RPC of ``tensord.v1.Tensord``
- :mod:`.codec`: wire messages <-> domain values (decode and bound requests, encode results)
- :mod:`.admission`: the call gate's gRPC side (cancelling idle streams, the liveness threads,
  the interceptor gating health and reflection)
- :mod:`.status`: domain errors -> status codes and the error-type trailer (one table)
- :mod:`.server`: ``create_server``: the gRPC server with health, reflection and TLS
- :mod:`.fd_socket`: the same-host socket beside it: segment descriptors, export channels
- :mod:`.tls`: server credentials from PEM files
- :mod:`.binding`: why the listening address cannot be bound (in use, not this host's)
"""
