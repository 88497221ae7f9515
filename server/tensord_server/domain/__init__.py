"""The domain: tensors over Storages, sessions, tenants and their quotas; knows nothing of gRPC.

- :mod:`.store`: :class:`~tensord_server.domain.store.TensorStore`, which builds the server's
  state (devices, the storage registry, sessions, exports) and the op families over it
- :mod:`.ops`: the tensor ops, one family per module (views, copies, writes, factories,
  indexing, resizing, transfers, a pipelined batch), all built on :mod:`.ops.context`
  (hold, bound, allocate, issue)
- :mod:`.storage`: Storage, TensorRef and the registry (refcounts, hold counts, relocation)
- :mod:`.sessions`: sessions, their handle tables, leases and the reaper
- :mod:`.share_tokens`: share tokens (uses, expiry, revocation; they end with their session)
- :mod:`.names`: named tensors per tenant, listed a page at a time
- :mod:`.memory_reports`: memory statistics with the server's live counts, summary, paged
  snapshot, empty_cache
- :mod:`.kernels`: torch's rules for copies, fills and factories, over device arrays
- :mod:`.limits`: the documented bounds on every request
- :mod:`.paging`: listings a page at a time (page sizes, the byte cap, page tokens)
- :mod:`.quotas`, :mod:`.auth`: tenants, their tokens and their per-device quotas
- :mod:`.call_gate`: worker and stream accounting, the saturation clock (its gRPC side:
  :mod:`tensord_server.rpc.calls`, :mod:`tensord_server.rpc.other_services`)
- :mod:`.exports`: same-host zero copy's books: exports, tickets, channel keys (the socket
  that serves them is :mod:`tensord_server.rpc.fd_socket`)
"""
