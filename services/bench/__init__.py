"""Benchmarks behind `deltaboard bench ...`: each prints its figures and can write JSON."""
