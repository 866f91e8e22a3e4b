"""The compaction worker: builds span patches from committed deltas and registers them
with the board (`build` for one head's spans, `worker` for the event-fed loop)."""
