"""`mlxq gateway`: an OpenAI-compatible HTTP server that is one more producer on the queue.

It holds no state of its own: each request becomes an entry on `mlxq:q:<queue>` and its
output stream is relayed back (Server-Sent Events or one JSON body). Several gateways
can serve side by side; one that dies loses only its open connections (their requests
are cancelled by nobody and finish, unread, on the workers).
"""
