"""CLI command groups, one module per role; each exposes `register(app, bench)`."""
