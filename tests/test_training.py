"""The demo-model training machinery: task generator, dual-copy mask, a training step, export -> Engine."""

from __future__ import annotations

import random
import re

import pytest
import torch

from redraft.engine.model.config import BLOCK_SIZE
from redraft.kernels.attention import block_causal_visible
from redraft.training import tasks
from redraft.training.data import (add_noise, dual_copy_mask, dual_copy_positions, encode_example,
                                   make_buckets)
from redraft.training.tasks import FAMILIES, TaskGenerator, eval_set, sample, split_of

# A model small enough for a CPU test; the same architecture family as the demo (MoE with grouped routing).
SMALL_MODEL = {
    "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
    "head_dim": 16, "intermediate_size": 64, "moe_intermediate_size": 16, "num_experts": 8,
    "num_experts_per_tok": 2, "num_shared_experts": 1, "first_k_dense_replace": 1, "n_group": 4,
    "topk_group": 2, "routed_scaling_factor": 2.5, "norm_topk_prob": True, "rope_theta": 10000.0,
    "partial_rotary_factor": 0.5, "max_position_embeddings": 512, "tie_word_embeddings": False,
}


# ----- the generator -------------------------------------------------------------------------------------
def _independent_answers(ex: tasks.Example) -> set[str]:
    """Recompute the correct answers from the user text alone, without the generator's code."""
    u = ex.user
    if m := re.fullmatch(r"What is (\d+) ([+-]) (\d+)\?", u):
        a, op, b = int(m[1]), m[2], int(m[3])
        assert 0 <= a <= 99 and 0 <= b <= 99
        return {str(a + b if op == "+" else a - b)}
    if m := re.fullmatch(r"Reverse the word: ([a-z]{3,6})", u):
        return {"".join(reversed(m[1]))}
    if m := re.fullmatch(r"Sort these numbers: ((?:\d+ ){2,5}\d+)", u):
        nums = [int(x) for x in m[1].split(" ")]
        assert all(0 <= n <= 99 for n in nums)
        return {" ".join(map(str, sorted(nums)))}
    if m := re.fullmatch(r"Write a Python function named ([a-z]+(?:_[a-z]+)?) that returns the (\w+) of a and b\.", u):
        expr = {"sum": "a + b", "difference": "a - b", "product": "a * b", "maximum": "max(a, b)",
                "minimum": "min(a, b)"}[m[2]]
        assert all(w in tasks.CODE_WORDS for w in m[1].split("_"))
        return {f"def {m[1]}(a, b):\n    return {expr}"}
    if m := re.fullmatch(r"Tell me about the ([a-z]+)\.", u):
        x = m[1]
        return {f"The {x} is an animal.", f"I like the {x} a lot.", f"A {x} can be found in many places."}
    raise AssertionError(f"unrecognised problem {u!r}")


def test_word_lists_are_big_enough() -> None:
    assert len(set(tasks.CODE_WORDS)) >= 100 and all(re.fullmatch(r"[a-z]+", w) for w in tasks.CODE_WORDS)
    assert len(set(tasks.ANIMALS)) >= 50 and len(tasks.CHAT_TEMPLATES) == 3
    assert len(tasks.CODE_OPS) == 5


@pytest.mark.parametrize("split", ["train", "eval"])
def test_answers_correct_by_construction(split: str) -> None:
    gen = TaskGenerator(seed=3, split=split)
    seen = set()
    for ex in gen.batch(1500):
        seen.add(ex.family)
        truth = _independent_answers(ex)
        assert set(ex.answers) == truth
        assert ex.answer in truth
        assert tasks.is_correct(ex, ex.answer)
        assert split_of(ex.key, ex.family) == split
    assert seen == set(FAMILIES)


