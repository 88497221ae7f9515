"""The thin gRPC layer: decode a request, call the domain, encode the result.

- :mod:`.service`: one handler per RPC of ``tensord.v1.Tensord``
- :mod:`.status`: domain errors -> status codes and the error-type trailer (one table)
- :mod:`.server`: ``create_server``: the gRPC server with health, reflection and TLS
- :mod:`.tls`: server credentials from PEM files
"""
