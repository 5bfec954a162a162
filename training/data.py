"""From task examples to training batches: the demo tokenizer, block-aligned sequences, the two noise streams
(drafting: mask; editing: random replacements) and the BD3-LM dual-copy layout with its attention mask.

A training sequence is `prompt (chat template, generation prompt opened) + answer + EOS`, padded with EOS to
a whole number of 32-token blocks, exactly what the engine decodes: the prompt's last partial block is shared
with the first answer tokens, and the tail of the last block is EOS. Only the response part (everything
after the prompt) is ever noised or scored.

Dual copy (one forward trains every block as if the blocks before it were final, as they are at inference):
the model sees `[x_t | x_0[: S - 32]]`, a noisy copy of all S positions followed by a clean copy of every
block but the last (no noisy query ever needs the clean last block). Both copies carry the same absolute
positions. Visibility, with i and j the blocks of query and key:
    noisy query -> noisy key  iff i == j      (the block being denoised, bidirectional)
    noisy query -> clean key  iff j <  i      (earlier blocks, final)
    clean query -> clean key  iff j <= i      (the engine's block-causal rule on final tokens)
    clean query -> noisy key  never
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from functools import lru_cache

import torch
from tokenizers import Regex, pre_tokenizers
from tokenizers import Tokenizer as _HFTokenizer

from redraft.engine.model.config import BLOCK_SIZE
from redraft.engine.text.tokenizer import LLADA2_SPECIAL_TOKENS, Tokenizer
from redraft.training.bpe import build_bpe_tokenizer
from redraft.training.tasks import CHAT_TEMPLATES, FAMILIES, Example, render_prompt, sample

DEMO_VOCAB_SIZE = 1024


# ----- tokenizer ---------------------------------------------------------------------------------------
def tokenizer_corpus(seed: int = 0, n: int = 30_000, number_repeats: int = 300) -> list[str]:
    """Text the demo BPE is trained on: rendered train-split conversations plus lists of every number.

    Reverse words and animal names are left out on purpose: they are copied letter by letter, so they should
    stay in small pieces (a held-out animal is then made of the same pieces as the trained ones, instead of
    being one never-trained token). Every number 0..198 (answers, no space) and 0..99 (operands, after a
    space) becomes one token thanks to the repeated number lists.
    """
    rng = random.Random(seed)
    out: list[str] = []
    for i in range(n):
        family = FAMILIES[i % len(FAMILIES)]
        ex = sample(family, "train", rng)
        prompt, answer = render_prompt(ex), ex.answer
        if family == "reverse":
            prompt, answer = prompt.replace(ex.user, "Reverse the word:"), ""
        elif family == "chat":
            prompt = prompt.replace(ex.user, "Tell me about the.")
            answer = " ".join(t.format(x="") for t in CHAT_TEMPLATES)
        out.append(prompt + answer + "<|endoftext|>")
    for _ in range(number_repeats):
        out.append(" ".join(str(k) for k in range(100)))  # " 7", " 42": operands and list items
        out.append("\n".join(str(k) for k in range(199)))  # "42", "-" "42", "197": answers
    return out


def build_demo_tokenizer(vocab_size: int = DEMO_VOCAB_SIZE, seed: int = 0, digits: bool = False) -> _HFTokenizer:
    """Byte-level BPE with LLaDA2's special tokens, trained on task text (deterministic).

    digits=True: numbers are split into single digits (the leading space stays with the first one: ` 47` ->
    `Ġ4` `7`), so that arithmetic works digit by digit, as in LLaMA-style tokenizers.
    """
    if not digits:
        return build_bpe_tokenizer(tokenizer_corpus(seed), vocab_size, LLADA2_SPECIAL_TOKENS)
    tok = build_bpe_tokenizer(tokenizer_corpus(seed, number_repeats=0), vocab_size, LLADA2_SPECIAL_TOKENS)
    # Merges are learned with the plain byte-level split; isolating digits first means no merge ever joins two
    # digits (the few multi-digit merges learned stay unused), while ` 4` (space + digit) still merges.
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r" ?\d"), "isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    return tok


# ----- sequences ---------------------------------------------------------------------------------------
@dataclass
class Sequence:
    ids: list[int]  # prompt + answer + EOS, EOS-padded to whole blocks
    prompt_len: int
    answer_len: int  # answer tokens + the first EOS
    family: str
    alt: list[int] | None = None  # another correct answer at the same positions (chat), for realistic noise

    @property
    def num_blocks(self) -> int:
        return len(self.ids) // BLOCK_SIZE


def encode_example(ex: Example, tok: Tokenizer, rng: random.Random | None = None) -> Sequence:
    prompt = tok.encode(render_prompt(ex, tok))
    answer = tok.encode(ex.answer) + [tok.eos_token_id]
    ids = prompt + answer
    nb = math.ceil(len(ids) / BLOCK_SIZE)
    ids = ids + [tok.eos_token_id] * (nb * BLOCK_SIZE - len(ids))
    alt = None
    others = [a for a in ex.answers if a != ex.answer]
    if others:
        pick = (rng or random).choice(others)
        alt_ids = prompt + tok.encode(pick) + [tok.eos_token_id]
        alt = (alt_ids + [tok.eos_token_id] * len(ids))[: len(ids)]
    return Sequence(ids, len(prompt), len(answer), ex.family, alt)


# ----- dual-copy attention mask -----------------------------------------------------------------------
@lru_cache(maxsize=16)
def dual_copy_mask(num_blocks: int, block_size: int = BLOCK_SIZE) -> torch.Tensor:
    """[L, L] bool (True = may attend), L = (2 * num_blocks - 1) * block_size; see the module docstring."""
    s = num_blocks * block_size
    c = (num_blocks - 1) * block_size
    blk = torch.cat([torch.arange(s), torch.arange(c)]) // block_size  # [L] block of every token
    noisy = torch.cat([torch.ones(s, dtype=torch.bool), torch.zeros(c, dtype=torch.bool)])  # [L]
    qb, kb = blk[:, None], blk[None, :]
    qn, kn = noisy[:, None], noisy[None, :]
    return (qn & kn & (kb == qb)) | (qn & ~kn & (kb < qb)) | (~qn & ~kn & (kb <= qb))


def dual_copy_positions(num_blocks: int, block_size: int = BLOCK_SIZE) -> torch.Tensor:
    s = num_blocks * block_size
    return torch.cat([torch.arange(s), torch.arange(s - block_size)])


# ----- batches ----------------------------------------------------------------------------------------
@dataclass
class Bucket:
    """All sequences of one batch that have the same number of blocks, as tensors."""

    num_blocks: int
    x0: torch.Tensor  # [B, S] clean tokens
    alt: torch.Tensor  # [B, S] an alternative correct sequence (= x0 where there is none)
    response: torch.Tensor  # [B, S] bool: positions after the prompt
    weight: torch.Tensor  # [B, S] float: loss weight of each response position
    content: torch.Tensor  # [B, S] bool: answer tokens and the first EOS
    family: list[str]

    @property
    def size(self) -> int:
        return self.x0.shape[0]


def make_buckets(seqs: list[Sequence], eos_tail_weight: float = 1.0) -> list[Bucket]:
    """Group sequences by block count. Loss weights: 1 for every answer token and the first EOS; the EOS
    padding after it shares `eos_tail_weight` in total (enough to learn that the tail is EOS, without
    letting dozens of easy pad targets drown the content)."""
    groups: dict[int, list[Sequence]] = {}
    for s in seqs:
        groups.setdefault(s.num_blocks, []).append(s)
    out = []
    for nb in sorted(groups):
        g = groups[nb]
        x0 = torch.tensor([s.ids for s in g], dtype=torch.long)
        alt = torch.tensor([s.alt if s.alt is not None else s.ids for s in g], dtype=torch.long)
        pos = torch.arange(x0.shape[1])[None, :]
        p = torch.tensor([s.prompt_len for s in g])[:, None]
        a = torch.tensor([s.answer_len for s in g])[:, None]
        response = pos >= p
        content = response & (pos < p + a)
        tail = response & ~content
        n_tail = tail.sum(1, keepdim=True).clamp(min=1)
        weight = content.float() + tail.float() * (eos_tail_weight / n_tail)
        out.append(Bucket(nb, x0, alt, response, weight, content, [s.family for s in g]))
    return out


@dataclass
class Noise:
    """The noisy input of one bucket and where its loss is taken."""

    xt: torch.Tensor  # [B, S]
    scored: torch.Tensor  # [B, S] bool: positions that carry a loss
    masked: torch.Tensor  # [B, S] bool
    corrupted: torch.Tensor  # [B, S] bool: replaced by a wrong token


def add_noise(b: Bucket, mask_id: int, noise_vocab: torch.Tensor, gen: torch.Generator, *,
              p_edit: float, max_edit_rate: float) -> Noise:
    """Drafting stream for every sequence: each response token is masked with probability t ~ U(0, 1]
    (at least one). Editing stream for a fraction p_edit of the sequences: of the tokens left visible, a
    fraction r ~ U(0, max_edit_rate] is replaced by a wrong token (a random vocabulary token, a token from
    elsewhere in the answer, or the token of another correct answer at that position); those sequences are
    scored at every response position (recover the originals, keep what is right), the others at their
    masked positions only."""
    x0, resp = b.x0, b.response
    bsz, s = x0.shape
    u = lambda *shape: torch.rand(*shape, generator=gen)  # noqa: E731
    t = 1.0 - u(bsz, 1)  # (0, 1]
    masked = resp & (u(bsz, s) < t)
    # At least one masked position per sequence: pick a random response position where none was drawn.
    none = ~masked.any(1)
    if none.any():
        pick = torch.multinomial(resp[none].float(), 1, generator=gen)  # [n, 1]
        masked[none] = masked[none].scatter(1, pick, True)
    edit_rows = u(bsz, 1) < p_edit
    rate = u(bsz, 1) * max_edit_rate
    corrupt = resp & ~masked & edit_rows & (u(bsz, s) < rate)
    # Wrong tokens: 1/3 random vocabulary, 1/3 the answer's own tokens shifted, 1/3 another correct answer.
    kind = torch.randint(0, 3, (bsz, s), generator=gen)
    rand_tok = noise_vocab[torch.randint(0, len(noise_vocab), (bsz, s), generator=gen)]
    shift = torch.randint(1, 4, (bsz, 1), generator=gen) * torch.where(u(bsz, 1) < 0.5, -1, 1)
    idx = (torch.arange(s)[None, :] + shift).clamp(0, s - 1)
    shifted = x0.gather(1, idx)
    repl = torch.where(kind == 0, rand_tok, torch.where(kind == 1, shifted, b.alt))
    repl = torch.where(repl == x0, rand_tok, repl)  # the replacement must be wrong
    corrupt &= repl != x0
    xt = torch.where(masked, torch.full_like(x0, mask_id), torch.where(corrupt, repl, x0))
    scored = torch.where(edit_rows, resp, masked)
    return Noise(xt, scored, masked, corrupt)


# ----- multi-block-editing windows ---------------------------------------------------------------------
def window_mask(num_blocks: int, window_start: int, active: int, block_size: int = BLOCK_SIZE) -> torch.Tensor:
    """[L, L] bool (True = may attend), L = num_blocks * block_size: the engine's attention rule for an open
    window [window_start, active] (docs/mbe.md): committed blocks block-causal, the window bidirectional inside
    itself and seeing every committed block. The engine's own rule function builds it."""
    from redraft.kernels.attention import visible

    pos = torch.arange(num_blocks * block_size)
    return visible(pos[:, None], pos[None, :], block_size, window_start * block_size, active)