def test_full_level_reaches_every_size() -> None:
    rng = random.Random(0)
    lens = {len(sample("reverse", "train", rng).answer) for _ in range(300)}
    counts = {len(sample("sort", "train", rng).answer.split()) for _ in range(300)}
    names = {sample("code", "train", rng).user.split()[5].count("_") for _ in range(300)}
    ops = {sample("math", "train", rng).answer.startswith("-") for _ in range(300)}
    assert lens == {3, 4, 5, 6} and counts == {3, 4, 5, 6} and names == {0, 1} and ops == {True, False}


def test_generator_is_seeded() -> None:
    a = [e.user for e in TaskGenerator(7, invented_animals=0.3).batch(200)]
    b = [e.user for e in TaskGenerator(7, invented_animals=0.3).batch(200)]
    assert a == b and a != [e.user for e in TaskGenerator(8, invented_animals=0.3).batch(200)]


def test_train_and_eval_are_disjoint() -> None:
    train = {e.key for e in TaskGenerator(0, "train", invented_animals=0.3).batch(6000)}
    for level in (0.0, 0.5):  # curriculum levels draw from the train split too
        gen = TaskGenerator(1, "train")
        gen.level = level
        train |= {e.key for e in gen.batch(2000)}
    held_out = eval_set(seed=5, per_family=200)
    assert {e.family for e in held_out} == set(FAMILIES)
    assert sum(e.family == f for e in held_out for f in ["math"]) == 200
    assert not train & {e.key for e in held_out}
    # canonical keys: A + B and B + A are one problem; permutations of a list to sort are one problem
    assert tasks.make_math(3, "+", 9).key == tasks.make_math(9, "+", 3).key
    assert tasks.make_sort([5, 1, 3]).key == tasks.make_sort([3, 5, 1]).key
    # held-out animals are never asked about in training, not even as an invented name
    assert not {k.split("|")[1] for k in train if k.startswith("chat|")} & set(tasks.eval_animals())
    assert len(tasks.eval_animals()) >= 5


def test_chat_rendering_uses_the_llada2_template() -> None:
    ex = tasks.make_math(12, "+", 30)
    assert tasks.render_prompt(ex) == ("<role>SYSTEM</role>detailed thinking off<|role_end|><role>HUMAN</role>"
                                       "What is 12 + 30?<|role_end|><role>ASSISTANT</role>")


# ----- sequences and the dual-copy mask -----------------------------------------------------------------------
def test_dual_copy_mask_tiny_case() -> None:
    # 3 blocks of 2: noisy n0 n0 n1 n1 n2 n2 | clean c0 c0 c1 c1
    m = dual_copy_mask(3, block_size=2).int().tolist()
    assert m == [
        [1, 1, 0, 0, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0, 0, 0, 0],
        [0, 0, 1, 1, 0, 0, 1, 1, 0, 0],
        [0, 0, 1, 1, 0, 0, 1, 1, 0, 0],
        [0, 0, 0, 0, 1, 1, 1, 1, 1, 1],
        [0, 0, 0, 0, 1, 1, 1, 1, 1, 1],
        [0, 0, 0, 0, 0, 0, 1, 1, 0, 0],
        [0, 0, 0, 0, 0, 0, 1, 1, 0, 0],
        [0, 0, 0, 0, 0, 0, 1, 1, 1, 1],
        [0, 0, 0, 0, 0, 0, 1, 1, 1, 1],
    ]
    assert dual_copy_positions(3, block_size=2).tolist() == [0, 1, 2, 3, 4, 5, 0, 1, 2, 3]
    assert dual_copy_mask(1).all()  # one block: the noisy copy alone, fully bidirectional


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    from redraft.training.train import TrainConfig, Trainer

    run = tmp_path_factory.mktemp("run")
    cfg = TrainConfig(run_dir=str(run), seed=0, steps=20, batch_size=12, lr=3e-3, warmup_steps=1,
                      vocab_size=700, model=dict(SMALL_MODEL), mtf_start=0, p_mtf=0.5, eval_every=0)
    return Trainer(cfg)


