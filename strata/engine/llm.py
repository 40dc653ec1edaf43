"""strata.LLM: load a model and generate from it."""
from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from ..config import EngineConfig, SamplingParams, refuse_gpu_kernel_paths
from ..errors import DeviceError, InvalidArgument, PackError, StrataError, UnsupportedError
from .logits import HostLogits, prompt_logprobs_steps
from .sampler import Sampler
from .scheduler import PROMPT_CHUNK, PROMPT_READY, Request, Scheduler
from .textstream import TextStream
from .types import Completion, Delta, Timings, Usage

DEMO_PACK = Path(__file__).resolve().parent.parent / "demo"


def demo_model_path() -> Path:
    if not (DEMO_PACK / "pack.json").is_file():
        raise StrataError(f"no model given and the built-in demo model is missing from this install ({DEMO_PACK})")
    return DEMO_PACK


HOST_KV_SHARE = 0.5         # of the available host memory the CPU runner's float32 KV may grow to


def _pick_device(wanted: str, ordinal: int = 0) -> str:
    """The device for `wanted`: cpu; cuda (DeviceError without a usable GPU); auto: the GPU when
    usable, else the CPU (saying why on stderr where an NVIDIA driver is present)."""
    if wanted == "cpu":
        return "cpu"
    from ..system import gpu_unusable_reason, note_cpu_fallback
    reason = gpu_unusable_reason(ordinal)
    if wanted == "cuda" and reason is not None:
        raise DeviceError(f"device 'cuda': {reason}")
    if reason is not None:
        note_cpu_fallback(reason)
    return "cuda" if reason is None else "cpu"


