"""The `redraft` command: serve, generate, make-tiny, bench, plan."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from typing import Mapping

    from redraft.protocol.fields import FieldSpec
    from redraft.protocol.server_args import ServerArgs



# SGLang's and vLLM's flags that redraft takes and that change nothing here (said once at start-up)
NOOP_FLAGS = {
    "--trust-remote-code": "redraft runs no code from a checkpoint",
    "--enable-metrics": "/metrics is always on",
    "--disable-log-requests": "redraft logs no request contents",
    "--tool-call-parser": "tool calls are read in LLaDA2's own <tool_call> format, always",
}
NOOP_WITH_VALUE = {"--tool-call-parser"}
# theirs that name a feature redraft does not have: refused with what to do instead
REFUSED_FLAGS = {
    "--dp-size": "data parallelism is replicas behind smg (docs/scaling.md)",
    "--data-parallel-size": "data parallelism is replicas behind smg (docs/scaling.md)",
    "--pipeline-parallel-size": "pipeline parallelism is not supported; use --tp-size",
    "--pp-size": "pipeline parallelism is not supported; use --tp-size",
    "--enable-lora": "LoRA adapters are not supported",
    "--lora-paths": "LoRA adapters are not supported",
    "--speculative-algorithm": "block diffusion drafts and edits by itself; there is no draft model",
    "--reasoning-parser": "LLaDA2 has no reasoning format to parse",
}
API_KEY_ENV = {"api_key": "REDRAFT_API_KEY", "admin_api_key": "REDRAFT_ADMIN_API_KEY"}


class _NoopValue(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None) -> None:
        setattr(namespace, self.dest, [*(getattr(namespace, self.dest, None) or []), option_string])


class _Refused(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None) -> None:
        parser.error(f"{option_string} is not supported: {REFUSED_FLAGS[option_string]}")


def add_compat_flags(parser: argparse.ArgumentParser) -> None:
    """The flags SGLang's and vLLM's users type that have no redraft field: accepted no-ops, or refused by name;
    listed in --help's compatibility section (their other names of redraft's own flags sit beside those)."""
    from redraft.protocol.server_args import cli_group

    section = cli_group(parser, "compatibility")
    for flag, why in NOOP_FLAGS.items():
        if flag in NOOP_WITH_VALUE:
            section.add_argument(flag, action=_NoopValue, dest="noop_flags", metavar="NAME",
                                 help=f"accepted, no effect: {why}")
        else:
            section.add_argument(flag, action="append_const", const=flag, dest="noop_flags",
                                 help=f"accepted, no effect: {why}")
    for flag, why in REFUSED_FLAGS.items():
        section.add_argument(flag, nargs="?", action=_Refused, metavar="X", help=f"refused: {why}")


def quiet_stderr(args: argparse.Namespace) -> None:
    """On a stderr that is not a terminal (a pipe, a log file), `redraft generate` logs only warnings unless
    --log-level is given: its stdout is the answer, its stderr the one summary line (and the weights' progress bar
    draws only on a terminal, engine/model/loader.py)."""
    if getattr(args, "log_level", "info") is None:
        args.log_level = "info" if sys.stderr.isatty() else "warning"


def engine_args(args: argparse.Namespace) -> "ServerArgs":
    from redraft.protocol.server_args import ServerArgs

    positional = getattr(args, "model_positional", None)
    if positional is not None:
        if args.model_path is not None and args.model_path != positional:
            raise ValueError(f"two models: {positional!r} (positional) and --model {args.model_path!r}")
        args.model_path = positional
    for key, env in API_KEY_ENV.items():  # keys from the environment keep them out of `ps`
        if hasattr(args, key) and not getattr(args, key) and os.environ.get(env):
            setattr(args, key, [k.strip() for k in os.environ[env].split(",") if k.strip()])
    for flag in getattr(args, "noop_flags", None) or ():
        logging.getLogger("redraft").info("%s: accepted, no effect (%s)", flag, NOOP_FLAGS[flag])
    return ServerArgs.from_cli(args)


def cmd_generate(args: argparse.Namespace) -> int:
    from redraft.engine.runtime.engine import Engine

    engine = Engine(server_args=engine_args(args))
    if args.raw:
        prompt_ids = engine.tokenizer.encode(args.prompt)
    else:
        prompt_ids = engine.tokenizer.encode_chat([{"role": "user", "content": args.prompt}])
    from redraft.protocol.sampling_params import FIELDS

    # what the command line names; the engine resolves the rest (defaults chain)
    params = {name: getattr(args, name) for name, spec in FIELDS.items() if spec.cli and getattr(args, name) is not None}
    if args.request_seed is not None:
        params["seed"] = args.request_seed
    printer = None
    if args.show_steps:
        from redraft.show_steps import StepPrinter

        printer = StepPrinter(sys.stderr)
        params["stream_denoise"] = True
    out = engine.generate(input_ids=prompt_ids, sampling_params=params, on_event=printer)
    if printer is not None:
        printer.finish()
        out.pop("denoise", None)  # drawn already; --json keeps the answer's shape
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print(out["text"])
        m = out["meta_info"]
        structural = f", {m['deletions']} deletions, {m['insertions']} insertions" \
            if m.get("decoder") == "levenshtein" else ""
        print(f"[{m['completion_tokens']} tokens, {m['steps']} forwards, {m['tokens_per_forward']:.2f} tokens/forward, "
              f"{m['edits']} edits{structural}, mode {m['mode']}, finish {m['finish_reason']['type']}]",
              file=sys.stderr)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from redraft.server.launch import serve

    return serve(engine_args(args))


def cmd_make_tiny(args: argparse.Namespace) -> int:
    from redraft.engine.model.tiny import make_tiny_checkpoint

    path = make_tiny_checkpoint(args.out, seed=args.seed, dtype=args.dtype, shards=args.shards, llada22=args.llada22)
    print(f"wrote a tiny random LLaDA2{'.2' if args.llada22 else ''} checkpoint to {path}")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from redraft.clients.bench import run_cli

    return run_cli(args)


def cmd_plan(args: argparse.Namespace) -> int:
    from redraft.clients.memory_plan import run_cli

    return run_cli(args)


def _add_engine_commands(sub: "argparse._SubParsersAction") -> None:
    """serve and generate: their engine flags come from ServerArgs."""
    from redraft.protocol.server_args import ServerArgs

    srv = sub.add_parser("serve", help="the HTTP server: OpenAI-compatible and SGLang-native routes",
                         usage="%(prog)s [MODEL] [--model M] [--device auto|cpu|cuda] [--port N] [...]",
                         epilog="SGLang's and vLLM's names work too (--tensor-parallel-size, --max-model-len, "
                                "--gpu-memory-utilization, --max-num-seqs, a positional MODEL, ...); API keys may "
                                "come from REDRAFT_API_KEY / REDRAFT_ADMIN_API_KEY (comma-separated).")
    srv.add_argument("model_positional", nargs="?", metavar="MODEL", help="the model, as --model")
    ServerArgs.add_cli_args(srv, ("engine", "serve"))
    add_compat_flags(srv)
    srv.set_defaults(func=cmd_serve)

    gen = sub.add_parser("generate", help="one prompt -> completion, offline (answer on stdout, a summary on stderr)",
                         usage="%(prog)s PROMPT [--mode S|Q] [--max-new-tokens N] [--json] [--show-steps] [...]")
    _add_request_flags(gen)
    ServerArgs.add_cli_args(gen, ("engine",))
    # log level None: info on a terminal, else warning (quiet_stderr)
    gen.set_defaults(func=cmd_generate, log_level=None)
    for action in gen._actions:
        if action.dest == "log_level":
            action.help = "logging level (default: info on a terminal, else warning)"


def _add_request_flags(gen: argparse.ArgumentParser) -> None:
    """`redraft generate`'s own flags: the prompt and its sampling parameters (docs/openai.md has them all)."""
    from redraft.protocol.sampling_params import FIELDS

    gen.add_argument("prompt", help="the user's message (sent through the chat template unless --raw)")
    req = gen.add_argument_group("the request")
    req.add_argument("--raw", action="store_true", help="do not apply the chat template: the prompt is raw text")
    add_request_flags(req)
    # dest request_seed: the request's sampling seed, never ServerArgs.seed (the seed of --load-format dummy weights)
    req.add_argument("--seed", dest="request_seed", type=int, default=None, help=FIELDS["seed"].help)
    out = gen.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="print the whole result as JSON")
    out.add_argument("--show-steps", action="store_true",
                     help="draw each forward on stderr: masks, drafts by confidence, edits (redrawn in place on a "
                          "terminal, one line per forward otherwise)")


