"""deltaboard: board role (see docs/contract.md)."""
