"""`chatcore chat`: a terminal client of the server's WebSocket API (docs/protocol.md). It speaks the
protocol only: nothing here imports the engine, the sessions or the server."""