def test_sequences_are_block_aligned(trainer) -> None:
    tok = trainer.tok
    for ex in TaskGenerator(0).batch(50):
        s = encode_example(ex, tok, random.Random(0))
        assert len(s.ids) % BLOCK_SIZE == 0 and len(s.ids) - (s.prompt_len + s.answer_len) < BLOCK_SIZE
        assert tok.decode(s.ids[: s.prompt_len], skip_special_tokens=False) == tasks.render_prompt(ex, tok)
        answer = s.ids[s.prompt_len: s.prompt_len + s.answer_len]
        assert answer[-1] == tok.eos_token_id and tok.decode(answer) == ex.answer
        assert set(s.ids[s.prompt_len + s.answer_len:]) <= {tok.eos_token_id}
    b = make_buckets([encode_example(ex, tok) for ex in TaskGenerator(1).batch(30)], eos_tail_weight=1.0)
    for bucket in b:
        tail = bucket.response & ~bucket.content
        # the EOS padding of each sequence weighs 1 in total (or nothing when there is none)
        sums = (bucket.weight * tail).sum(1)
        assert torch.all(((sums - 1).abs() < 1e-5) | (tail.sum(1) == 0))
        assert torch.all(bucket.weight[bucket.content] == 1) and torch.all(bucket.weight[~bucket.response] == 0)


def test_noise_streams(trainer) -> None:
    tok = trainer.tok
    (b,) = [x for x in make_buckets([encode_example(ex, tok) for ex in TaskGenerator(2).batch(80)]) if x.num_blocks == 1]
    gen = torch.Generator().manual_seed(0)
    nz = add_noise(b, tok.mask_token_id, trainer.noise_vocab, gen, p_edit=0.5, max_edit_rate=0.5)
    assert torch.all(nz.xt[~b.response] == b.x0[~b.response])  # the prompt is never noised
    assert torch.all(nz.masked.any(1))  # every sequence drafts something
    assert torch.all((nz.xt == tok.mask_token_id) == nz.masked)
    assert torch.all(nz.xt[nz.corrupted] != b.x0[nz.corrupted]) and nz.corrupted.any()
    edit_rows = nz.corrupted.any(1)
    assert torch.all(nz.scored[edit_rows] == b.response[edit_rows])  # editing: scored everywhere
    draft_rows = ~(nz.scored == b.response).all(1)
    assert torch.all(nz.scored[draft_rows] == nz.masked[draft_rows])  # drafting: scored where masked


def test_dual_copy_forward_matches_block_causal_inference(trainer) -> None:
    """A noisy block's logits in the dual-copy forward equal those of a plain block-causal forward over
    (clean earlier blocks + that noisy block): training sees exactly what decoding sees."""
    from redraft.training.train import DenseMeta, Segment, forward_logits

    model, tok = trainer.model, trainer.tok
    ex = tasks.make_code("total_score", "maximum")
    (b,) = make_buckets([encode_example(ex, tok)])
    assert b.num_blocks >= 2
    gen = torch.Generator().manual_seed(1)
    xt = add_noise(b, tok.mask_token_id, trainer.noise_vocab, gen, p_edit=1.0, max_edit_rate=0.3).xt
    model.eval()
    with torch.no_grad():
        got = forward_logits(model, [(b, xt)], [b.response])  # [N, V]
        s = b.x0.shape[1]
        want = []
        for blk in range(b.num_blocks):
            seq = torch.cat([b.x0[0, : blk * BLOCK_SIZE], xt[0, blk * BLOCK_SIZE: (blk + 1) * BLOCK_SIZE]])
            pos = torch.arange(len(seq))
            mask = block_causal_visible(pos[:, None], pos[None, :], BLOCK_SIZE)
            meta = DenseMeta(pos, [Segment(0, 1, len(seq), mask)])
            h = model(seq, meta, [None] * len(model.layers), [None] * len(model.layers))
            rows = pos[blk * BLOCK_SIZE:][b.response[0, blk * BLOCK_SIZE: (blk + 1) * BLOCK_SIZE]]
            want.append(model.logits(h[rows]))
        want = torch.cat(want)
    assert s == b.num_blocks * BLOCK_SIZE
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_number_tokens_start_with_shared_digit_features(trainer) -> None:
    from redraft.training.train import init_number_embeddings

    tok, model = trainer.tok, trainer.model
    ids = {t: tok.token_to_id(t) for t in ("42", "Ġ42", "43", "Ġ7")}
    assert all(i is not None for i in ids.values())
    init_number_embeddings(model, tok, seed=0)
    e = model.embed.weight.detach()
    cos = torch.nn.functional.cosine_similarity
    assert cos(e[ids["42"]], e[ids["Ġ42"]], dim=0) > 0.6  # same digits, with and without the space
    assert cos(e[ids["42"]], e[ids["43"]], dim=0) > 0.3  # same tens digit
    assert abs(cos(e[ids["42"]], e[ids["Ġ7"]], dim=0)) < 0.3
    torch.testing.assert_close(model.lm_head.weight[ids["42"]], e[ids["42"]])


