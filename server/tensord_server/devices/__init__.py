"""Device memory: the backends that hand out raw bytes, and the table of configured devices.

Knows nothing of tensors, sessions or gRPC; sits on the pool (each device owns one
:class:`~tensord_server.pool.CachingPool` over its backend).

- :mod:`.memory`: the backend protocol, host and bookkeeping backends
- :mod:`.shm`: host memory in shared memfd segments (same-host zero copy)
- :mod:`.cuda`: CuPy device memory, page-locked ("pinned") host memory, GPU copies
- :mod:`.host_arrays`: NumPy array helpers both device types share
- :mod:`.array_ops`: one array-ops object per device type (host/NumPy, CUDA/CuPy)
- :mod:`.table`: device specs (``cpu=4GiB``), the device table, the one ``gpu_count()``
"""
