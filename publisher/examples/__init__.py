"""Runnable examples of the publisher in training loops."""
