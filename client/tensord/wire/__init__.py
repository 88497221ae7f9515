"""The SDK's wire: everything that speaks gRPC, and the one builder of every request.

Not API.  The layers above it hand it plain values and get back :mod:`tensord.errors`
exceptions; none of them names a protobuf message.

  config      the address, token, TLS and call deadline: argument, else environment
  address     how gRPC dials an address; the socket probe and the "start a server" hint
  status      failed calls and Batch answers -> tensord's exceptions (the error registry)
  fork        the fork gate, and the live connections a fork waits for
  worker      the threads that run the main thread's gRPC calls (interrupt safety)
  streams     raw-byte chunks, and the watchdog of stalled transfers
  pipeline    a queued op (QueuedOp), the Batch sizes, cutting a queue into Batches
  channel     the session's call channel: its unary calls over the server's fd socket
  requests    every request message, built from plain values
  batches     Pipeline: the queued ops, the Batch in flight, the releases, their flusher
  connection  Connection: the channel, the session, the calls; it sends the pipeline's Batches
"""
