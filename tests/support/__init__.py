"""Helpers that start real servers (board, SeaweedFS, Valkey) on loopback for the tests."""
