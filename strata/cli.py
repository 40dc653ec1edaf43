"""python -m strata {serve,bench,convert,generate,info,plan}."""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time

from .config import EngineConfig, engine_kwargs
from .errors import StrataError

NOT_BUILT: dict[str, str] = {}


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per EngineConfig field; unset flags stay None so defaults and STRATA_* apply."""
    group = parser.add_argument_group("engine")
    for f in dataclasses.fields(EngineConfig):
        flag = "--" + f.name.replace("_", "-")
        help_text = f.metadata.get("help", "") + f" (default {f.default!r}; env STRATA_{f.name.upper()})"
        if f.type in (bool, "bool"):
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        else:
            kind = {"int": int, "float": float}.get(f.type if isinstance(f.type, str) else f.type.__name__, str)
            group.add_argument(flag, type=kind, default=None, metavar=f.name.upper(), help=help_text)


class _Parser(argparse.ArgumentParser):
    """A usage error is one line on stderr and exit 2, like every other start-up failure."""

    def error(self, message: str):
        self.exit(2, f"strata: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m strata", description="Strata: MoE language models on GPUs smaller than the model.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)

    s = sub.add_parser("serve", help="OpenAI-compatible server with the Monitor web app")
    s.add_argument("model", nargs="?", help="pack dir or .gguf (default: the built-in demo model)")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8080)
    s.add_argument("--api-key", default=None, help="required on /v1 routes (env STRATA_API_KEY)")
    s.add_argument("--queue-size", type=int, default=64, help="requests waiting at most; more get 503")
    s.add_argument("--max-body-bytes", type=int, default=4 << 20, help="request body limit")
    s.add_argument("--reasoning-format", choices=("auto", "none"), default="auto",
                   help="auto: a chat reply's <think> block as message.reasoning_content where the model has "
                        "those tags (Qwen3); none: replies as the model wrote them")
    s.add_argument("--allowed-hosts", default=None, help="Host names answered besides localhost, 127.0.0.1, [::1] "
                   "(comma list, any port; * for any)")
    add_engine_flags(s)

    g = sub.add_parser("generate", help="complete a prompt and print the text as it comes")
    g.add_argument("model", nargs="?", help="pack dir or .gguf (default: the built-in demo model)")
    g.add_argument("-p", "--prompt", required=True, help="prompt text")
    g.add_argument("-n", "--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--repeat-penalty", type=float, default=1.0, help="prompt and reply tokens: a logit > 0 divided "
                   "by it, < 0 times it (1: none)")
    g.add_argument("--frequency-penalty", type=float, default=0.0, help="subtracted per use of a token in the reply")
    g.add_argument("--presence-penalty", type=float, default=0.0, help="subtracted once from each token the reply used")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    add_engine_flags(g)

    c = sub.add_parser("convert", help="convert a GGUF file or a Hugging Face directory into a pack")
    c.add_argument("src")
    c.add_argument("dst")
    c.add_argument("--qtype", default=None, help="quantize HF weights to this type (e.g. Q8_0)")
    c.add_argument("--quiet", action="store_true", help="no progress output")

    i = sub.add_parser("info", help="architecture, tensors, quant types and sizes of a model; --system: this "
                                    "machine (driver, GPUs, kernel archs, pinned memory, CPU)")
    i.add_argument("model", nargs="?", help="pack dir, .gguf or HF dir (default: the built-in demo model)")
    i.add_argument("--system", action="store_true", help="what this machine offers Strata, and whether the GPU "
                   "path is usable (with the fix when not)")
    i.add_argument("--gpus", default="0", help="the GPU --system checks (default 0)")

    b = sub.add_parser("bench", help="prompt and decode speed, against limits measured in the same run")
    b.add_argument("model", nargs="?", help="pack dir or .gguf (default: the built-in demo model)")
    b.add_argument("--synthetic", metavar="SHAPE", help="random weights of a real shape: qwen3-30b-a3b, qwen3-30b-a3b-mtp (plus "
                                                            "an MTP layer), qwen3-30b-a3b-128k (YaRN x4: 131,072 "
                                                            "tokens), qwen3-next-80b-a3b, small, tiny, tiny-mtp")
    b.add_argument("--prompt", default="512,4096,16384", help="prompt lengths in tokens, comma-separated")
    b.add_argument("--decode", type=int, default=128, help="tokens decoded after the shortest and longest prompt")
    b.add_argument("--json", metavar="PATH", help="write the results as JSON")
    add_engine_flags(b)
    pl = sub.add_parser("plan", help="the VRAM plan: resident items, expert cache, prompt chunk and ring, speeds")
    pl.add_argument("model", nargs="?", help="pack dir, .gguf or HF dir (default: the built-in demo model)")
    pl.add_argument("--synthetic", metavar="SHAPE", help="sizes of a real shape, no weights written: qwen3-30b-a3b, "
                    "qwen3-30b-a3b-mtp, qwen3-30b-a3b-128k, qwen3-next-80b-a3b, small, tiny")
    pl.add_argument("--prompt", default="", help="prompt lengths (comma-separated) to predict each --prefill auto "
                    "candidate's prompt seconds at, besides the ones auto weighs (4096, 16384, 32768)")
    pl.add_argument("--json", action="store_true", help="print the plan as JSON")
    add_engine_flags(pl)
    return p


def cmd_generate(args) -> int:
    from .engine.llm import LLM
    llm = LLM(args.model, **engine_kwargs(args))
    prompt = args.prompt
    if args.chat:
        prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
    from .config import SamplingParams
    params = SamplingParams(args.max_tokens, args.temperature, args.top_p, args.top_k, args.seed,
                            tuple(args.stop or ()), presence_penalty=args.presence_penalty,
                            frequency_penalty=args.frequency_penalty, repetition_penalty=args.repeat_penalty)
    gen = llm.begin(prompt, params)
    for delta in gen:
        sys.stdout.write(delta.text)
        sys.stdout.flush()
    sys.stdout.write("\n")
    t = gen.completion.timings
    print(f"[{t.prompt_n} prompt tokens, {t.prompt_n / max(t.prompt_ms, 1e-9) * 1e3:.1f} tok/s; "
          f"{t.predicted_n} generated, {t.predicted_n / max(t.predicted_ms, 1e-9) * 1e3:.1f} tok/s; "
          + (f"{t.draft_n_accepted} of {t.draft_n} drafts kept; " if t.draft_n else "")
          + f"finish: {gen.completion.finish_reason}; device {llm.device}]", file=sys.stderr)
    return 0


def cmd_convert(args) -> int:
    from .pack import convert
    t0 = time.perf_counter()
    dst = convert(args.src, args.dst, qtype=args.qtype, progress=not args.quiet)
    if not args.quiet:
        print(f"wrote {dst} in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return 0


def cmd_info(args) -> int:
    if args.system:
        if args.model:
            raise StrataError("info: give a MODEL or --system, not both")
        from .config import EngineConfig
        from .system import system_report
        config = EngineConfig.from_kwargs(gpus=args.gpus)
        print(system_report([o for o, _ in config.cards()], config.pin_limit_gib))
        return 0
    from .engine.llm import demo_model_path
    from .pack import info_text
    print(info_text(args.model or demo_model_path()))
    return 0


def cmd_bench(args) -> int:
    from .bench import bench_main
    return bench_main(args, engine_kwargs(args))


def cmd_plan(args) -> int:
    from .plan import plan_main
    return plan_main(args, engine_kwargs(args))


def cmd_serve(args) -> int:
    from .server import serve_main
    return serve_main(args) or 0


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "not_built", False):
        print(f"strata {args.command}: not built yet: {NOT_BUILT[args.command]}", file=sys.stderr)
        return 2
    handler = {"generate": cmd_generate, "convert": cmd_convert, "info": cmd_info, "serve": cmd_serve,
               "bench": cmd_bench, "plan": cmd_plan}
    try:
        return handler[args.command](args)
    except StrataError as e:
        print(f"strata: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("strata: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:       # `python -m strata info X | head`
        sys.stderr.close()
        return 0
    except OSError as e:          # a path, port or device the system refused: the user's to fix
        print(f"strata: error: {e.strerror or e}{': ' + str(e.filename) if e.filename else ''}", file=sys.stderr)
        return 2
