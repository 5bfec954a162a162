"""`ServerArgs`: every operator setting of redraft, each with its one default. Torch-free.

The command line (`redraft serve`, `redraft generate`) is generated from these fields, the offline
`redraft.Engine(**kwargs)` takes the same names, and the engine core derives the scheduler's and the model
runner's settings from it: a default is written here and nowhere else.

Fields whose default is None and that a request can also set (`default_mode`, `default_max_tokens`,
`mbe_window`) form the "operator's explicit flags" level of the defaults chain (sampling_params.resolve):
only a value the operator actually gave takes part in it.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Any

from redraft.protocol.sampling_params import FIELDS, MAX_MBE_WINDOW, MODES, Defaults

DEFAULT_DOMAINS = ("code", "math", "chat")  # the metrics' `domain` label values unless --domains says otherwise
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
DEVICES = ("auto", "cpu", "cuda")  # auto and the kernel backend's auto are resolved in the engine process
KERNEL_BACKENDS = ("auto", "torch", "triton")


def _port(text: str) -> int:
    """argparse type of --port: an integer in 0..65535 (0: any free port), or a clear error."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is outside 0..65535")
    return port


# The sections of `redraft serve --help`, in order: a flag names its section with _opt(group=...); a new section
# is one more line here. (The SGLang/vLLM-only flags, redraft/cli.py, form the "compatibility" section.)
CLI_GROUPS = {
    "model": "model: which checkpoint, and how it is read",
    "gpu": "device and kernels (GPU)",
    "parallelism": "parallelism (docs/scaling.md)",
    "scheduling": "memory and scheduling",
    "decoding": "decoding defaults of requests that name none (docs/openai.md)",
    "server": "HTTP server",
    "limits": "limits on clients (docs/operations.md)",
    "observability": "observability (docs/observability.md)",
    "rl": "reinforcement learning: weight updates from a trainer (docs/rl.md)",
    "compatibility": "SGLang's and vLLM's flags: accepted with no effect, or refused with what to use instead",
}


