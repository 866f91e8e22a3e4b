"""OpenAI-compatible request bodies and response payloads of the reference engine.

Requests accept (and ignore) fields the engine does not implement, as OpenAI-compatible
servers do, but refuse values it cannot honour (n > 1, an empty prompt) with a 400. Every
choice also carries `token_ids` and `prompt_token_ids` (as vLLM returns them) so that
RL callers get the exact tokens without re-tokenizing.

A completion's body (a stream's last event) says which weights made it:
`"weight_version": {"start": 7, "end": 8, "spans": [[0, 7], [12, 8]]}`, tokens 0-11 from
version 7 and from token 12 on from version 8 (one choice: `n` is 1). The spans are
exact: each `TokenStep` records the version of the forward pass that produced it, and
weights change only between two forward passes. A sidecar keeps them (see
`services.sidecar.stamping`), so an RL trainer can mask or reweight off-policy tokens.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from deltaboard.services.engine.runtime import SamplingParams, TokenStep
from deltaboard.services.engine.textcodec import TextCodec

MAX_TOKENS_LIMIT = 4096


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS_LIMIT)
    temperature: float = Field(default=1.0, ge=0.0, le=100.0)
    seed: int | None = None
    stream: bool = False
    n: Literal[1] = 1


class CompletionRequest(_Request):
    prompt: str | list[int] = Field(min_length=1)
    logprobs: int | None = Field(default=None, ge=0, le=20)

    def sampling(self) -> SamplingParams:
        return SamplingParams(self.max_tokens or 16, self.temperature, self.seed, self.logprobs or 0)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: str
    content: str


class ChatRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS_LIMIT)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)

    def sampling(self) -> SamplingParams:
        limit = self.max_completion_tokens or self.max_tokens or 16
        return SamplingParams(limit, self.temperature, self.seed, self.top_logprobs or 0)


@dataclass
class Completion:
    """Accumulates generated tokens into OpenAI payloads, streamed chunk by chunk or whole."""

    kind: Literal["text", "chat"]
    model_name: str
    codec: TextCodec
    prompt_ids: list[int]
    want_logprobs: bool
    id: str = field(default_factory=lambda: f"cmpl-{uuid.uuid4().hex[:24]}")
    created: int = field(default_factory=lambda: int(time.time()))
    steps: list[TokenStep] = field(default_factory=list)

    @property
    def object_name(self) -> str:
        return "text_completion" if self.kind == "text" else "chat.completion"

    def version_range(self) -> dict[str, Any]:
        """The versions that made this completion's tokens: the range, and its spans
        `[[first token index, version], ...]`, one per change of version (a reload or an
        in-place update between two tokens), exact since every step records its own."""
        spans: list[list[int | None]] = []
        for index, step in enumerate(self.steps):
            if not spans or spans[-1][1] != step.version:
                spans.append([index, step.version])
        return {
            "start": spans[0][1] if spans else None,
            "end": spans[-1][1] if spans else None,
            "spans": spans,
        }

    def _text(self, steps: list[TokenStep]) -> str:
        return self.codec.decode([s.token_id for s in steps])

    def _logprobs(self, steps: list[TokenStep], offset: int) -> dict[str, Any] | None:
        if not self.want_logprobs:
            return None
        decode = self.codec.decode
        if self.kind == "chat":
            return {
                "content": [
                    {
                        "token": decode([s.token_id]),
                        "logprob": s.logprob,
                        "bytes": list(decode([s.token_id]).encode("utf-8")),
                        "top_logprobs": [{"token": decode([t]), "logprob": lp} for t, lp in s.top],
                    }
                    for s in steps
                ]
            }
        offsets, position = [], offset
        for s in steps:
            offsets.append(position)
            position += len(decode([s.token_id]))
        return {
            "tokens": [decode([s.token_id]) for s in steps],
            "token_logprobs": [s.logprob for s in steps],
            "top_logprobs": [{decode([t]): lp for t, lp in s.top} for s in steps],
            "text_offset": offsets,
        }

    def _choice(self, steps: list[TokenStep], offset: int, finish: str | None, delta: bool) -> dict[str, Any]:
        text = self._text(steps)
        choice: dict[str, Any] = {"index": 0, "token_ids": [s.token_id for s in steps]}
        if self.kind == "text":
            choice["text"] = text
        elif delta:
            choice["delta"] = {"role": "assistant", "content": text}
        else:
            choice["message"] = {"role": "assistant", "content": text}
        choice["logprobs"] = self._logprobs(steps, offset)
        choice["finish_reason"] = finish
        if not delta or offset == 0:
            choice["prompt_token_ids"] = self.prompt_ids
        return choice

    def _usage(self) -> dict[str, int]:
        n_prompt, n_out = len(self.prompt_ids), len(self.steps)
        return {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out}

    def chunk(self, step: TokenStep) -> dict[str, Any]:
        """The streamed event for one new token; the last one also carries usage and versions."""
        offset = len(self._text(self.steps))
        self.steps.append(step)
        body: dict[str, Any] = {
            "id": self.id,
            "object": f"{self.object_name}.chunk" if self.kind == "chat" else self.object_name,
            "created": self.created,
            "model": self.model_name,
            "choices": [self._choice([step], offset, step.finish_reason, delta=True)],
        }
        if step.finish_reason is not None:
            body["usage"] = self._usage()
            body["weight_version"] = self.version_range()
        return body

    def final(self) -> dict[str, Any]:
        finish = self.steps[-1].finish_reason if self.steps else "length"
        return {
            "id": self.id,
            "object": self.object_name,
            "created": self.created,
            "model": self.model_name,
            "choices": [self._choice(self.steps, 0, finish, delta=False)],
            "usage": self._usage(),
            "weight_version": self.version_range(),
        }
