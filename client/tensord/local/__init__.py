"""The same-host data plane: the server's pool memory mapped into this process.

Not API.  On the server's host a client maps the pool's memfd segments (or imports a
GPU's through CUDA IPC) and reads and writes tensors' bytes through the mapping instead
of gRPC:

  channel     the fd socket: a segment's descriptor for a ticket
  segments    mapped segments and exports (arrays over a pinned Storage)
  cuda_ipc    GPU segments imported through CUDA IPC (CuPy arrays)
  mapper      one client's mappings, imports and exports (LocalMapper)
  host_cache  x.numpy()'s destinations, kept for reuse
  copies      large copies on several threads
  transfers   x.numpy(), x.copy_(array), x[key] = array and uploads through the mapping
"""
