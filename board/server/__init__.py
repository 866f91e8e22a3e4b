"""The bulletin-board server: the FastAPI routes, the service layer they call, the
durable ledger over the object store, the index in front of it, and their adapters.

Only the board process imports this package; it never imports the codec (the board
stores and serves patches, it never decodes them).
"""
