"""The wire wing: what travels between a worker and a server, written once for both ends.

The message header and its fields, payload frames, each operation's layout,
and the CurveZMQ security of the sockets. Imports only the errors.
"""
