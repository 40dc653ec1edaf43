"""Logits adjusted on the host before a pick, and the log-probabilities of what was picked.

A request that asks for penalties, a logit bias or log-probabilities has each step's logits row
brought to the host (a GPU runner downloads it: 4 bytes a vocabulary entry, about 0.6 MB for a
152K vocabulary) and adjusted there, in this order:
- the repetition penalty, over the tokens of the prompt and of the reply so far (as vLLM and
  llama.cpp define it: a positive logit is divided by it, a negative one multiplied);
- OpenAI's frequency and presence penalties, over the reply's tokens: the logit loses
  frequency x (times the token was picked) + presence x (1 if it was picked at all);
- logit_bias, added to the named tokens' logits;
then the grammar's mask and the sampler (strata.engine.sampler.pick_host) pick from that row.
Requests with none of these pick on the device as before.

Log-probabilities are those of the model's own distribution: the log-softmax of the raw logits,
before penalties, bias, mask, temperature and truncation (vLLM's default, and what a caller
measuring the model wants). Each entry names the picked token's and the k likeliest tokens' values,
ties in id order. Prompt log-probabilities (a completion's echo) come from the logits of every
prompt position, read in chunks of at most PROMPT_LOGITS_BYTES of logits so that the rows never
need more memory than that on either side of the bus.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..config import SamplingParams
from ..errors import InvalidArgument

PROMPT_LOGITS_BYTES = 128 << 20     # a prompt-logprobs chunk's float32 logits [rows, V] at most (entries(): 3x)


@dataclass(frozen=True)
class TokenLogprob:
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()     # (token, logprob) of the k likeliest, likeliest first


def log_softmax(rows: np.ndarray) -> np.ndarray:
    """float64 log-softmax over the last axis; a row of -inf or NaN everywhere gives -inf everywhere
    (the reference entries() is checked against; entries() itself never forms the whole row)."""
    z = np.asarray(rows, np.float64)
    z = np.where(np.isnan(z), -np.inf, z)
    m = np.max(z, axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    with np.errstate(divide="ignore", under="ignore", invalid="ignore"):
        lse = m + np.log(np.sum(np.exp(z - m), axis=-1, keepdims=True))
        return np.where(np.isfinite(lse), z - lse, -np.inf)


def _top_ids(x: np.ndarray, k: int) -> list[list[int]]:
    """Each row's k largest ids of x [T, V] (no NaN), largest first, ties in id order: k argmax passes
    over a copy, each taking the lowest id of the largest value left and setting it to -inf (exact,
    and for the k <= 20 a request asks far cheaper than partitioning a 152K row). A row that runs
    into -inf values (an id could come twice) is sorted whole instead."""
    T, V = x.shape
    k = max(0, min(k, V))
    if k == 0:
        return [[] for _ in range(T)]
    y, rows = x.copy(), np.arange(T)
    picks = np.empty((T, k), np.int64)
    for i in range(k):
        picks[:, i] = y.argmax(axis=-1)
        y[rows, picks[:, i]] = -np.inf
    out = picks.tolist()
    for r in np.flatnonzero(np.isneginf(x[rows[:, None], picks]).any(axis=-1)):
        ids = np.arange(V)
        out[r] = [int(t) for t in np.lexsort((ids, -x[r]))[:k]]
    return out


def entries(rows: np.ndarray, tokens, k: int) -> list[TokenLogprob]:
    """TokenLogprob of tokens[i] under rows[i] (raw logits [T, V]), with its k likeliest rivals: the
    log-softmax's values taken where they are needed (max, one float32 exp pass summed in float64,
    and the picked and top values less the log-sum), a few passes over each row."""
    x = np.atleast_2d(np.asarray(rows, np.float32))
    if np.isnan(x).any():
        x = np.where(np.isnan(x), np.float32(-np.inf), x)
    m = x.max(axis=-1)
    shift = np.where(np.isfinite(m), m, np.float32(0.0)).astype(np.float32)
    with np.errstate(divide="ignore", under="ignore", invalid="ignore"):
        total = np.exp(x - shift[:, None]).sum(axis=-1, dtype=np.float64)
        lse = shift.astype(np.float64) + np.log(total)

        def value(r: int, t: int) -> float:
            v = float(x[r, t]) - lse[r]
            return v if np.isfinite(lse[r]) and np.isfinite(v) else -np.inf
    tokens = np.asarray(tokens, np.int64).reshape(-1)
    tops = _top_ids(x, k)
    return [TokenLogprob(int(t), value(r, int(t)), tuple((i, value(r, i)) for i in tops[r]))
            for r, t in enumerate(tokens)]


class HostLogits:
    """One request's host-side adjustment (module doc): adjust(row) before each pick, picked(token)
    after it; `entries` holds a TokenLogprob per pick when the request asked for log-probabilities."""

    def __init__(self, params: SamplingParams, prompt_ids, vocab_size: int):
        self.params, self.V = params, vocab_size
        self.counts = np.zeros(vocab_size, np.int32)           # picks of each token in the reply
        self.seen = None
        if params.repetition_penalty != 1.0:
            self.seen = np.zeros(vocab_size, bool)
            self.seen[np.asarray(prompt_ids, np.int64)] = True
        ids = np.asarray([t for t, _ in params.logit_bias], np.int64)
        bad = ids[(ids < 0) | (ids >= vocab_size)]
        if bad.size:
            raise InvalidArgument(f"logit_bias: token id {int(bad[0])} is outside the vocabulary "
                                  f"(0..{vocab_size - 1})")
        self.bias_ids, self.bias = ids, np.asarray([b for _, b in params.logit_bias], np.float32)
        self.entries: list[TokenLogprob] = []
        self._raw: np.ndarray | None = None

    def adjust(self, row: np.ndarray) -> np.ndarray:
        """The logits row [V] the pick reads (a new array); the raw row is kept for picked()."""
        p = self.params
        raw = np.asarray(row, np.float32).reshape(-1)
        if raw.shape[0] != self.V:
            raise InvalidArgument(f"HostLogits: a logits row of {raw.shape[0]} entries for a vocabulary of {self.V}")
        self._raw = raw if p.logprobs is not None else None
        x = raw.copy()
        if self.seen is not None:
            s = x[self.seen]
            x[self.seen] = np.where(s > 0, s / np.float32(p.repetition_penalty), s * np.float32(p.repetition_penalty))
        if p.frequency_penalty or p.presence_penalty:
            x -= (np.float32(p.frequency_penalty) * self.counts
                  + np.float32(p.presence_penalty) * (self.counts > 0)).astype(np.float32)
        if self.bias_ids.size:
            np.add.at(x, self.bias_ids, self.bias)
        return x

    def picked(self, token: int) -> TokenLogprob | None:
        """Count the pick; -> its TokenLogprob (also appended to entries) when log-probabilities were asked."""
        self.counts[token] += 1
        if self.seen is not None:
            self.seen[token] = True
        if self._raw is None:
            return None
        entry = entries(self._raw[None], [token], self.params.logprobs)[0]
        self._raw = None
        self.entries.append(entry)
        return entry


def prompt_logprobs_steps(runner, ids: list[int], k: int, pause=None):
    """The TokenLogprob of each prompt token under the logits of the position before it (None for the
    first token, which nothing predicts), through runner.logits_chunks in chunks of at most
    PROMPT_LOGITS_BYTES of logits: a generator returning that list, which yields `pause` between
    chunks where the runner `interleaves` (other slots may step meanwhile; the caller use()s this slot again
    before the next). The runner's slot is left reset (nothing cached)."""
    V = runner.args.vocab_size
    rows = max(1, min(runner.prefill_chunk, PROMPT_LOGITS_BYTES // (4 * V)))
    out: list[TokenLogprob | None] = [None]
    pauses = getattr(runner, "interleaves", False)
    for lo, logits in runner.logits_chunks(ids, rows):
        hi = min(lo + logits.shape[0], len(ids) - 1)       # the last position predicts no prompt token
        if hi > lo:
            out += entries(logits[:hi - lo], ids[lo + 1:hi + 1], k)
        if pauses and lo + logits.shape[0] < len(ids):
            yield pause
    runner.reset()
    return out
