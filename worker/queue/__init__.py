"""The queue side: the Redis streams a worker reads requests from and writes outputs to.

Intake (reading as there is room, recovery, fencing), the table of held requests, the
publisher of each step's outputs, cancels, totals, the Lua scripts and the retry policy
for Redis. It talks to the engine only through `worker.messages`.
"""
