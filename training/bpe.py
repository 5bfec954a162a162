"""Training byte-level BPE tokenizers for the checkpoints redraft makes itself: the demo model's
(training/data.py) and the tiny test checkpoints' (frozen into engine/model/tiny_tokenizer.json, which the engine
loads without training anything).

    python -m redraft.training.bpe --write-tiny      # retrain the tiny tokenizer and rewrite that file
"""

from __future__ import annotations

import argparse
import random
import sys
from collections.abc import Iterable, Sequence

from tokenizers import AddedToken, decoders, models, pre_tokenizers, trainers
from tokenizers import Tokenizer as _HFTokenizer

from redraft.engine.model.tiny import TINY_TOKENIZER_FILE, TINY_TOKENIZER_VOCAB
from redraft.engine.text.tokenizer import LLADA2_SPECIAL_TOKENS


def build_bpe_tokenizer(corpus: Iterable[str], vocab_size: int,
                        special_tokens: Sequence[str] = LLADA2_SPECIAL_TOKENS) -> _HFTokenizer:
    """Train a byte-level BPE like LLaDA2's (no BOS/EOS added) on `corpus`.

    `vocab_size` counts the special tokens and the 256 byte symbols; a small corpus may stop short of it.
    Special tokens get the lowest ids and are matched whole in any text, so chat-formatted training text
    never has its markers split into merges.
    """
    base = 256 + len(special_tokens)
    if vocab_size < base:
        raise ValueError(f"vocab_size must be at least {base} (256 bytes + {len(special_tokens)} special tokens)")
    tok = _HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    specials = [AddedToken(t, special=True, normalized=False) for t in special_tokens]
    # Registering them before training makes the trainer skip them in the corpus.
    tok.add_special_tokens(specials)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        show_progress=False,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte encodable: no unknown tokens
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    return tok


# ----- the tiny checkpoints' tokenizer -----
_WORDS = {
    "det": ["the", "a", "this", "that", "every", "one", "some", "no"],
    "adj": ["small", "quiet", "bright", "old", "green", "fast", "warm", "heavy", "simple", "strange", "happy",
            "dark", "clever", "gentle", "broken", "golden"],
    "noun": ["cat", "river", "machine", "garden", "teacher", "city", "model", "bird", "engine", "letter",
             "window", "story", "market", "number", "forest", "question", "tower", "friend", "token", "block"],
    "verb": ["sees", "finds", "builds", "moves", "likes", "writes", "opens", "follows", "answers", "carries",
             "counts", "draws", "remembers", "changes", "reads", "keeps"],
    "adv": ["slowly", "quickly", "often", "never", "again", "today", "carefully", "together", "almost", "always"],
    "prep": ["near", "under", "behind", "over", "inside", "beside", "across", "after", "before", "with"],
}
_QUESTIONS = ["What is the capital of France?", "How many legs does a spider have?", "Write a short poem.",
              "Explain why the sky is blue.", "What is 17 times 23?", "Hello! How are you today?",
              "Translate 'good morning' into German.", "List three prime numbers."]


def tiny_corpus(n_sentences: int = 400, seed: int = 1234) -> list[str]:
    """A small deterministic English-ish corpus (sentences from a toy grammar, numbers, some code)."""
    rng = random.Random(seed)
    w = _WORDS
    out: list[str] = []
    for i in range(n_sentences):
        kind = i % 5
        if kind == 0:
            s = f"{rng.choice(w['det']).capitalize()} {rng.choice(w['adj'])} {rng.choice(w['noun'])} " \
                f"{rng.choice(w['verb'])} {rng.choice(w['det'])} {rng.choice(w['noun'])} {rng.choice(w['adv'])}."
        elif kind == 1:
            s = f"{rng.choice(w['det']).capitalize()} {rng.choice(w['noun'])} {rng.choice(w['prep'])} " \
                f"{rng.choice(w['det'])} {rng.choice(w['adj'])} {rng.choice(w['noun'])} is {rng.choice(w['adj'])}, " \
                f"and it {rng.choice(w['verb'])} {rng.randint(2, 999)} {rng.choice(w['noun'])}s."
        elif kind == 2:
            a, b = rng.randint(1, 99), rng.randint(1, 99)
            s = f"Question: what is {a} plus {b}? Answer: {a + b}."
        elif kind == 3:
            s = f"def {rng.choice(w['verb'])}_{rng.choice(w['noun'])}(x):\n    return x + {rng.randint(0, 9)}\n"
        else:
            s = rng.choice(_QUESTIONS) + " " + f"The {rng.choice(w['noun'])} {rng.choice(w['verb'])} it."
        out.append(s)
    return out


def train_tiny_tokenizer() -> str:
    """The tiny checkpoints' tokenizer as JSON, trained from scratch (deterministic for a fixed corpus):
    what engine/model/tiny_tokenizer.json must hold."""
    return build_bpe_tokenizer(tiny_corpus(), TINY_TOKENIZER_VOCAB).to_str(pretty=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m redraft.training.bpe", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--write-tiny", action="store_true", help=f"retrain and rewrite {TINY_TOKENIZER_FILE.name}")
    args = p.parse_args(argv)
    if not args.write_tiny:
        p.print_help()
        return 0
    TINY_TOKENIZER_FILE.write_text(train_tiny_tokenizer() + "\n", encoding="utf-8")
    print(f"wrote {TINY_TOKENIZER_FILE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
