"""The wire schema: every message of ``proto/tensord/v1/tensord.proto``, under a public name.

protoc writes them to ``tensord._proto`` (``scripts/gen_proto.py``); this module is the
name both sides import them by::

    from tensord import schema as pb

    pb.TensorMeta(handle="...")

Pure: the messages need protobuf only, not gRPC (the service's stub is the SDK wire's
concern, :mod:`tensord.wire.connection`).
"""

from tensord._proto.tensord.v1.tensord_pb2 import *  # noqa: F403  (every message of the schema)
from tensord._proto.tensord.v1.tensord_pb2 import DESCRIPTOR as DESCRIPTOR
