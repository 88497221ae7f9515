"""The wire protocol's constants, shared by the SDK and the server (one definition each).

Metadata keys the two sides exchange beside the protobuf messages, the message size both
sides configure their channels for, the address a client dials by default, how the
fd socket's ticket splits, the call channel's framing, and the counts one request may
name (the server refuses more before any work; the SDK splits what it can and refuses
the rest at the call).  Pure: this module imports only the standard library's
``struct``, so both sides (and every layer) may use it.
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
#: trailing metadata of an error with machine-readable facts (tensord.errors' detail_fields):
#: one JSON object, set as attributes of the exception the SDK raises
ERROR_DETAILS_KEY = "tensord-error-details"
#: request metadata of an Upload: its serialized UploadHeader (binary, hence ``-bin``)
UPLOAD_HEADER_KEY = "tensord-upload-bin"
#: request metadata of a node-to-node call (one node of a cluster calling another): the
#: cluster's shared secret (--cluster-token-file), never a tenant's token
NODE_TOKEN_KEY = "tensord-node-token"
#: request metadata of a node-to-node call: the tenant the call acts for
NODE_TENANT_KEY = "tensord-node-tenant"
#: trailing metadata of an Upload whose header asked for a checksum: the CRC-32 of the
#: bytes as stored, in decimal
CHECKSUM_KEY = "tensord-crc32"
#: gRPC message limit, both ways: any chunk, and large ViewResponses (split into pieces)
MAX_MESSAGE_BYTES = 256 << 20
#: the most items a listing's page holds (ListNames, MemorySnapshot): the server gives no
#: more whatever page_size says, and the SDK asks for this many (bytes cap a page too)
MAX_PAGE_SIZE = 10_000

# The counts one request may name (SECURITY.md), each so that one call's Python work on
# the server stays within tensord_server.domain.limits.CALL_BUDGET_MS (limits.py states
# the cost per item).  The server refuses a request past one before any work; the SDK
# sends what it can split as several requests (a long queue, a long split, chunk or
# unbind) and refuses the rest at the call, naming the limit, before anything is queued:
# a pipelined op the server refuses would fail at a later, unrelated call.

#: dimensions of a tensor (torch's own limit is 64 too: c10's MAX_DIMS-sized containers)
MAX_DIMS = 64
#: the fields that are a list of per-dimension numbers: at most MAX_DIMS items each
DIM_FIELDS = frozenset(
    {"shape", "stride", "size", "sizes", "dims", "repeats", "source", "destination", "values"}
)
#: tensors one Cat or Stack joins
MAX_CAT_INPUTS = 2048
#: handles one Release names (also an EmptyExport's releases, a ReleaseExports' export ids,
#: and all the release ops of one Batch together)
MAX_RELEASE_HANDLES = 16384
#: tensors one view op (split, chunk, unbind) returns
MAX_VIEW_RESULTS = 2048
#: ops in one pipelined Batch
MAX_BATCH_OPS = 1024
#: tensors the view ops of one Batch return together
MAX_BATCH_RESULTS = 2048
#: items of one PutNames, GetNames or DeleteNames
MAX_NAME_ITEMS = 1024
#: items of one PutNames whose bytes are staged (each a new tensor made on the server)
MAX_STAGED_ITEMS = 256
#: items of one index (basic or advanced): each int, slice or tensor takes one of at most
#: 64 dims and each None or bool adds one of at most 64, beside one Ellipsis, so a longer
#: index is one torch refuses too
MAX_INDEX_ITEMS = 2 * 64 + 1
#: segment ids a client names as mapped (ints searched in C, never walked one by one)
MAX_MAPPED_SEGMENTS = 65536
#: the longest list any request field may hold (one without a row in LIST_LIMITS)
MAX_LIST_LEN = 65536
#: items of all the lists of one request together (a Batch nests one list per op)
MAX_REQUEST_ITEMS = 32768

#: every other repeated field of a request, by "Message.field": its limit and that limit's
#: name (a refusal names it).  A field the schema adds is bounded by MAX_LIST_LEN until it
#: has a row here (a test asserts every request list has one).
LIST_LIMITS: dict[str, tuple[int, str]] = {
    "CatRequest.handles": (MAX_CAT_INPUTS, "MAX_CAT_INPUTS"),
    "ReleaseRequest.handles": (MAX_RELEASE_HANDLES, "MAX_RELEASE_HANDLES"),
    "PrefetchRequest.handles": (MAX_RELEASE_HANDLES, "MAX_RELEASE_HANDLES"),
    "EmptyExportRequest.release_handles": (MAX_RELEASE_HANDLES, "MAX_RELEASE_HANDLES"),
    "ReleaseExportsRequest.export_ids": (MAX_RELEASE_HANDLES, "MAX_RELEASE_HANDLES"),
    "ReleaseExportsRequest.closed_imports": (MAX_RELEASE_HANDLES, "MAX_RELEASE_HANDLES"),
    "ReleaseExportsRequest.mapped_segments": (MAX_MAPPED_SEGMENTS, "MAX_MAPPED_SEGMENTS"),
    "ExportRequest.mapped_segments": (MAX_MAPPED_SEGMENTS, "MAX_MAPPED_SEGMENTS"),
    "Index.items": (MAX_INDEX_ITEMS, "MAX_INDEX_ITEMS"),
    "SetItemRequest.index": (MAX_INDEX_ITEMS, "MAX_INDEX_ITEMS"),
    "AdvancedIndexRequest.index": (MAX_INDEX_ITEMS, "MAX_INDEX_ITEMS"),
    "AdvancedSetItemRequest.index": (MAX_INDEX_ITEMS, "MAX_INDEX_ITEMS"),
    "BatchOp.results": (MAX_VIEW_RESULTS, "MAX_VIEW_RESULTS"),
    "BatchRequest.ops": (MAX_BATCH_OPS, "MAX_BATCH_OPS"),
    "PutNamesRequest.items": (MAX_NAME_ITEMS, "MAX_NAME_ITEMS"),
    "GetNamesRequest.names": (MAX_NAME_ITEMS, "MAX_NAME_ITEMS"),
    "DeleteNamesRequest.names": (MAX_NAME_ITEMS, "MAX_NAME_ITEMS"),
    "GetNameExportRequest.mapped_segments": (MAX_MAPPED_SEGMENTS, "MAX_MAPPED_SEGMENTS"),
    "GetNamesRequest.mapped_segments": (MAX_MAPPED_SEGMENTS, "MAX_MAPPED_SEGMENTS"),
}
_WIRE_LIMIT = (MAX_LIST_LEN, "MAX_LIST_LEN")


def named_list_limit(message: str, field: str) -> tuple[int, str]:
    """The most items repeated field ``field`` of message type ``message`` may hold, and
    that limit's name in this module."""
    if field in DIM_FIELDS:
        return MAX_DIMS, "MAX_DIMS"
    return LIST_LIMITS.get(f"{message}.{field}", _WIRE_LIMIT)


