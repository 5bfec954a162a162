"""Logit controls for block diffusion: stutter, frequency, presence and repetition penalties, logit_bias and
min_tokens, applied to the logits of every position a step decides (the open window) before the softmax that
gives the confidences, so the thresholds see the adjusted probabilities. In this order:

1. repetition_penalty p (HF / vLLM): on every token seen in the prompt or the committed output, a positive
   logit is divided by p, a negative one multiplied by p.
2. frequency_penalty f and presence_penalty r (OpenAI): logit -= f * count + r * (count > 0), with count the
   token's occurrences in the request's committed output (its final blocks; not the prompt).
3. stutter_penalty s (SGLang's penalty_lambda): at position i, the logit of the token position i - 1 holds now
   is lowered by s (nothing when i - 1 is a mask; i - 1 may be the previous block's last token or the prompt's).
4. logit_bias (OpenAI): each listed token's logit += its bias (-100 bans it in practice).
5. min_tokens (vLLM): at output positions before min_tokens, EOS and the stop token ids get -inf.
MASK stays excluded whatever the transforms (its logit is -inf before them and stays so).

Every term is a function of the request's own state (its committed output changes only when a block begins, so
the counts are kept per slot and rebuilt then): batching cannot change a request's logits.
"""

from __future__ import annotations

import torch

from redraft.scheduler.request import Request


class LogitControls:
    def __init__(self, vocab_size: int, eos_id: int, device: torch.device):
        self.vocab_size, self.eos_id, self.device = vocab_size, eos_id, device
        # slot -> (Request.row_key, output counts [V] float, seen in prompt or output [V] bool)
        self._rows: dict[int, tuple[tuple[str, int], torch.Tensor, torch.Tensor]] = {}

    def _counts(self, r: Request) -> tuple[torch.Tensor, torch.Tensor]:
        key = r.row_key
        row = self._rows.get(r.book.slot)
        if row is None or row[0] != key:
            b = r.block_size
            output = r.state.tokens[r.prompt_len : max(r.prompt_len, r.state.window_start * b)]  # committed output
            counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=self.vocab_size)
            counts = counts[: self.vocab_size].to(self.device, torch.float64)
            seen = counts > 0
            if r.params.repetition_penalty != 1.0:
                prompt = torch.tensor(r.prompt_ids, dtype=torch.long, device=self.device)
                seen = seen.clone()
                seen[prompt[prompt < self.vocab_size]] = True
            row = self._rows[r.book.slot] = (key, counts, seen)
        return row[1], row[2]

    def apply(self, logits: torch.Tensor, reqs: list[Request], window: torch.Tensor, mask_id: int) -> None:
        """In place on `logits` [N, L, V] (>= fp32); `window` [N, L]: each row's window tokens before the step
        (padding past a window: < 0)."""
        for i, r in enumerate(reqs):
            p = r.params
            if not p.has_logit_controls:
                continue
            row = logits[i]  # [L, V] a view: edits land in `logits`
            dtype = row.dtype
            if p.repetition_penalty != 1.0 or p.frequency_penalty or p.presence_penalty:
                counts, seen = self._counts(r)
                if p.repetition_penalty != 1.0:
                    pen = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
                    row.copy_(torch.where(seen[None, :], pen, row))
                if p.frequency_penalty or p.presence_penalty:
                    row -= (p.frequency_penalty * counts + p.presence_penalty * (counts > 0)).to(dtype)[None, :]
            if p.stutter_penalty:
                start = r.state.window_start * r.block_size
                prev = window[i].roll(1).clone()  # [L] the token at position j - 1, before this step
                prev[0] = r.state.tokens[start - 1] if start > 0 else -1
                ok = (prev >= 0) & (prev != mask_id) & (prev < self.vocab_size)
                pos = ok.nonzero().flatten()
                row[pos, prev[pos]] -= p.stutter_penalty
            if p.logit_bias:
                ids = torch.tensor([t for t, _ in p.logit_bias], dtype=torch.long, device=row.device)
                bias = torch.tensor([v for _, v in p.logit_bias], dtype=dtype, device=row.device)
                row[:, ids] += bias[None, :]
            if p.min_tokens:
                start = r.state.window_start * r.block_size
                out_pos = torch.arange(start, start + row.shape[0], device=row.device) - r.prompt_len  # [L]
                early = (out_pos < p.min_tokens).nonzero().flatten()
                eos = {r.eos_id} if isinstance(r.eos_id, int) else r.eos_id  # every EOS id of the checkpoint
                banned = [t for t in {self.eos_id, *eos, *p.stop_token_ids} if t < self.vocab_size]
                if len(early) and banned:
                    ids = torch.tensor(banned, dtype=torch.long, device=row.device)
                    row[early[:, None], ids[None, :]] = float("-inf")