def _opt(help: str, *, flag: str | None = None, aliases: tuple[str, ...] = (), choices: tuple | None = None,
         cli: str = "engine", group: str = "", default: Any = None, default_factory: Any = None,
         **argparse_extra: Any) -> Any:
    """A field with its command-line description. cli: "engine" (serve and generate), "serve" (the HTTP
    server only) or "" (Python only); group: its section of --help (a CLI_GROUPS key; aliases, such as SGLang's
    and vLLM's names of the same setting, are listed beside the flag); cli_default (in argparse_extra): the
    command line's default where it differs from Python's."""
    if cli and group not in CLI_GROUPS:
        raise ValueError(f"flag of {help!r}: group {group!r} is not one of {', '.join(CLI_GROUPS)}")
    meta = {"help": help, "flag": flag, "aliases": aliases, "choices": choices, "cli": cli, "group": group,
            **argparse_extra}
    if default_factory is not None:
        return field(default_factory=default_factory, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class ServerArgs:
    # ---- model ---------------------------------------------------------------------------------------
    model_path: str | None = _opt("checkpoint directory (Hugging Face layout) or a Hugging Face repo id such as "
                                  "inclusionAI/LLaDA2.1-mini (its cache first; HF_HUB_OFFLINE=1: the cache only); "
                                  "default: the bundled demo model", flag="--model", aliases=("--model-path",),
                                  group="model")
    revision: str | None = _opt("branch, tag or commit of a hub model", group="model")
    device: str = _opt("cpu, cuda, or auto: cuda when the engine's torch sees a CUDA device, else cpu (the choice "
                       "is logged at start-up)", choices=DEVICES, default="cpu",
                       cli_default="auto", group="gpu")
    dtype: str | None = _opt("float32 | bfloat16 | float16 (default: float32 on cpu, bfloat16 on cuda)", group="model")
    kernel_backend: str = _opt("attention and MoE kernels: plain torch, or Triton (interpreted on CPU); auto: "
                               "triton on cuda (when triton imports), torch on cpu",
                               choices=KERNEL_BACKENDS, default="auto", group="gpu")
    quantization: str | None = _opt(
        "fp8: e4m3 weights with a float32 scale per 128x128 block, quantised at load (FP8 checkpoints with a "
        "DeepSeek-style quantization_config load as FP8 without it); lm_head stays in --dtype",
        choices=("fp8",), group="model")
    load_format: str = _opt("auto/safetensors: the checkpoint's weights; dummy: random weights of its shape",
                            choices=("auto", "safetensors", "dummy"), default="auto", group="model")
    seed: int = _opt("seed of load_format=dummy weights", cli="", default=0)
    tp_size: int = _opt("tensor parallelism: engine processes (ranks) sharing each layer, one per GPU on cuda "
                        "(gloo on cpu); docs/scaling.md", default=1, type=int, aliases=("--tensor-parallel-size",),
                        group="parallelism")
    ep_size: int = _opt("expert parallelism: 1 (experts split like the dense layers) or tp_size (whole experts "
                        "placed on ranks)", default=1, type=int, group="parallelism")
    # ---- memory and batching -------------------------------------------------------------------------
    max_total_tokens: int | None = _opt("KV cache capacity in tokens (default: sized for the device)", type=int,
                                        group="scheduling")
    mem_fraction_static: float = _opt("GPU memory share for weights + KV cache", default=0.85, type=float,
                                      aliases=("--gpu-memory-utilization",), group="gpu")
    chunked_prefill_size: int = _opt("prefill-token budget of one iteration", default=8192, type=int,
                                     aliases=("--max-num-batched-tokens",), group="scheduling")
    max_running_requests: int = _opt("requests decoded together at most", default=256, type=int,
                                     aliases=("--max-num-seqs",), group="scheduling")
    context_length: int | None = _opt("cap the context (prompt + output tokens) below the checkpoint's "
                                      "max_position_embeddings", type=int, aliases=("--max-model-len",), group="model")
    max_queued_requests: int | None = _opt("beyond this many waiting requests (or running likelihood jobs: /score, "
                                           "echo): 503", type=int, group="scheduling")
    schedule_policy: str = _opt("admission order: first come first served, or longest cached prefix first",
                                choices=("fcfs", "lpm"), default="fcfs", group="scheduling")
    enable_prefix_cache: bool = _opt("do not reuse the K/V of cached prompt blocks (the radix prefix cache is on "
                                     "unless this is given)", flag="--disable-radix-cache",
                                     default=True, action="store_false", group="scheduling")
    # ---- request defaults (the operator's level of the defaults chain; None = not given) ----------------
    default_mode: str | None = _opt("decoding mode of requests that name none (default Q)", choices=MODES,
                                    group="decoding")
    default_max_tokens: int | None = _opt(
        "max_new_tokens / max_tokens of requests that name none (default: generation_config.json's, else 1024; "
        "a default is always capped by the context left after the prompt)", type=int, group="decoding")
    mbe_window: int | None = _opt(
        f"multi-block editing window (open blocks, 1..{MAX_MBE_WINDOW}) of requests that name none (default 1: "
        "the official single-block loop; docs/mbe.md)", type=int, group="decoding")
    random_seed: int | None = _opt("seeds the seeds of sampled requests that bring none, so a server run can be "
                                   "replayed (default: fresh randomness)", type=int, group="decoding")
    chat_template: str | None = _opt("a Jinja chat template (a file, or the template itself) replacing the "
                                     "checkpoint's; rendered in the same sandbox", group="model")
    # ---- speed -----------------------------------------------------------------------------------------
    cuda_graph_max_bs: int = _opt("largest batch replayed from a CUDA graph", default=64, type=int, group="gpu")
    disable_cuda_graph: bool = _opt("run the denoising step eagerly on GPUs too", default=False, action="store_true",
                                    group="gpu")
    disable_overlap: bool = _opt("never run the overlap scheduler, even with --enable-overlap (debugging: results are "
                                 "the same either way; docs/architecture.md, step 6)", default=False,
                                 action="store_true", aliases=("--disable-overlap-schedule",), group="scheduling")
    enable_overlap: bool = _opt("run the overlap scheduler (the next forward speculated while the host works: queued "
                                "from its thread on CUDA, on a worker thread on CPU; off by default: it measured "
                                "slower on CPU and, threaded, on H100/H200, docs/gpu.md)",
                                default=False, action="store_true", group="scheduling")
    cpu_threads: int | None = _opt("torch threads on CPU, per rank (default: torch's choice, or the cores shared "
                                   "out among the --tp-size ranks; 1 is best on a busy machine)", type=int, group="gpu")
    # ---- reinforcement learning (docs/rl.md) --------------------------------------------------------------
    weight_version: str = _opt("the name of the weights served at start (meta_info.weight_version; an update "
                               "may rename it)", default="default", group="rl")
    weight_spool_dir: str | None = _opt(
        "keep the weights of every update from a trainer's broadcast here (a full checkpoint), so that an engine "
        "restart serves them again; without it such an engine refuses to restart rather than revert to --model",
        group="rl")
    enable_memory_saver: bool = _opt(
        "say so in /server_info (SGLang's flag, which slime compares with its --offload-rollout when it attaches); "
        "/release_memory_occupation frees memory with or without it (docs/rl.md)",
        default=False, action="store_true", group="rl")
    # ---- HTTP server -----------------------------------------------------------------------------------
    host: str = _opt("address to listen on", cli="serve", default="127.0.0.1", group="server")
    port: int = _opt("port to listen on", cli="serve", default=30000, type=_port, group="server")
    served_model_name: str | None = _opt("the model name clients use (default: the folder name)", cli="serve",
                                         group="server")
    api_key: tuple[str, ...] = _opt(
        "require `Authorization: Bearer KEY` (repeat for several keys; /health, /live and /metrics stay open)",
        cli="serve", default=(), action="append", group="server")
    admin_api_key: tuple[str, ...] = _opt(
        "the key of the admin routes (/abort_request, /flush_cache): with --api-key set they need it and refuse "
        "the ordinary keys (repeatable)", cli="serve", default=(), action="append", group="server")
    max_body_bytes: int = _opt("larger request bodies get 413", cli="serve", default=8 * 2**20, type=int,
                               group="server")
    shutdown_timeout: float = _opt("on SIGTERM/SIGINT: seconds running requests get to finish (new ones get 503) "
                                    "before the rest are ended with a 503", cli="serve", default=30.0, type=float,
                                    group="server")
    engine_restarts: int = _opt("times a dead engine process is restarted in place before the server exits "
                                "non-zero (for its supervisor to restart it)", cli="serve", default=3, type=int,
                                group="server")
    max_choices_per_request: int = _opt("engine requests one HTTP request may start: /generate prompts, or "
                                        "completions prompts x n (more: 400)", cli="serve", default=256, type=int,
                                        group="server")
    domains: str = _opt("the values of the metrics' `domain` label (a request's domain outside them counts as "
                        "`other`), comma-separated", cli="serve", default=",".join(DEFAULT_DOMAINS),
                        group="observability")
    # ---- limits on clients (docs/operations.md, "Limits on connections") ---------------------------------------
    max_connections: int = _opt("open client connections at most; more are answered 503 too_many_connections and "
                                "closed (lowered to fit `ulimit -n`, less 320)", cli="serve", default=512, type=int,
                                group="limits")
    header_timeout: float = _opt("seconds a request's headers may take from its first byte (from the connect, for "
                                 "a connection's first request); then 408 and the connection is closed",
                                 cli="serve", default=10.0, type=float, group="limits")
    body_timeout: float = _opt("seconds a request's body may take after its headers; then 408 and the connection "
                               "is closed", cli="serve", default=60.0, type=float, group="limits")
    keep_alive_timeout: int = _opt("seconds an idle keep-alive connection stays open", cli="serve", default=5,
                                   type=int, group="limits")
    max_stream_backlog: int = _opt("committed blocks (and, with stream_denoise, forward events) a streamed request "
                                   "may have waiting for a slow reader; beyond, its stream ends with an error event "
                                   "and the request is ended", cli="serve", default=256, type=int, group="limits")
    send_buffer_bytes: int = _opt("each connection's kernel send buffer (SO_SNDBUF; Linux doubles it) bounds what a "
                                  "slow reader leaves in the kernel; 0: the kernel's autotuning (up to 4 MiB)",
                                  cli="serve", default=256 * 1024, type=int, group="limits")
    engine_heartbeat_timeout: float = _opt(
        "seconds the engine may send nothing (it beats every second when idle; a forward longer than this counts "
        "as hung) before it is killed and restarted: requests in flight get 503, /live is 503 until the new "
        "engine is ready", cli="serve", default=60.0, type=float, group="limits")
    max_request_items: int = _opt("JSON objects one request body may hold (messages, tool calls, content parts, "
                                  "input items ...); more: 400 too_many_items", cli="serve", default=16384,
                                  type=int, group="limits")
    max_forwards_per_token: int = _opt(
        "a request's denoising forwards at most this many per position of the blocks its output may span; "
        "spent, it finishes with `length` and a message naming this flag. The default, 1024 per 32-token block, "
        "only ever stops requests whose dials (max_post_steps, steps, max_steps_per_block) were raised; 0: no "
        "budget", default=32, type=int, group="limits")
    max_trace_changes: int = _opt(
        "recorded token changes per request behind return_step_maps and edit_trace; past it, only first "
        "placements are kept and step_maps carries `truncated` (docs/denoise.md)", default=65536, type=int,
        group="limits")
    allowed_hosts: tuple[str, ...] = _opt(
        "Host header names this server answers (comma-separated or repeated; `*` any, `*.example.com` a domain; IP "
        "literals always); default: the loopback names when --host is a loopback address, else any name",
        cli="serve", default=(), action="append", group="limits")
    log_level: str = _opt("logging level", default="info", choices=LOG_LEVELS, type=str.lower, group="observability")
    # ---- Python only ---------------------------------------------------------------------------------------
    progress: bool = _opt("progress bar while loading weights", cli="", default=True)
    # Benchmark baseline: every forward recomputes the whole prefix (the official generate() without a KV
    # cache). Outputs are the same; only the work differs.
    recompute_prefix: bool = _opt("no KV cache reuse at all (benchmark baseline)", cli="", default=False)
    trace_edits: bool = _opt("record every T2T edit in meta_info['edit_trace']", cli="", default=False)

    def __post_init__(self) -> None:
        if self.default_mode is not None and self.default_mode not in MODES:
            raise ValueError(f"default_mode must be S, Q or auto, got {self.default_mode!r}")
        if self.quantization not in (None, "none", "fp8"):
            raise ValueError(f"unknown quantization {self.quantization!r}: choose fp8 (or none)")
        if self.schedule_policy not in ("fcfs", "lpm"):
            raise ValueError(f"schedule_policy must be fcfs or lpm, got {self.schedule_policy!r}")
        if self.kernel_backend not in KERNEL_BACKENDS:
            raise ValueError(f"unknown kernel backend {self.kernel_backend!r} (choose torch, triton or auto)")
        if self.context_length is not None and self.context_length < 1:
            raise ValueError(f"context_length must be positive, got {self.context_length}")
        if self.log_level.lower() not in LOG_LEVELS:
            raise ValueError(f"log_level must be one of {', '.join(LOG_LEVELS)}, got {self.log_level!r}")
        for name in ("max_connections", "header_timeout", "body_timeout", "keep_alive_timeout", "max_request_items",
                     "max_stream_backlog", "engine_heartbeat_timeout", "max_trace_changes"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.max_forwards_per_token < 0:
            raise ValueError(f"max_forwards_per_token must be 0 or positive, got {self.max_forwards_per_token}")
        if self.send_buffer_bytes < 0:
            raise ValueError(f"send_buffer_bytes must be 0 or positive, got {self.send_buffer_bytes}")
        self.request_defaults()  # range checks

    @property
    def resolved_dtype(self) -> str:
        return self.dtype or ("bfloat16" if self.device == "cuda" else "float32")

    def request_defaults(self) -> Defaults:
        """The operator's level of the defaults chain: only the flags that were given (the request fields declared
        with an `operator_flag`: default_mode, default_max_tokens, mbe_window)."""
        return Defaults(**{name: getattr(self, spec.operator_flag) for name, spec in FIELDS.items()
                           if spec.operator_flag})

    def replace(self, **changes: Any) -> "ServerArgs":
        return dataclasses.replace(self, **changes)

    # ---- command line ------------------------------------------------------------------------------------
    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, groups: tuple[str, ...] = ("engine", "serve")) -> None:
        """The flags of the fields whose `cli` is in `groups`, each in its --help section (cli_group), the sections
        in CLI_GROUPS' order (argparse leaves an empty one out)."""
        for name in CLI_GROUPS:
            cli_group(parser, name)
        for f in dataclasses.fields(cls):
            meta = f.metadata
            if meta.get("cli") not in groups:
                continue
            section = cli_group(parser, meta["group"])
            flag = meta["flag"] or "--" + f.name.replace("_", "-")
            kwargs: dict[str, Any] = {"dest": f.name, "help": meta["help"]}
            for key in ("type", "action"):
                if key in meta:
                    kwargs[key] = meta[key]
            if meta["choices"]:
                kwargs["choices"] = list(meta["choices"])
            if kwargs.get("action") == "append":
                kwargs["default"] = []
            else:
                python_default = f.default if f.default is not dataclasses.MISSING else None
                kwargs["default"] = meta.get("cli_default", python_default)
                if kwargs["default"] is not None and kwargs.get("action") is None:
                    kwargs["help"] += " (default: %(default)s)"
            section.add_argument(flag, *meta["aliases"], **kwargs)

    @classmethod
    def from_cli(cls, args: argparse.Namespace, **overrides: Any) -> "ServerArgs":
        """The fields whose flags add_cli_args registers, read from `args`. Anything else in the namespace is the
        command's own (`redraft generate --seed` is a request's seed): a Python-only field such as `seed` (the
        dummy weights' seed) is never read from a command line, even where a flag shares its name."""
        names = {f.name for f in dataclasses.fields(cls) if f.metadata.get("cli")}
        values = {k: v for k, v in vars(args).items() if k in names}
        for key in ("api_key", "admin_api_key", "allowed_hosts"):
            if key in values:
                values[key] = tuple(values[key] or ())
        return cls(**{**values, **overrides})


def cli_group(parser: argparse.ArgumentParser, name: str) -> Any:
    """The --help section `name` of `parser` (CLI_GROUPS), made on first use."""
    title = CLI_GROUPS[name]
    for existing in parser._action_groups:
        if existing.title == title:
            return existing
    return parser.add_argument_group(title)
