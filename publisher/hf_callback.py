"""A Hugging Face `TrainerCallback` that publishes the policy as training starts and after
optimizer steps.

`on_train_begin` publishes the starting policy: the first rollouts need it, and a trainer
resumed from a checkpoint it had published holds the board's head, which the publisher
then takes as the base of its deltas (nothing is committed, no keyframe is sent).
`on_step_end` runs right after the optimizer step (and zero_grad), which is when the
weights a rollout engine should serve have just changed; the callback snapshots them
and returns to the Trainer while the version travels in the background. Only the world's
process zero publishes (under DDP every rank holds the same weights); for sharded
training use `Publisher(..., ranks=distributed.TorchDistributedRanks())` from a plain loop instead.
Failures are logged as they happen and `on_train_end` waits for the last version, so a
run's final policy is on the board when `trainer.train()` returns.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future
from typing import Any

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from deltaboard.publisher.publisher import Publisher, PublishResult

log = logging.getLogger(__name__)


class DeltaboardCallback(TrainerCallback):
    """Publish at the start and every `every` optimizer steps; keeps the last future in `last`."""

    def __init__(self, publisher: Publisher, every: int = 1, close_at_end: bool = False) -> None:
        if every < 1:
            raise ValueError("every must be at least 1")
        self.publisher = publisher
        self.every = every
        self.close_at_end = close_at_end
        self.last: Future[PublishResult] | None = None
        self.failures = 0

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._publish(state, kwargs.get("model"))

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if state.global_step % self.every == 0:
            self._publish(state, kwargs.get("model"))

    def _publish(self, state: TrainerState, model: Any) -> None:
        if model is None or not state.is_world_process_zero:
            return
        meta = {"epoch": state.epoch, "source": "transformers.Trainer"}
        self.last = self.publisher.publish(model, step=state.global_step, meta=meta)
        self.last.add_done_callback(self._report)

    def _report(self, future: Future[PublishResult]) -> None:
        exc = future.exception()
        if exc is not None:
            self.failures += 1
            log.error("deltaboard: a version was not published: %s", exc)

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if not state.is_world_process_zero:
            return
        if self.close_at_end:
            self.publisher.close()
        else:
            self.publisher.flush()
