// Package tcpstore is a PyTorch-compatible TCPStore server and client: the
// rendezvous a vLLM worker performs with rank 0 (the trainer) before NCCL
// starts. It speaks the torch 2.x wire protocol (queries 0..13 of
// torch/csrc/distributed/c10d/TCPStore*.cpp), not the incompatible 1.x one.
//
// Invariants of the server:
//
//   - A connection's first request must be VALIDATE with the magic
//     0x3C85F7CE; anything else closes that connection.
//   - Requests have no frame length and are parsed incrementally; a frame may
//     arrive in any number of pieces. Length fields are checked against the
//     limits (Options) before anything is buffered, so memory per connection
//     is bounded by one field plus one read.
//   - A connection that sends garbage, an unknown query, a field over a
//     limit, or that stalls in the middle of a frame for longer than
//     Options.ReadTimeout, is closed; no other connection notices. An idle
//     connection (between frames) may stay open forever, as vLLM workers do.
//   - Every reply to a connection, including deferred WAIT replies, is queued
//     in the order the store state changed, so a CANCEL_WAIT reply (1) is
//     always preceded by any wake-up (0) it raced with, as torch clients
//     expect. Slow readers never block the store: a connection whose unsent
//     replies exceed Options.MaxPendingBytes is closed.
//   - Keys are stored exactly as sent on the wire: torch clients prefix user
//     keys with "/" ("/broadcast_from/0/0") but not the worker counter
//     "init/". Server.Set and the Client take wire keys verbatim.
//   - Missing keys read as empty values (GET, MULTI_GET), like PyTorch's
//     libuv server; torch clients always WAIT before GET anyway.
//   - Close returns only after every goroutine of the server has exited.
//
// The package never logs.
package tcpstore
