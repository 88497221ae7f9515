"""The thin gRPC layer: decode a request, call the domain, encode the result.

- :mod:`.handlers`: one handler per RPC of ``tensord.v1.Tensord`` (``TensordService``)
- :mod:`.calls`: how a call travels on the asyncio server (authenticate, read, queue fairly,
  work on a thread, answer); :mod:`.executor`: the worker threads shared fairly
- :mod:`.codec`: wire messages <-> domain values (decode and bound requests, encode results)
- :mod:`.other_services`: health and reflection under the rules of Tensord's own calls
- :mod:`.status`: domain errors -> status codes and the error-type trailer (one table)
- :mod:`.grpc_server`: ``create_server``: the gRPC server with health, reflection and TLS
- :mod:`.fd_socket`: the same-host socket beside it: segment descriptors, call channels
- :mod:`.tls`: server credentials from PEM files
- :mod:`.binding`: why the listening address cannot be bound (in use, not this host's)
"""