def list_limit(message: str, field: str) -> int:
    """The most items repeated field ``field`` of message type ``message`` may hold."""
    return named_list_limit(message, field)[0]


# A same-host fd socket's ticket is two halves: the client sends the first (the key), the
# server answers with the second (the proof) beside the descriptor. Whoever listens on a
# socket path the client was sent but is not that server (a remote server's path, squatted
# on the client's host) learns only the key and cannot answer with the proof, so the client
# never maps, reads or writes memory that is not the server's.
TICKET_KEY_CHARS = 16


def split_ticket(ticket: str) -> tuple[str, str]:
    """(key, proof): what the client sends, and what only the issuing server can answer."""
    return ticket[:TICKET_KEY_CHARS], ticket[TICKET_KEY_CHARS:]


# The call channel on the same fd socket (a session's unary calls without gRPC): a connection
# binds with a line ``CHANNEL_BIND`` + the session's key less its proof (OpenSession answers
# the key), answered ``ok IDLE_S PROOF``; then each call is a frame, CALL_HEADER (a request
# id, the call's deadline in milliseconds or 0 for none, the method's name length, the
# request's length), the method's name as the schema spells it ("View") and the request's
# bytes; each answer is ANSWER_HEADER (the request's id, the status code's value, the lengths
# of the error message, the error type, the error details and the response) then those, the
# error type and details being what the ``tensord-error-type`` and ``tensord-error-details``
# trailers carry over gRPC.  An answer with request id CHANNEL_CLOSING answers no request: the
# server closes the channel without having read one (idle, replaced, its session ended, the
# server stopping), so a request sent meanwhile was never run and may go through gRPC.
CHANNEL_BIND = b"call "
CALL_HEADER = struct.Struct("!IIBI")
ANSWER_HEADER = struct.Struct("!IBIHII")
CHANNEL_CLOSING = 0
#: the longest method name a call frame may carry
MAX_METHOD_NAME_BYTES = 64
