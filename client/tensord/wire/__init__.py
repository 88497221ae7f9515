"""The SDK's wire: everything that knows about gRPC and the protobuf messages.

Not API: the rest of the SDK deals in plain values and :mod:`tensord.errors` only, and
reaches the server through :class:`tensord.wire.connection.Connection`.
"""