@dataclass
class WindowExample:
    """One sequence cut at the end of its active block, noised as the engine sees it under multi-block editing:
    committed blocks clean, earlier window blocks complete but partly wrong, the active block partly masked."""

    xt: torch.Tensor  # [L] noisy input, L = (active + 1) * 32
    x0: torch.Tensor  # [L] clean tokens
    scored: torch.Tensor  # [L] bool: the window's response positions
    weight: torch.Tensor  # [L] loss weight
    content: torch.Tensor  # [L] bool: answer tokens and the first EOS
    family: str
    window_start: int
    active: int


def window_examples(b: Bucket, rows: torch.Tensor, mask_id: int, noise_vocab: torch.Tensor, gen: torch.Generator,
                    *, max_window: int, p_edit: float, max_edit_rate: float) -> list[WindowExample]:
    """For each chosen row of the bucket: an active block uniform over its response blocks, a window W uniform
    in 1..max_window, and the noise: wrong tokens (random, shifted, another correct answer's) at a rate
    r ~ U(0, max_edit_rate] in the window's earlier blocks, so that the model learns to repair a block from
    the blocks after it; masks at a rate t ~ U(0, 1] in the active block (at least one), plus wrong tokens
    among its visible ones for a share p_edit of the rows. Scored at every response position of the window."""
    out = []
    u = lambda: float(torch.rand((), generator=gen))  # noqa: E731
    for r in rows.tolist():
        resp = b.response[r]
        first = int(resp.nonzero()[0]) // BLOCK_SIZE  # b0: the block holding the first response position
        active = first + int(torch.randint(0, b.num_blocks - first, (), generator=gen))
        start = max(first, active - int(torch.randint(0, max_window, (), generator=gen)))
        end = (active + 1) * BLOCK_SIZE
        x0 = b.x0[r, :end]
        window = torch.zeros(end, dtype=torch.bool)
        window[start * BLOCK_SIZE :] = True
        window &= resp[:end]
        in_active = window.clone()
        in_active[: active * BLOCK_SIZE] = False
        masked = in_active & (torch.rand(end, generator=gen) < 1.0 - u())
        if not masked.any():
            masked[int(in_active.nonzero()[int(torch.randint(0, int(in_active.sum()), (), generator=gen))])] = True
        rate = u() * max_edit_rate
        earlier = window & ~in_active
        corrupt = (earlier | (in_active & ~masked & (u() < p_edit))) & (torch.rand(end, generator=gen) < rate)
        kind = torch.randint(0, 3, (end,), generator=gen)
        rand_tok = noise_vocab[torch.randint(0, len(noise_vocab), (end,), generator=gen)]
        shift = int(torch.randint(1, 4, (), generator=gen)) * (1 if u() < 0.5 else -1)
        shifted = x0[(torch.arange(end) + shift).clamp(0, end - 1)]
        repl = torch.where(kind == 0, rand_tok, torch.where(kind == 1, shifted, b.alt[r, :end]))
        repl = torch.where(repl == x0, rand_tok, repl)
        corrupt &= repl != x0
        xt = torch.where(masked, torch.full_like(x0, mask_id), torch.where(corrupt, repl, x0))
        out.append(WindowExample(xt, x0, window, b.weight[r, :end], b.content[r, :end], b.family[r], start, active))
    return out
