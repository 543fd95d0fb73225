"""The client wing: a worker's connection to the servers.

Sockets, request ids, the exchange loop with its retries and recovery, and
the remote backend that turns store calls into wire operations.
Arrows: client -> wire; the store imports the client, never the reverse.
"""