def add_request_flags(group: "argparse._ActionsContainer", specs: "Mapping[str, FieldSpec] | None" = None) -> None:
    """A flag for each request field declared with `cli=True` (protocol/sampling_params.py SamplingParams): its
    type, allowed values and help from the declaration; unset (None) leaves the field to the defaults chain."""
    from redraft.protocol.sampling_params import FIELDS

    for name, spec in (FIELDS if specs is None else specs).items():
        if spec.cli:
            group.add_argument(spec.flag, dest=name, type=None if spec.choices else spec.kind,
                               choices=list(spec.choices) if spec.choices else None, default=None, help=spec.help)


def _add_tool_commands(sub: "argparse._SubParsersAction", command: str | None) -> None:
    """make-tiny, and the client-side tools of redraft.clients: bench and plan. Their flags come from clients/,
    imported only when `command` is theirs (or None: every command's flags), so that `redraft serve` never loads
    clients/ into the HTTP process."""
    tiny = sub.add_parser("make-tiny", help="write a tiny random LLaDA2 checkpoint (Hugging Face layout)")
    tiny.add_argument("out", help="the folder to write (config.json, safetensors, tokenizer)")
    tiny.add_argument("--seed", type=int, default=0, help="seed of the random weights (default: %(default)s)")
    tiny.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                      help="the weights' dtype (default: %(default)s)")
    tiny.add_argument("--shards", type=int, default=1, help="safetensors files to split the weights into "
                                                            "(default: %(default)s)")
    tiny.add_argument("--llada22", action="store_true",
                      help="a LLaDA2.2 checkpoint: block routing, DELETE/SPLIT tokens, the Levenshtein step's defaults")
    tiny.set_defaults(func=cmd_make_tiny)

    bench = sub.add_parser("bench", help="load-test an OpenAI-compatible server: latency, tokens/s per domain and mode",
                           description="Drive any OpenAI-compatible server through streaming /v1/chat/completions "
                                       "at fixed concurrencies or Poisson request rates; JSON report and PNG plot. "
                                       "See `python -m redraft.clients.bench --help` for the details.")
    bench.set_defaults(func=cmd_bench)
    if command in (None, "bench"):
        from redraft.clients.bench import add_bench_args

        add_bench_args(bench)

    plan = sub.add_parser("plan", help="memory plan: weights and KV-cache tokens per GPU for each tensor-parallel "
                                       "size (from a config; no weights read)",
                          formatter_class=argparse.RawDescriptionHelpFormatter)
    plan.set_defaults(func=cmd_plan)
    if command in (None, "plan"):
        from redraft.clients.memory_plan import __doc__ as plan_doc, add_plan_args

        plan.description = plan_doc
        add_plan_args(plan)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The whole command line (`command` None), or the one that parses `command`: the other commands are listed
    but the client tools' flags are left out unless it is theirs (`_add_tool_commands`)."""
    parser = argparse.ArgumentParser(prog="redraft", description="Serve LLaDA2.x block-diffusion language models.",
                                     epilog="Each command has its own flags: `redraft serve --help`, "
                                            "`redraft generate --help`, `redraft bench --help`, `redraft plan --help`.")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_engine_commands(sub)
    _add_tool_commands(sub, command)
    # The demo-model commands keep their own parsers (training/); main() hands them the rest of the line.
    sub.add_parser("train-demo", add_help=False,
                   help="train (or resume) the bundled demo model on CPU; `redraft train-demo --help`")
    sub.add_parser("eval-demo", add_help=False,
                   help="held-out accuracy, tokens/forward and edits of the demo model; `redraft eval-demo --help`")
    return parser


def _demo_command(name: str, rest: list[str]) -> int:
    if name == "train-demo":
        from redraft.training.train import train_main

        return train_main(rest)
    from redraft.training.evaluate import main as eval_main

    return eval_main(rest, default_format="table", prog="redraft eval-demo")


def parse_args(argv: list[str]) -> argparse.Namespace:
    """`argv` read by the parser of its command alone (build_parser), so serving loads nothing of clients/."""
    return build_parser(argv[0] if argv else None).parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in ("train-demo", "eval-demo"):
        return _demo_command(argv[0], argv[1:])
    args = parse_args(argv)
    quiet_stderr(args)
    logging.basicConfig(
        level=getattr(args, "log_level", "info").upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, RuntimeError, OSError) as exc:  # one clear line, no traceback
        print(f"redraft: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
