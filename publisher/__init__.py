"""deltaboard: publisher role (see docs/contract.md)."""
