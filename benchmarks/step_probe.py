"""What the step benchmarks share: the routing under test, the experts a forward touches, the per-kernel roofline
floor and the per-kernel-class breakdown of a replayed step.

Routing (`--routing`):
    model    the model's own router (with dummy weights and a block of identical MASK embeddings this collapses to
             ~23-29 experts per layer at batch 1: not what a trained model does on real text);
    uniform  the router still runs (its GEMM and selection kernel are timed), but every token's top-k ids are
             replaced by a fixed random assignment of k distinct experts, drawn once per layer and sliced by the
             token count (a view: capturable in a CUDA graph, the same ids every replay). Forwards longer than
             the largest denoising batch (prefill) keep the model's routing.
Blocks (`--block`): mask = the block as the engine opens it (all MASK); random = the block's tokens replaced by
random ordinary tokens (a mid-decoding block).

The floor is a roofline per kernel class: max(bytes / bandwidth, FLOPs / matmul rate) for each class, summed, so
a compute-bound class (batch 64's lm_head and projections) is counted at its FLOPs, not its bytes.
"""

from __future__ import annotations

import re
from contextlib import contextmanager

import torch

BLOCK = 32
ROUTINGS = ("model", "uniform")
BLOCKS = ("mask", "random")


# ---- routing ------------------------------------------------------------------------------------------
class RoutingProbe:
    """Wraps the Triton router (`moe_triton.route_layer_triton`): optionally replaces ids by a fixed uniform
    assignment, optionally records the ids each MoE layer used (for the experts-touched count)."""

    def __init__(self, mode: str, max_tokens: int, seed: int = 0):
        if mode not in ROUTINGS:
            raise ValueError(f"routing {mode!r}: choose {ROUTINGS}")
        self.mode, self.max_tokens, self.seed = mode, max_tokens, seed
        self.tables: dict[int, torch.Tensor] = {}  # id(moe) -> [max_tokens, k] ids
        self.recorded: list[torch.Tensor] | None = None  # ids per MoE layer call while recording

    def table(self, moe, device) -> torch.Tensor:
        key = id(moe)
        if key not in self.tables:  # drawn on the CPU (fixed across devices), k distinct experts per token
            c = moe.cfg
            g = torch.Generator().manual_seed(self.seed * 1000 + len(self.tables))
            order = torch.rand(self.max_tokens, c.num_experts, generator=g).argsort(dim=1)
            self.tables[key] = order[:, : c.num_experts_per_tok].contiguous().to(device)
        return self.tables[key]

    def wrap(self, route):
        def routed(moe, x, labels):
            ids, weights = route(moe, x, labels)  # [T, k] each: the router always runs
            if self.mode == "uniform" and x.shape[0] <= self.max_tokens:  # (longer: prefill, the model's routing)
                ids = self.table(moe, x.device)[: x.shape[0]].to(ids.dtype)
            if self.recorded is not None:
                self.recorded.append(ids.detach().clone())
            return ids, weights

        return routed

    @contextmanager
    def recording(self):
        """Collect each MoE layer's ids during the forwards run inside (eager)."""
        self.recorded = []
        try:
            yield self.recorded
        finally:
            self.recorded = None


@contextmanager
def routing(mode: str, max_tokens: int, seed: int = 0):
    """Install a RoutingProbe for the Triton MoE for the duration (engines built inside capture it)."""
    from redraft.kernels import moe_triton as mt

    probe = RoutingProbe(mode, max_tokens, seed)
    saved = mt.route_layer_triton
    mt.route_layer_triton = probe.wrap(saved)
    try:
        yield probe
    finally:
        mt.route_layer_triton = saved


def experts_touched(ids_per_layer: list[torch.Tensor], n_experts: int) -> list[int]:
    """Distinct routed experts per MoE layer call (ids -1, other ranks' experts, left out)."""
    out = []
    for ids in ids_per_layer:
        u = torch.unique(ids)
        out.append(int(((u >= 0) & (u < n_experts)).sum()))
    return out


def randomize_blocks(items, vocab: int, avoid: set[int], seed: int) -> None:
    """Replace each decoding item's active block with random ordinary tokens (`--block random`)."""
    g = torch.Generator().manual_seed(seed)
    for it in items:
        start, end = it.first * BLOCK, (it.last + 1) * BLOCK
        toks = it.req.state.tokens
        for pos in range(start, end):
            t = int(torch.randint(0, vocab, (1,), generator=g))
            while t in avoid:
                t = (t + 1) % vocab
            toks[pos] = t


