"""Device memory: the backends that hand out raw bytes, and the table of configured devices.

Knows nothing of tensors, sessions or gRPC; sits on the pool (each device owns one
:class:`~tensord_server.pool.CachingPool` over its backend).

- :mod:`.memory`: the backend protocol, host and bookkeeping backends
- :mod:`.shm`: host memory in shared memfd segments (same-host zero copy)
- :mod:`.cuda`: CuPy device memory, page-locked ("pinned") host memory, GPU copies
- :mod:`.host_copies`: torch's host copy rules and the gather plan, NumPy only (both device
  types build on them)
- :mod:`.array_dispatch`: one array-ops object per device type (host/NumPy, CUDA/CuPy) and
  which of them applies to an array
- :mod:`.table`: device specs (``cpu=4GiB``), the device table, the one ``gpu_count()``
"""
