"""Runs one forward for a whole batch of request windows and applies the decoding step to every request.

Owns the model and the KV cache tensors (pages are allocated by the scheduler's PagePool; this class only
reads/writes the rows the page ids point at).
"""

from __future__ import annotations

import logging
import torch

from redraft.engine.config import BLOCK_SIZE, ModelConfig
from redraft.engine.decoding import SamplingBatch, StepResult, joint_threshold_step
from redraft.engine.model import LLaDA2Model
from redraft.kernels.attention import AttentionMetadata
from redraft.scheduler.request import Request
from redraft.scheduler.scheduler import DecodeOutput, WorkItem

log = logging.getLogger("redraft.runner")


class ModelRunner:
    def __init__(self, model: LLaDA2Model, num_pages: int, mask_id: int, device: str | torch.device,
                 cuda_graph_max_bs: int = 0):
        cfg: ModelConfig = model.cfg
        self.model = model
        self.cfg = cfg
        self.device = torch.device(device)
        self.mask_id = mask_id
        self.block_size = BLOCK_SIZE
        dtype = next(model.parameters()).dtype
        # One page beyond the scheduler's pages 0..num_pages-1: the scratch page that padded batch rows
        # (CUDA graphs) write to and read from; no request ever owns it.
        self.scratch_page = num_pages
        shape = (cfg.num_hidden_layers, num_pages + 1, BLOCK_SIZE, cfg.num_key_value_heads, cfg.head_dim)
        self.k_cache = torch.zeros(shape, dtype=dtype, device=self.device)  # [L, P + 1, B, Hkv, D]
        self.v_cache = torch.zeros(shape, dtype=dtype, device=self.device)
        log.info(
            "KV cache: %d pages x %d tokens (%.1f MiB)",
            num_pages, BLOCK_SIZE, 2 * self.k_cache.numel() * self.k_cache.element_size() / 2**20,
        )
        self.graphs = None  # DecodeGraphs when the denoising step runs as CUDA graphs
        self.graph_error: str | None = None  # why capture failed (the step then runs eagerly)
        if cuda_graph_max_bs > 0:
            if self.device.type != "cuda" or model.kernel_backend != "triton":
                raise ValueError("CUDA graphs need device='cuda' and kernel_backend='triton'")
            from redraft.engine.cuda_graphs import DecodeGraphs

            graphs = DecodeGraphs(self, cuda_graph_max_bs)
            try:
                graphs.capture()
                self.graphs = graphs
            except Exception as exc:  # noqa: BLE001 - serve eagerly rather than not at all
                self.graph_error = f"{type(exc).__name__}: {exc}"
                log.warning("CUDA graph capture failed, the denoising step runs eagerly: %s", self.graph_error)
                torch.cuda.synchronize(self.device)

    @staticmethod
    def kv_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype) -> int:
        return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * torch.finfo(dtype).bits // 8

    @torch.inference_mode()
    def run(self, items: list[WorkItem]) -> DecodeOutput:
        if self.graphs is not None and self.graphs.can_run(items):
            logits = self.graphs.run(items)  # [N, B, V]: every item decodes its one active block
            decoding = list(range(len(items)))
        else:
            logits, decoding = self._forward_eager(items)
            if not decoding:
                return DecodeOutput()
        reqs = [items[i].req for i in decoding]
        result = self._step(logits, reqs)
        out = DecodeOutput(
            tokens=result.tokens.tolist(),
            had_mask=result.had_mask.tolist(),
            m2t=result.m2t.sum(-1).tolist(),
            t2t=result.t2t.sum(-1).tolist(),
        )
        wants = [r.params.params.logprobs or r.params.params.top_logprobs > 0 for r in reqs]
        if any(wants):
            self._logprobs(logits, result.tokens, reqs, wants, out)
        return out

    def _forward_eager(self, items: list[WorkItem]) -> tuple[torch.Tensor | None, list[int]]:
        """Any batch: one forward over every item's window; logits [N, B, V] of the decoding items' blocks."""
        b = self.block_size
        q_starts, q_lens, tables, ids = [], [], [], []
        for it in items:
            start, end = it.first * b, (it.last + 1) * b
            q_starts.append(start)
            q_lens.append(end - start)
            tables.append(it.req.pages[: it.last + 1])
            ids.extend(it.req.tokens[start:end])
        meta = AttentionMetadata.build(q_starts, q_lens, tables, b, self.device,
                                       with_torch_plan=self.model.kernel_backend == "torch")
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        hidden = self.model(input_ids, meta, self.k_cache, self.v_cache)  # [T, H]

        decoding = [i for i, it in enumerate(items) if it.decodes]
        if not decoding:
            return None, decoding
        ends = meta.cu_q[1:][decoding]  # [N] flat end of each decoding window = end of its active block
        rows = ends[:, None] - b + torch.arange(b, device=self.device)[None, :]  # [N, B]
        return self.model.logits(hidden[rows]), decoding  # [N, B, V]

    @staticmethod
    def _logprobs(logits: torch.Tensor, tokens: torch.Tensor, reqs: list[Request], wants: list[bool],
                  out: DecodeOutput) -> None:
        """Log-probabilities of the block's tokens after the step, under this forward's raw distribution
        (no temperature or filtering; MASK excluded), and the top alternatives where asked."""
        rows = [i for i, w in enumerate(wants) if w]
        lp = torch.log_softmax(logits[rows], -1)  # [n, B, V]
        chosen = lp.gather(-1, tokens[rows][..., None]).squeeze(-1).tolist()  # [n, B]
        k = max(reqs[i].params.params.top_logprobs for i in rows)
        top_v, top_i = lp.topk(k, -1) if k else (None, None)
        out.logprobs = [None] * len(reqs)
        out.top_logprobs = [None] * len(reqs)
        for j, i in enumerate(rows):
            out.logprobs[i] = chosen[j]
            ki = reqs[i].params.params.top_logprobs
            if ki and top_v is not None:
                ids, vals = top_i[j, :, :ki].tolist(), top_v[j, :, :ki].tolist()
                out.top_logprobs[i] = [list(zip(a, b)) for a, b in zip(ids, vals)]
            else:
                out.top_logprobs[i] = [[] for _ in range(len(chosen[j]))]

    def _step(self, logits: torch.Tensor, reqs: list[Request]) -> StepResult:
        dev = self.device
        block = torch.tensor([r.active_tokens() for r in reqs], dtype=torch.long, device=dev)  # [N, B]
        editable = torch.tensor([r.editable_mask() for r in reqs], dtype=torch.bool, device=dev)
        threshold = torch.tensor([r.params.threshold for r in reqs], dtype=torch.float64, device=dev)
        edit_threshold = torch.tensor([r.params.edit_threshold for r in reqs], dtype=torch.float64, device=dev)
        sampling = None
        if any(r.params.params.temperature > 0 for r in reqs):
            p = [r.params.params for r in reqs]
            sampling = SamplingBatch(
                temperature=torch.tensor([x.temperature for x in p], dtype=torch.float64, device=dev),
                top_k=torch.tensor([x.top_k for x in p], dtype=torch.long, device=dev),
                top_p=torch.tensor([x.top_p for x in p], dtype=torch.float64, device=dev),
                seeds=torch.tensor([x.seed or 0 for x in p], dtype=torch.long, device=dev),
                steps=torch.tensor([r.stats.steps for r in reqs], dtype=torch.long, device=dev),
                positions=torch.tensor(
                    [[r.active_block * self.block_size + i for i in range(self.block_size)] for r in reqs],
                    dtype=torch.long, device=dev,
                ),
            )
        return joint_threshold_step(logits, block, editable, threshold, edit_threshold, self.mask_id, sampling)