def test_fourier_number_rows_score_the_sum_highest(trainer) -> None:
    """With Fourier features, the value parts of the number rows score each other highest on the diagonal, and
    the features of a + b (or |a - b|) score highest at the right answer: the circuit the init makes easy."""
    from redraft.training.train import fourier_features, init_number_embeddings

    tok, model = trainer.tok, trainer.model
    values = [n for n in range(199) if tok.token_to_id(str(n)) is not None]  # the test tokenizer is smaller
    assert len(values) > 100
    answers = [tok.token_to_id(str(n)) for n in values]
    init_number_embeddings(model, tok, seed=0, features="digits")
    digits = model.lm_head.weight.detach()[answers].clone()  # [199, H]
    init_number_embeddings(model, tok, seed=0, features="fourier")
    fourier = model.lm_head.weight.detach()[answers] - digits / 2  # [199, H]: the value part of each row
    scores = fourier @ fourier.T  # [outputs, values]
    assert (scores.argmax(0) == torch.arange(len(values))).all()
    torch.testing.assert_close(model.embed.weight[answers], model.lm_head.weight[answers])
    feats = torch.stack([fourier_features(n) for n in range(199)])  # [199, 2K]
    rng = random.Random(0)
    for _ in range(200):
        a, b = rng.randrange(100), rng.randrange(100)
        target = fourier_features(a + b)
        assert int((feats @ target).argmax()) == a + b
        assert int((feats @ fourier_features(abs(a - b))).argmax()) == abs(a - b)


def test_edit_classification() -> None:
    from redraft.training.evaluate import classify_edits

    eos = 0
    refs = [[5, 6, 7, eos, eos], [5, 9, 7, eos, eos]]  # two correct answers (as chat has)
    out = [5, 6, 7, eos, eos]
    trace = [[1, 8, 6],   # wrong -> right (against the closest reference, the first)
             [2, 7, 3],   # right -> wrong
             [2, 3, 7],   # wrong -> right again
             [4, 4, 2],   # wrong -> another wrong (the EOS tail)
             [9, 1, eos]]  # past the reference: the tail is EOS, so a repair
    assert classify_edits(trace, out, refs) == (3, 1, 1)
    assert classify_edits([], out, refs) == (0, 0, 0)


def test_training_steps_decrease_the_loss_on_a_fixed_batch(trainer) -> None:
    torch.manual_seed(0)
    batch = trainer.make_batch(12)
    trainer.torch_gen.manual_seed(123)
    first = trainer.train_step(batch)["loss"]
    losses = []
    for _ in range(7):
        trainer.torch_gen.manual_seed(123)  # the same noise each time: a fixed batch
        losses.append(trainer.train_step(batch)["loss"])
    assert all(b < a for a, b in zip([first] + losses, losses)), (first, losses)
    assert losses[-1] < first - 0.5, (first, losses)
    assert all(torch.isfinite(torch.tensor(losses)))


