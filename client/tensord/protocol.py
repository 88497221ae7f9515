"""The wire protocol's constants, shared by the SDK and the server (one definition each).

Metadata keys the two sides exchange beside the protobuf messages, the message size both
sides configure their channels for, the address a client dials by default, and how the
fd socket's ticket splits, the export channel's framing, and the limits on a request's
lists.  Pure: this module imports only the standard library's ``struct``, so both sides
(and every layer) may use it.
"""

from __future__ import annotations

import struct

#: the version both sides report (``tensord.__version__``, ServerInfo.version)
VERSION = "0.1.0"
#: where a client connects and a server listens when nobody says otherwise
DEFAULT_ADDRESS = "127.0.0.1:50051"
#: request metadata: ``Bearer <token>`` when the server has tenants
AUTHORIZATION_KEY = "authorization"
#: the prefix of the authorization value
BEARER = "Bearer "
#: request metadata: the session a call acts in (from OpenSession)
SESSION_KEY = "tensord-session"
#: trailing metadata of an error: the Python built-in torch raises in the same case
ERROR_TYPE_KEY = "tensord-error-type"
#: request metadata of an Upload: its serialized UploadHeader (binary, hence ``-bin``)
UPLOAD_HEADER_KEY = "tensord-upload-bin"
#: gRPC message limit, both ways: any chunk, and large ViewResponses (split into pieces)
MAX_MESSAGE_BYTES = 256 << 20
#: the most items a listing's page holds (ListNames, MemorySnapshot): the server gives no
#: more whatever page_size says, and the SDK asks for this many (bytes cap a page too)
MAX_PAGE_SIZE = 10_000

# The limits on a request's lists (SECURITY.md).  The server refuses a request past one
# before any work (tensord_server.domain.limits); the SDK refuses the call that would send
# one, naming the limit, before anything is queued: a pipelined op the server refuses
# fails at a later, unrelated call.

#: dimensions of a tensor (torch's own limit is 64 too: c10's MAX_DIMS-sized containers)
MAX_DIMS = 64
#: the fields that are a list of per-dimension numbers: at most MAX_DIMS items each
DIM_FIELDS = frozenset(
    {"shape", "stride", "size", "sizes", "dims", "repeats", "source", "destination", "values"}
)
#: items of any other repeated field (handles to release, index items)
MAX_LIST_LEN = 65536
#: tensors one cat or stack takes (CatRequest.handles)
MAX_CAT_INPUTS = MAX_LIST_LEN
#: tensors one view op (split, chunk, unbind) may return (BatchOp.results)
MAX_VIEW_RESULTS = 65536
#: items of all the lists of one request together (a Batch nests one list per op)
MAX_REQUEST_ITEMS = 1 << 20
#: ops in one pipelined Batch
MAX_BATCH_OPS = 4096
# the repeated fields whose limit is their own, by "Message.field"
_FIELD_LIMITS = {"CatRequest.handles": MAX_CAT_INPUTS, "BatchOp.results": MAX_VIEW_RESULTS}


def list_limit(message: str, field: str) -> int:
    """The most items repeated field ``field`` of message type ``message`` may hold."""
    limit = _FIELD_LIMITS.get(f"{message}.{field}")
    if limit is not None:
        return limit
    return MAX_DIMS if field in DIM_FIELDS else MAX_LIST_LEN


# A same-host fd socket's ticket is two halves: the client sends the first (the key), the
# server answers with the second (the proof) beside the descriptor. Whoever listens on a
# socket path the client was sent but is not that server (a remote server's path, squatted
# on the client's host) learns only the key and cannot answer with the proof, so the client
# never maps, reads or writes memory that is not the server's.
TICKET_KEY_CHARS = 16


def split_ticket(ticket: str) -> tuple[str, str]:
    """(key, proof): what the client sends, and what only the issuing server can answer."""
    return ticket[:TICKET_KEY_CHARS], ticket[TICKET_KEY_CHARS:]


# The export channel (issue 13) on the same fd socket: a connection binds with a line
# ``CHANNEL_BIND`` + the session's key less its proof; then each request is a frame
# (CHANNEL_FRAME_HEADER: its length, then an ExportRequest's bytes) and each answer a status
# and a length (CHANNEL_ANSWER_HEADER) then an ExportResponse's bytes (CHANNEL_OK) or a short
# reason (CHANNEL_USE_GRPC: the client asks through the Export RPC instead).
CHANNEL_BIND = b"chan "
CHANNEL_OK = 0
CHANNEL_USE_GRPC = 1
CHANNEL_FRAME_HEADER = struct.Struct("!I")
CHANNEL_ANSWER_HEADER = struct.Struct("!BI")
