"""deltaboard: clients role (see docs/contract.md)."""