def test_checkpoint_resume_restores_everything(trainer, tmp_path) -> None:
    from redraft.training.train import Trainer

    trainer.save()
    again = Trainer(trainer.tcfg)
    assert again.resume() and again.step == trainer.step
    for (n, p), (_, q) in zip(trainer.model.state_dict().items(), again.model.state_dict().items()):
        assert torch.equal(p, q), n
    assert again.gen.state() == trainer.gen.state()
    for x, y in zip(again.make_batch(6), trainer.make_batch(6)):  # the data stream continues identically
        assert torch.equal(x.x0, y.x0) and torch.equal(x.alt, y.alt)


def test_export_round_trip_through_engine(trainer, tmp_path) -> None:
    import redraft
    from redraft.engine.model.loader import load_model
    from redraft.engine.model.config import ModelConfig
    from redraft.training.export import export_model

    out = export_model(trainer.model, trainer.tok, tmp_path / "ckpt")
    assert {p.name for p in out.iterdir()} >= {"config.json", "model.safetensors", "tokenizer.json",
                                               "tokenizer_config.json", "generation_config.json"}
    loaded = load_model(out, ModelConfig.from_pretrained(out), progress=False)
    ours = trainer.model.state_dict()
    for name, t in loaded.state_dict().items():
        torch.testing.assert_close(t, ours[name], rtol=0, atol=0, msg=name)
    assert loaded.layers[1].mlp.expert_bias.dtype == torch.float32

    engine = redraft.Engine(model_path=str(out), device="cpu", dtype="float32", max_total_tokens=4096, progress=False)
    try:
        ex = tasks.make_math(12, "+", 30)
        ids = engine.tokenizer.encode(tasks.render_prompt(ex, engine.tokenizer))
        res = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 32, "mode": "Q"})
        assert res["meta_info"]["steps"] >= 1 and isinstance(res["text"], str)
        assert engine.tokenizer.apply_chat_template(ex.messages()) == tasks.render_prompt(ex)
    finally:
        engine.shutdown()


def test_train_settings_override_and_merge() -> None:
    from redraft.training.train import TrainConfig, apply_settings

    base = TrainConfig()
    got = apply_settings(base, ["mtf_start=0", 'family_weights={"math": 2.5}', "number_features=fourier",
                                "betas=[0.9, 0.95]"])
    assert got.mtf_start == 0 and got.number_features == "fourier" and got.betas == (0.9, 0.95)
    assert got.family_weights == {**base.family_weights, "math": 2.5}
    with pytest.raises(SystemExit, match="no_such_field"):
        apply_settings(base, ["no_such_field=1"])


def test_eval_demo_set_applies_a_sampling_parameter_to_every_setting(capsys) -> None:
    """`redraft eval-demo --set threshold=1.0`: no probability beats 1.0 (strict >), so every forward fills only
    its one fallback mask; an unknown parameter is an error that lists the known ones."""
    from redraft.engine.text.model_path import BUNDLED_MODEL_DIR
    from redraft.training.evaluate import evaluate, main

    free = evaluate(str(BUNDLED_MODEL_DIR), 2, ["S"], families=["count"])
    slow = evaluate(str(BUNDLED_MODEL_DIR), 2, ["S"], families=["count"], overrides={"threshold": 1.0})
    assert slow["overrides"] == {"threshold": 1.0} and free["overrides"] == {}
    assert slow["S"]["tpf"] < 1.05 < 2.0 < free["S"]["tpf"]
    with pytest.raises(SystemExit):
        main(["--set", "bogus=1"])
    assert "threshold" in capsys.readouterr().err