# ---- the roofline floor -------------------------------------------------------------------------------
def step_roofline(cfg, batch: int, context: int, touched: list[float] | float, *, bw: float, peak: float,
                  wbytes: int = 2, fp8: bool = False) -> dict:
    """Per kernel class of one denoising forward (N = batch requests, one 32-token block each, behind `context`
    tokens): bytes it must move, FLOPs, and max(bytes / bw, FLOPs / peak) in ms. `touched`: routed experts per
    MoE layer (measured), or one number for every layer. fp8: quantised linears move 1 byte per weight and run
    at twice `peak`. Left out: norms, embedding rows, activations between kernels (small at these shapes)."""
    h, d, v = cfg.hidden_size, cfg.head_dim, cfg.vocab_size
    nq, nkv, layers = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.num_hidden_layers
    n_dense = min(cfg.first_k_dense_replace, layers)
    n_moe = layers - n_dense
    e, k, inter = cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size
    tokens = batch * BLOCK
    touched_list = touched if isinstance(touched, list) else [float(touched)] * n_moe
    qbytes = 1 if fp8 else wbytes
    qpeak = 2 * peak if fp8 else peak
    proj = h * (nq + 2 * nkv) * d + nq * d * h  # qkv + o_proj weights per layer
    dense = 3 * h * cfg.intermediate_size
    expert = 3 * h * inter
    kv_token = 2 * nkv * d * wbytes
    classes = {
        "attention": (layers * (batch * (context + BLOCK) * kv_token + tokens * kv_token),
                      layers * 4 * tokens * (context + BLOCK) * nq * d, peak),
        "gemms": ((layers * proj + n_dense * dense + n_moe * expert * cfg.num_shared_experts) * qbytes,
                  2 * tokens * (layers * proj + n_dense * dense + n_moe * expert * cfg.num_shared_experts), qpeak),
        "router": (n_moe * e * h * 4, 2 * tokens * n_moe * e * h, peak / 16),  # fp32 router GEMM (no tensor cores)
        "moe": (sum(touched_list) * expert * qbytes, 2 * tokens * n_moe * k * expert, qpeak),
        "lm_head": (v * h * wbytes, 2 * tokens * v * h, peak),
    }
    out = {}
    for name, (nbytes, flops, rate) in classes.items():
        out[name] = {"bytes": nbytes, "flops": flops, "ms": max(nbytes / bw, flops / rate) * 1e3,
                     "bound": "compute" if flops / rate > nbytes / bw else "memory"}
    out["total_ms"] = sum(c["ms"] for c in out.values() if isinstance(c, dict))
    out["total_bytes"] = sum(c["bytes"] for c in out.values() if isinstance(c, dict))
    out["experts_touched"] = sum(touched_list) / max(1, len(touched_list))
    return out


# ---- per-kernel-class breakdown (torch.profiler) -------------------------------------------------------
KERNEL_CLASSES = [  # first match wins; names of Triton kernels here, cuBLAS/CUTLASS/ATen names after
    ("attention", r"attn|attention|flash|split_kv|sdpa"),
    ("moe", r"moe|_route|_block_route|_silu_mul|_align|_quant_act"),  # (_quant_act: the FP8 experts' input)
    ("norms/rotary", r"rms|norm|rope|rotary"),
    ("lm_head/top-1", r"top1|vocab"),
    ("gemms", r"gemm|gemv|cutlass|xmma|nvjet|sm90_|cublas|matmul|addmm|\bmm\b|aten::mm|aten::addmm|splitk"),
    ("elementwise", r"elementwise|vectorized|unrolled|reduce|copy|fill|index|cat|aten::"),
]


def kernel_class(name: str) -> str:
    low = name.lower()
    for cls, pattern in KERNEL_CLASSES:
        if re.search(pattern, low):
            return cls
    return "other"


def profile_classes(fn, iters: int, device: torch.device) -> dict:
    """Run fn() `iters` times under torch.profiler; device time (us per call) and kernel count per call for each
    class. On CPU (dry runs) the CPU ops stand in for kernels: the flow is checked, nothing is measured."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    fn()  # warm
    if cuda:
        torch.cuda.synchronize()
    acts = [ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    with profile(activities=acts) as prof:
        for _ in range(iters):
            fn()
        if cuda:
            torch.cuda.synchronize()
    classes: dict[str, dict] = {}
    for ev in prof.events():
        if cuda and ev.device_type != torch.autograd.DeviceType.CUDA:
            continue
        if not cuda and (not ev.name.startswith("aten::") or ev.cpu_parent is not None):
            continue  # top-level aten ops only on CPU
        us = (ev.device_time_total if cuda else ev.cpu_time_total) if hasattr(ev, "device_time_total") else \
            ev.cuda_time_total
        row = classes.setdefault(kernel_class(ev.name), {"us": 0.0, "kernels": 0})
        row["us"] += us / iters
        row["kernels"] += 1
    for row in classes.values():
        row["kernels"] /= iters
    classes["total"] = {"us": sum(r["us"] for r in classes.values()),
                        "kernels": sum(r["kernels"] for r in classes.values())}
    return classes


def subtract(step: dict, forward: dict) -> dict:
    """The decision (and host-launched work) of a step: the step's classes minus the replayed forward's."""
    out = {}
    for cls in set(step) | set(forward):
        a, b = step.get(cls, {"us": 0.0, "kernels": 0}), forward.get(cls, {"us": 0.0, "kernels": 0})
        out[cls] = {"us": a["us"] - b["us"], "kernels": a["kernels"] - b["kernels"]}
    return out