def host_context(args, context: int, available_bytes: int | None, kv: str = "f32",
                 parallel: int = 1) -> tuple[int, str | None]:
    """(context, why lowered or None) for the CPU runner: its KV of every layer for each of the
    `parallel` sequences, in the format it stores (float32 for f16, else the --kv format's planes),
    may grow to HOST_KV_SHARE of the available host memory."""
    from ..quant.kv import cell_bytes as kv_cell_bytes
    cell_bytes = parallel * (args.num_hidden_layers + args.num_mtp_layers) * kv_cell_bytes(
        kv, args.num_key_value_heads, args.head_dim)
    if available_bytes is None or context * cell_bytes <= HOST_KV_SHARE * available_bytes:
        return context, None
    fit = max(1, int(HOST_KV_SHARE * available_bytes // cell_bytes))
    slots = f" in each of {parallel} slots" if parallel > 1 else ""
    return fit, (f"the KV of {context} tokens{slots} ({context * cell_bytes / 2**30:.1f} GiB as {kv}) would not "
                 f"fit in half of the {available_bytes / 2**30:.1f} GiB of available host memory")


def _context(device: str, pack, config: EngineConfig) -> tuple[int, str]:
    """(max_context, why): --max-context or the model's trained context, fitted to the device's memory."""
    from .planner import PackSizes, fit_context, vram_budget
    if device == "cuda" and config.split:
        from .cuda_split import split_plan
        plan, _ = split_plan(pack, config, config.max_context or None)
        return plan.max_context, plan.context_source
    if device == "cuda":
        from ..backends.cuda import device_info
        ordinal = int(config.gpus.split(",")[0])
        d = device_info(ordinal)
        budget, _ = vram_budget(config, d["free_memory_bytes"])
        sizes = PackSizes.of_pack(pack)
        return fit_context(sizes, config, budget, d["multiprocessor_count"])
    from ..system import host_memory
    asked, why = _cpu_asked_context(pack, config)
    context, lowered = host_context(pack.args, asked, host_memory()[1], _cpu_kv(config.kv), config.parallel)
    return context, why if lowered is None else f"lowered from {asked}: {lowered}"


def _cpu_asked_context(pack, config: EngineConfig) -> tuple[int, str]:
    """(context, why) the CPU runner is asked for before its host memory is weighed: --max-context
    (capped at the trained context) or the model's trained context."""
    from .planner import asked_context
    trained = pack.args.max_position_embeddings
    if config.max_context:
        return asked_context(config.max_context, trained)
    return trained, "the model's trained context"


def _make_runner(device: str, pack, max_context: int, config: EngineConfig):
    if device == "cuda" and config.split:
        from .cuda_split import SplitRunner
        return SplitRunner(pack, max_context, config)
    if device == "cuda":
        from .cuda_runner import CudaRunner
        return CudaRunner(pack, max_context, config)
    if config.split:
        raise InvalidArgument(f"--gpus {config.gpus}: a layer split runs on GPUs, and this run is on the CPU")
    if config.pcie_gbs:
        raise InvalidArgument("--pcie-gbs caps the GPU's host->device bus; this run is on the CPU")
    if str(config.cpu_experts).strip().lower() != "off":
        raise InvalidArgument(f"--cpu-experts {config.cpu_experts}: this run is on the CPU, where every expert runs "
                              f"on the host already; the flag splits the GPU's missed experts")
    if config.kv_resident:
        raise InvalidArgument(f"--kv-resident {config.kv_resident}: the CPU's KV is in host memory already; the flag "
                              f"is the GPU's")
    from .runner import CpuRunner
    from .slots import keep_bytes
    return CpuRunner(pack, max_context, prefill_chunk=_cpu_chunk(config.prefill), kv=_cpu_kv(config.kv),
                     spec=config.spec if config.mtp else "0", parallel=config.parallel, keep_bytes=keep_bytes(config),
                     draft_window=config.draft_window, draft_prompt=config.draft_prompt)


def _cpu_chunk(setting: str) -> int:
    """The CPU's prompt chunk for --prefill: N as given, auto:N at most N, auto 512 (its memory is the
    host's, so no plan chooses it)."""
    n = 512 if setting == "auto" else int(setting.removeprefix("auto:"))
    if n <= 0:
        raise InvalidArgument(f"prefill must be a positive number of tokens, got {setting!r}")
    return n if setting.isdigit() else min(n, 512)


def _cpu_kv(kv: str) -> str:
    """The CPU's cells for a --kv format: the oracle keeps f16's exact (float32), the quantized ones
    as the GPU stores them."""
    return "f32" if kv == "f16" else kv


class LLM:
    """A loaded model. `LLM()` loads the built-in demo model; `LLM(path)` a pack dir or a .gguf file."""

    def __init__(self, model: str | Path | None = None, device: str = "auto", **engine_config):
        from ..pack import open_pack, resolve_model
        from ..tokenizer import Tokenizer

        self.config = EngineConfig.from_kwargs(device=device, **engine_config)
        path = demo_model_path() if model is None else resolve_model(model, self.config.cache_dir or None)
        self.pack = open_pack(path)
        self.args = self.pack.args
        self.model_name = "strata-demo" if model is None else Path(path).name
        self.tokenizer = Tokenizer(self.pack.tokenizer_path, self.pack.tokenizer_meta)
        if self.tokenizer.vocab_size > self.args.vocab_size:   # its ids would index past the embedding
            raise PackError(f"{path}: the tokenizer has {self.tokenizer.vocab_size} tokens, more than the model's "
                            f"vocabulary of {self.args.vocab_size}")
        self.device = _pick_device(self.config.device, int(self.config.gpus.split(",")[0]))
        if self.device == "cpu":            # auto found no GPU: the GPU's kernel paths would do nothing
            refuse_gpu_kernel_paths(self.config)
        wanted = self.config
        try:
            self._load_runner(wanted)
        except UnsupportedError as exc:
            # what the GPU does not run of qwen3next yet (--kv-resident, --spec): auto falls back to the CPU
            if not (wanted.device == "auto" and self.device == "cuda" and self.args.architecture == "qwen3next"):
                raise
            print(f"strata: {exc}; running on the CPU", file=sys.stderr, flush=True)
            self.device = "cpu"
            self._load_runner(wanted)
        self.state = "idle"
        self.scheduler = self.new_scheduler()        # generate() and stream() queue here
        self._warm_text()

    def _load_runner(self, config: EngineConfig) -> None:
        """The runner on self.device for config (--kv auto and the context resolved for that device)."""
        from .kv_choice import resolve
        from .parallel_choice import resolve_parallel
        slots = config.parallel
        if slots == "auto":             # the format first, for one slot; then the slots in that format
            config = dataclasses.replace(config, parallel=1)
        self.config, self.kv_source = resolve(self.device, self.pack, config)      # --kv auto
        self.config, self.parallel_source = resolve_parallel(self.device, self.pack,
                                                             dataclasses.replace(self.config, parallel=slots),
                                                             host_fits=self._host_fits)
        self.max_context, self.context_source = _context(self.device, self.pack, self.config)
        if self.context_source.startswith(("lowered", "--max-context ")):
            print(f"strata: context {self.max_context} tokens: {self.context_source}", file=sys.stderr, flush=True)
        self.runner = _make_runner(self.device, self.pack, self.max_context, self.config)

    def _host_fits(self, slots: int) -> bool:
        """Whether `slots` sequences' host KV holds the asked (or trained) context (--parallel auto on
        the CPU: host_context's rule)."""
        from ..system import host_memory
        context = _cpu_asked_context(self.pack, self.config)[0]
        return host_context(self.args, context, host_memory()[1], _cpu_kv(self.config.kv), slots)[1] is None

    def new_scheduler(self, queue_size: int | None = None, on_event=None, begin=None) -> Scheduler:
        """A request queue over this model's --parallel slots (strata.engine.scheduler): requests go
        to the slot with the longest cached prefix, and the slots' plain decode steps run batched,
        grouped by --batch-max's rule (the newest scheduler's rule is what status() reports).
        begin: what starts a request's work (default self.begin; a wrapper's own)."""
        from .batching import batch_rule
        from .scheduler import DEFAULT_QUEUE_SIZE
        n = self.config.parallel
        self.batching = batch_rule(self.config.batch_max, n)
        # prompts read together where the runner can (the GPU's: CudaRunner.prompt_batchable says
        # which); not with --batch-max 1, whose rows step apart
        prompts = n > 1 and self.config.batch_max != 1 and hasattr(self.runner, "prefill_batch")
        return Scheduler(begin or self.begin, queue_size or DEFAULT_QUEUE_SIZE, num_slots=n, on_event=on_event,
                         choose=self.runner.best_slot if n > 1 else None, batch=self._decode_batch if n > 1 else None,
                         batch_rule=self.batching, waits=getattr(self.runner, "worth_waiting", None) if n > 1 else None,
                         batch_prompts=self._prompt_batch if prompts else None)

    def _decode_batch(self, works: list["Generation"]) -> None:
        """One batched decode step for the works' pending tokens (Scheduler's batch)."""
        self.runner.decode_batch([w.slot for w in works], [w.pending for w in works])
        for w in works:
            w.pending, w.stepped = None, True

    def _prompt_batch(self, works: list["Generation"]) -> None:
        """The prompts of works waiting to be read (Scheduler's batch_prompts), in forwards of at most
        runner.prompt_batch_tokens tokens each (runner.prefill_batch): each prompt, in their order,
        joins the first forward it fits in. A forward of one is left to the work, which reads its
        prompt alone."""
        groups: list[list[Generation]] = []
        sizes: list[int] = []
        limit = self.runner.prompt_batch_tokens
        for w in works:
            n = len(w.ids) - w.prompt_start
            at = next((i for i, size in enumerate(sizes) if size + n <= limit), len(groups))
            if at == len(groups):
                groups.append([])
                sizes.append(0)
            groups[at].append(w)
            sizes[at] += n
        for group in groups:
            if len(group) < 2:
                continue
            self.runner.prefill_batch([(w.slot, w.ids, w.prompt_start) for w in group])
            for w in group:
                w.prompt_read = True
                n = len(w.ids) - w.prompt_start
                if w.on_progress is not None:
                    w.on_progress(n, n)

    def warm_up(self) -> float:
        """Pay the first request's one-time costs now (the chat template, the tokenizer, and on the
        CPU the weights' dequantization and numpy's first calls) without leaving anything behind:
        no cached prefix, no counters. -> seconds it took."""
        t0 = time.perf_counter()
        self._warm_text()
        if hasattr(self.runner, "warm_up"):
            self.runner.warm_up()
        return time.perf_counter() - t0

    def _warm_text(self) -> None:
        """Compile the chat template and run the tokenizer once (tens of ms, paid at load)."""
        try:
            text = self.tokenizer.apply_chat_template([{"role": "user", "content": "Hello"}])
        except Exception:   # a template that wants other messages fails its requests, not the load
            text = "Hello"
        self.tokenizer.decode(self.tokenizer.encode(text))

    # -- the public surface ------------------------------------------------------------------
    def logits(self, token_ids) -> np.ndarray:
        """[T, V] float32 logits at every position of one prompt (read from scratch)."""
        ids = self._check_ids(token_ids)
        if len(ids) > self.max_context:
            raise InvalidArgument(f"prompt of {len(ids)} tokens does not fit the context of {self.max_context} "
                                  f"tokens (--max-context)")
        return self.runner.logits_all(ids)

    def generate(self, prompt, max_tokens: int | None = None, temperature: float = 0.0, top_p: float = 1.0,
                 top_k: int = 0, seed: int | None = None, stop=None, **adjust) -> Completion:
        """The whole reply. adjust: SamplingParams' presence_penalty, frequency_penalty,
        repetition_penalty, logit_bias ({token id: bias}), logprobs (k: each token's log-probability
        and its k likeliest rivals in .logprobs) and prompt_logprobs (the same for the prompt's
        tokens, in .prompt_logprobs); see strata.engine.logits."""
        params = SamplingParams(max_tokens, temperature, top_p, top_k, seed, stop, **_adjust(adjust))
        request = self._submit(prompt, params)
        for _ in self._events(request):
            pass
        return request.completion

    def stream(self, prompt, max_tokens: int | None = None, temperature: float = 0.0, top_p: float = 1.0,
               top_k: int = 0, seed: int | None = None, stop=None, **adjust) -> Iterator[str]:
        """The reply's text as it comes (adjust as generate's)."""
        params = SamplingParams(max_tokens, temperature, top_p, top_k, seed, stop, **_adjust(adjust))
        request = self._submit(prompt, params)
        for delta in self._events(request):
            if delta.text:
                yield delta.text

    def begin(self, prompt, params: SamplingParams | None = None,
              on_progress: Callable[[int, int], None] | None = None, constraint=None,
              speculate: bool = True, slot: int = 0) -> "Generation":
        """Start one generation outside the queue: iterate it for text deltas (the prompt is read on
        the first next()), read .completion when it ends; the scheduler's slots start their work with
        it. constraint: a strata.engine.grammar.TokenConstraint whose mask every pick obeys (structured
        output). speculate=False: plain decode steps where the runner would draft. slot: which of
        the --parallel slots' sequences it runs in (its KV and cached prefix)."""
        params = params or SamplingParams()
        if not 0 <= slot < self.config.parallel:
            raise InvalidArgument(f"slot {slot} out of range 0..{self.config.parallel - 1} (--parallel)")
        return Generation(self, self._prompt_ids(prompt), params, on_progress, constraint, speculate, slot)

    def status(self) -> dict:
        return {"model": self.model_name, "state": self.state, "max_context": self.max_context,
                "context_source": self.context_source, **self.runner.status(), "batching": self.batching.to_dict(),
                "parallel_source": self.parallel_source}

    # -- helpers -----------------------------------------------------------------------------
    def _submit(self, prompt, params: SamplingParams) -> Request:
        """The prompt checked here (a bad one raises in the caller) and queued for the step loop."""
        return self.scheduler.submit(Request(self._prompt_ids(prompt), params))

    def _events(self, request: Request) -> Iterator[Delta]:
        """The request's deltas, stepping the scheduler on this thread; an engine error raises here."""
        for kind, payload in self.scheduler.drive(request):
            if kind == "error":
                raise payload
            if kind == "delta":
                yield payload

    def _prompt_ids(self, prompt) -> list[int]:
        ids = self._check_ids(self.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt)
        if len(ids) >= self.max_context:
            raise InvalidArgument(f"prompt of {len(ids)} tokens does not fit the context of "
                                  f"{self.max_context} tokens (max_context)")
        return ids

    def _check_ids(self, token_ids) -> list[int]:
        if isinstance(token_ids, str):
            raise InvalidArgument("token ids expected, got a string (use generate() for text)")
        ids = [int(t) for t in np.asarray(token_ids, dtype=np.int64).reshape(-1)]
        if not ids:
            raise InvalidArgument("prompt is empty: at least one token is needed")
        bad = [t for t in ids if not 0 <= t < self.args.vocab_size]
        if bad:
            raise InvalidArgument(f"token id {bad[0]} is outside the vocabulary (0..{self.args.vocab_size - 1})")
        return ids


class Generation:
    """One request: the prompt is read on the first next(), then one token per next() (at most one
    engine step: a decode step, or a speculative window whose tokens the next few next() hand out)."""

    def __init__(self, llm: LLM, ids: list[int], params: SamplingParams, on_progress, constraint=None,
                 speculate: bool = True, slot: int = 0):
        self.llm, self.ids, self.params, self.on_progress = llm, ids, params, on_progress
        self.constraint, self.slot = constraint, slot
        # penalties, a bias or log-probabilities: each pick's logits adjusted on the host (engine.logits)
        self.host = HostLogits(params, ids, llm.args.vocab_size) if params.on_host else None
        self.prompt_logprobs: list | None = None
        self.yield_chunks = False   # the scheduler's: next() returns PROMPT_CHUNK between a prompt's chunks
        # the scheduler's: a prompt read in one pass first yields PROMPT_READY with prompt_start (the
        # tokens cached) set, so that prompts waiting together are read in one forward (LLM._prompt_batch,
        # which sets prompt_read); one left unread reads itself alone
        self.batch_prompt = False
        self.prompt_start: int | None = None
        self.prompt_read = False
        self.pending: int | None = None   # the token the next step decodes, when it is a plain decode step
        self.stepped = False        # that step ran already, batched with other slots' (LLM._decode_batch)
        # a constrained request decodes one token at a time: each draft would need its own mask (and
        # a host-adjusted one its own adjusted row)
        self.speculate = (speculate and constraint is None and self.host is None
                          and bool(getattr(llm.runner, "spec", 0)))
        room = llm.max_context - len(ids)
        self.max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        self.completion: Completion | None = None
        self.drafts = (0, 0)        # drafts proposed and accepted in this request's verify windows
        self._cancelled = False
        self._iter = self._run()

    def __iter__(self):
        return self

    def __next__(self) -> Delta:
        self.llm.runner.use(self.slot)      # the slot's sequence: other slots may have stepped since
        while True:
            delta = next(self._iter)
            if delta is not PROMPT_CHUNK or self.yield_chunks:
                return delta

    def cancel(self) -> None:
        self._cancelled = True

    def _run(self) -> Iterator[Delta]:
        llm, runner = self.llm, self.llm.runner
        text = TextStream(llm.tokenizer, self.params.stop)
        out: list[int] = []
        timings = Timings()
        finish = "length"
        try:
            yield from self._prefill(timings)
            timings.draft_room = bool(getattr(runner, "room_lent", False))
            t1 = time.perf_counter()
            tokens = self._tokens(runner, Sampler(self.params), lambda: self.max_tokens - len(out))
            finish = yield from self._decode(tokens, text, out)
            rest = text.finish()
            if text.stopped and finish == "length":
                finish = "stop"        # the stop string was in the last, held-back text
            if rest and finish != "cancelled":
                yield Delta(rest, out[-1] if out else -1)
            timings.predicted_ms = (time.perf_counter() - t1) * 1e3
            timings.predicted_n = len(out)
            timings.draft_n, timings.draft_n_accepted = self.drafts
        finally:
            llm.state = "idle"
        logprobs = None
        if self.host is not None and self.params.logprobs is not None:
            logprobs = self.host.entries[:len(out)]          # not the end-of-sequence pick's
        self.completion = Completion(text=text.text, token_ids=out, finish_reason=finish,
                                     usage=Usage(len(self.ids), len(out), timings.cache_n), timings=timings,
                                     logprobs=logprobs, prompt_logprobs=self.prompt_logprobs)

    def _prefill(self, timings: Timings):
        """Read the prompt past its reusable prefix, yielding PROMPT_CHUNK between chunks; its last
        logits stay in the runner for pick()."""
        llm, runner = self.llm, self.llm.runner
        t0 = time.perf_counter()
        llm.state = "reading"
        if self.params.prompt_logprobs is not None:     # every position's logits: read from the start
            # other slots step between its chunks
            self.prompt_logprobs = yield from prompt_logprobs_steps(runner, self.ids, self.params.prompt_logprobs,
                                                                    PROMPT_CHUNK)
            if self.max_tokens == 0:
                timings.prompt_ms, timings.prompt_n = (time.perf_counter() - t0) * 1e3, len(self.ids)
                llm.state = "generating"
                return
        cached = runner.reusable_prefix(self.ids)
        if self.batch_prompt and runner.prompt_batchable(self.ids, cached):
            self.prompt_start = cached
            yield PROMPT_READY      # read now, with other slots' waiting prompts or alone
            self.prompt_start = None
            if self._cancelled and not self.prompt_read:
                llm.state = "generating"
                return              # nothing read: _decode ends it as cancelled
        if not self.prompt_read:
            steps = runner.prefill_steps(self.ids, cached, self.on_progress)
            for _ in steps:         # the runner pauses between chunks only where other slots may step meanwhile
                yield PROMPT_CHUNK
        timings.prompt_ms = (time.perf_counter() - t0) * 1e3
        timings.prompt_n, timings.cache_n = len(self.ids) - cached, cached
        llm.state = "generating"

    def _decode(self, tokens: Iterator[int], text: TextStream, out: list[int]):
        """Deltas of the tokens until a stop condition -> the finish reason (length, stop, cancelled):
        max_tokens, an end-of-sequence token, a stop string, or a grammar that allows nothing more."""
        eos = set(self.llm.tokenizer.eos_token_ids)
        first = self.prompt_logprobs           # goes out with the first delta, then None

        def delta(piece: str, token: int, entry) -> Delta:
            nonlocal first
            d, first = Delta(piece, token, entry, first), None
            return d

        while len(out) < self.max_tokens:
            if self._cancelled:
                return "cancelled"
            token = next(tokens)
            if token in eos:
                return "stop"
            out.append(token)
            entry = self.host.entries[-1] if self.host is not None and self.host.entries else None
            if self.constraint is not None:
                self.constraint.advance(token)
            piece = text.push(token)
            if text.stopped:
                if piece or entry is not None:
                    yield delta(piece, token, entry)
                return "stop"
            complete = self.constraint is not None and self.constraint.complete
            if not (complete or self.speculate) and len(out) < self.max_tokens:
                self.pending = token    # the next next() decodes it: the scheduler may batch that step
            yield delta(piece, token, entry)
            self.pending = None
            if complete:
                return "stop"          # its end-of-sequence is implied
        return "length"

    def _tokens(self, runner, sampler, left: Callable[[], int]) -> Iterator[int]:
        """The request's tokens, computed only when asked for: the prompt's pick, then one decode
        step per token, or one speculative verify window per few tokens (runner.spec drafts)."""
        def mask():        # the grammar's allowed tokens after what it has advanced over (None: all)
            return None if self.constraint is None else self.constraint.mask()

        def pick(step: bool):
            if self.host is None:
                return runner.pick(self.params, sampler.draw(), mask=mask(), step=step)
            token = runner.pick(self.params, sampler.draw(), mask=mask(), host=self.host.adjust, step=step)
            self.host.picked(token)
            return token

        # One slot: each pick decodes its token too where another token is to come (the runner may
        # queue that step before the host has the token); with several, the scheduler may batch it.
        alone = not self.speculate and getattr(runner, "num_slots", 1) == 1
        decoded = alone and left() > 1     # the token's decode step went with its pick
        token = pick(decoded)
        yield token
        while True:
            if self.speculate:      # this request's drafts: other slots' windows count in theirs
                before = _spec_counts(runner)
                window = runner.speculate(token, self.params, sampler, left())
                self.drafts = tuple(d + b - a for d, a, b in zip(self.drafts, before, _spec_counts(runner)))
                for token in window:
                    yield token
            else:
                if self.stepped:        # decoded already, in a batched step with other slots
                    self.stepped = False
                elif not decoded:       # (or by the pick that chose it)
                    runner.decode(token, logits=False)
                decoded = alone and left() > 1
                token = pick(decoded)
                yield token


ADJUST = ("presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "logprobs", "prompt_logprobs")


def _adjust(kwargs: dict) -> dict:
    """generate()'s and stream()'s extra SamplingParams; a name that is none of them is refused."""
    unknown = sorted(set(kwargs) - set(ADJUST))
    if unknown:
        raise InvalidArgument(f"unknown sampling parameter {unknown[0]!r} (known besides the named ones: "
                              f"{', '.join(ADJUST)})")
    if isinstance(kwargs.get("logit_bias"), dict):
        kwargs = {**kwargs, "logit_bias": tuple(kwargs["logit_bias"].items())}
    return kwargs


def _spec_counts(runner) -> tuple[int, int]:
    stats = getattr(runner, "spec_stats", None)
    return (stats.draft_n, stats.draft_n_accepted) if stats is not None else (0, 0)
