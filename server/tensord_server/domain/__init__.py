"""The domain: tensors over Storages, sessions, tenants and their quotas; knows nothing of gRPC.

- :mod:`.store`: :class:`~tensord_server.domain.store.TensorStore`, the object that owns the
  devices, the storage registry and the sessions; its tensor ops delegate to one module per
  family: :mod:`.views`, :mod:`.copies`, :mod:`.writes`, :mod:`.factories`, :mod:`.transfers`,
  :mod:`.sharing`, :mod:`.stats`, all built on :mod:`.ops` (hold, bound, allocate, issue)
- :mod:`.storage`: Storage, TensorRef and the registry (refcounts, hold counts, relocation)
- :mod:`.sessions`: sessions, handles, names, share tokens, leases
- :mod:`.kernels`: torch's rules for copies, fills and factories, over device arrays
- :mod:`.limits`: the documented bounds on every request
- :mod:`.paging`: listings a page at a time (page sizes, the byte cap, page tokens)
- :mod:`.quotas`, :mod:`.auth`: tenants, their tokens and their per-device quotas
- :mod:`.admission`: worker and stream accounting (the call gate; its gRPC side is
  :mod:`tensord_server.rpc.admission`)
- :mod:`.exports`: same-host zero-copy exports of Storages
"""
