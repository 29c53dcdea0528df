"""The engine: one thread that owns MLX. Its cores (generation, pooling) step a backend's
batch, schedule what runs, and turn tokens into output events. It talks to the queue side
only through `worker.messages`."""
