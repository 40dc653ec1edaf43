"""Results of a generation."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class Delta:
    text: str          # may be "" while a multi-byte character is incomplete
    token_id: int
    logprob: Any = None     # the token's strata.engine.logits.TokenLogprob, where the request asked
    prompt_logprobs: Any = None     # on a reply's first delta: Completion.prompt_logprobs, where asked


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def to_dict(self) -> dict:
        return {**asdict(self), "total_tokens": self.total_tokens}


@dataclass
class Timings:
    prompt_n: int = 0          # prompt tokens read (not reused)
    cache_n: int = 0           # prompt tokens reused from the prefix cache
    predicted_n: int = 0
    prompt_ms: float = 0.0
    predicted_ms: float = 0.0
    draft_n: int = 0
    draft_n_accepted: int = 0
    draft_room: bool = False   # the prompt lent the draft layer's experts to its ring (--mtp-room-min)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["prompt_per_second"] = self.prompt_n / (self.prompt_ms / 1e3) if self.prompt_ms > 0 else 0.0
        d["predicted_per_second"] = self.predicted_n / (self.predicted_ms / 1e3) if self.predicted_ms > 0 else 0.0
        return d


@dataclass
class Completion:
    text: str
    token_ids: list[int]
    finish_reason: str         # "stop" | "length" | "cancelled"
    usage: Usage = field(default_factory=Usage)
    timings: Timings = field(default_factory=Timings)
    logprobs: list | None = None          # a TokenLogprob per token of token_ids (SamplingParams.logprobs)
    prompt_logprobs: list | None = None   # one per prompt token, None first (SamplingParams.prompt_logprobs)
