"""The tensor ops, one family per module, all built on one :class:`~.context.OpContext`.

Every tensor op reads as: hold the input handles' Storages (:meth:`OpContext.using`) ->
layout math (the shared layout engine) -> bound the work (:meth:`OpContext.check_elements`)
-> allocate an output Storage if the op copies (:meth:`OpContext.allocated`) -> run a
kernel -> issue a handle (:meth:`OpContext.issue`).

==================  =================================================================
``context.py``      what every op shares: hold, bound, allocate, issue; ``Issued``
``views.py``        view ops (no bytes move): view, narrow, index, split, as_strided...
``copies.py``       clone, contiguous, reshape, to, repeat, cat, stack
``writes.py``       in-place writes: copy, fill, setitem
``factories.py``    empty, full, arange
``indexing.py``     advanced indexing: x[tensor], x[mask], x[idx] = v, index_put_
``resizing.py``     resize_, set_ (a handle re-pointed in place, a Storage grown)
``transfers.py``    upload and download of raw bytes
``batch.py``        a pipelined Batch: queued views, writes and releases, in order
``tiering.py``      tier hints: prefetch spilled Storages, pin a Storage to its device
==================  =================================================================

The :class:`~tensord_server.domain.store.TensorStore` makes one object of each family
over its state; the gRPC handlers call the family an RPC belongs to.
"""
