"""The shared vocabulary of every role: wire schemas, the error vocabulary and view rules.

No I/O and no framework beyond pydantic. The server, the publisher and the clients all
depend on this package, and it depends on nothing else of ours.
"""
