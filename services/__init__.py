"""deltaboard: services role (see docs/contract.md)."""
