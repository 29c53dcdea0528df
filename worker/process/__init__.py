"""The two processes of a worker: the engine process's main, the I/O process's link to it,
and the channel between them."""
