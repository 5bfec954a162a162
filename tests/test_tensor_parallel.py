"""Tensor and expert parallelism on CPU (gloo, 2 ranks in 2 processes): the same tokens as one process.

Compared in float64, where the different summation order of the sharded matmuls and the all-reduce cannot flip a
decision (and once in float32 on a checkpoint with wide decision margins); every request of a mixed batch (S and Q, prompts ending mid-block and on a boundary, a multi-block
editing window) must give the single process's output ids and step counts."""

from __future__ import annotations

import pytest
import torch

import redraft

pytestmark = pytest.mark.slow

PROMPTS = [[20 + (7 * i + j) % 300 for i in range(n)] for j, n in enumerate([5, 31, 32, 70])]
PARAMS = [{"max_new_tokens": 48, "temperature": 0.0, "mode": "S", "ignore_eos": True},
          {"max_new_tokens": 40, "temperature": 0.0, "mode": "Q"},
          {"max_new_tokens": 70, "temperature": 0.0, "mode": "S", "mbe_window": 2, "ignore_eos": True},
          {"max_new_tokens": 33, "temperature": 0.8, "seed": 7, "mode": "Q"}]


@pytest.fixture(scope="module")
def single(ckpt):
    eng = redraft.Engine(str(ckpt), dtype="float64", progress=False)
    try:
        yield eng.generate(input_ids=PROMPTS, sampling_params=PARAMS)
    finally:
        eng.shutdown()


@pytest.mark.parametrize("ep", [1, 2], ids=["tp2", "tp2-ep2"])
def test_two_ranks_give_the_single_process_tokens(ckpt, single, ep):
    eng = redraft.Engine(str(ckpt), dtype="float64", progress=False, tp_size=2, ep_size=ep)
    try:
        cfg = eng.model_config
        attn = eng.core.model.layers[0].attn
        assert (attn.n_q, attn.n_kv) == (cfg.num_attention_heads // 2, cfg.num_key_value_heads // 2)
        assert eng.core.runner.k_cache.shape[3] == cfg.num_key_value_heads // 2  # rank 0 caches only its KV heads
        moe = eng.core.model.layers[1].mlp
        assert moe.w13.shape[0] == (cfg.num_experts // 2 if ep == 2 else cfg.num_experts)
        assert eng.core.model.lm_head.weight.shape[0] == eng.core.model.embed.weight.shape[0] == cfg.vocab_size // 2
        from redraft.engine.runtime.tensor_parallel import weight_bytes

        with redraft.Engine(str(ckpt), dtype="float64", progress=False) as whole:
            full = weight_bytes(whole.core.model)
            # likelihood forwards (their own rows of the vocabulary-parallel lm_head): the same values
            scored = [(PROMPTS[0], PROMPTS[1][:20]), (PROMPTS[2], PROMPTS[3][:40])]
            want_lp, want_score = whole.prompt_logprobs(PROMPTS[3], top_k=3), whole.score(scored)
        assert 0.4 * full < weight_bytes(eng.core.model) < 0.75 * full  # a shard, with the replicated parts
        got_lp = eng.prompt_logprobs(PROMPTS[3], top_k=3)
        assert len(got_lp) == len(want_lp) and all(len(alt) == 3 for _, alt in got_lp[1:])
        for g, w in zip(got_lp[1:], want_lp[1:]):
            assert g[0] == pytest.approx(w[0], abs=1e-12) and [t for t, _ in g[1]] == [t for t, _ in w[1]]
        for g, w in zip(eng.score(scored), want_score):
            assert g["estimate"] == pytest.approx(w["estimate"], abs=1e-10)
            assert [t["logprob_sum"] for t in g["terms"]] == pytest.approx([t["logprob_sum"] for t in w["terms"]])
        got = eng.generate(input_ids=PROMPTS, sampling_params=PARAMS)
        for k, (a, b) in enumerate(zip(single, got)):
            assert (b["output_ids"], b["meta_info"]["steps"]) == (a["output_ids"], a["meta_info"]["steps"]), k
        # a second batch on the same ranks (their KV caches and the prefix cache carried over)
        again = eng.generate(input_ids=PROMPTS[:2], sampling_params=PARAMS[:2])
        assert [o["output_ids"] for o in again] == [o["output_ids"] for o in single[:2]]
    finally:
        eng.shutdown()


def test_float32_on_a_checkpoint_with_wide_margins(tmp_path, tiny_checkpoint):
    """In float32 the sharded sums round differently; on a checkpoint whose logits are scaled up (every
    decision far from a tie and from the thresholds: top-1 probabilities near 0 or 1) the tokens still match."""
    import shutil

    from safetensors.torch import load_file, save_file

    path = shutil.copytree(tiny_checkpoint(seed=1), tmp_path / "wide")  # a copy: lm_head is rescaled in place
    weights = load_file(str(path / "model.safetensors"))
    weights["lm_head.weight"] = weights["lm_head.weight"] * 8.0
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    params = [{**p, "temperature": 0.0} for p in PARAMS]
    one = redraft.Engine(str(path), dtype="float32", progress=False)
    try:
        want = one.generate(input_ids=PROMPTS, sampling_params=params)
    finally:
        one.shutdown()
    two = redraft.Engine(str(path), dtype="float32", progress=False, tp_size=2, ep_size=2)
    try:
        got = two.generate(input_ids=PROMPTS, sampling_params=params)
    finally:
        two.shutdown()
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in want]
    assert len({t for o in want for t in o["output_ids"]}) > 5  # a real output, not one token repeated


def test_a_vocabulary_the_ranks_cannot_split_is_replicated(tiny_checkpoint):
    """vocab_size 449 (odd): embedding and lm_head stay whole on every rank, no gather; the same tokens."""
    path = tiny_checkpoint(seed=0, config_overrides={"vocab_size": 449})
    with redraft.Engine(str(path), dtype="float64", progress=False) as one:
        want = one.generate(input_ids=PROMPTS[:2], sampling_params=PARAMS[:2])
    with redraft.Engine(str(path), dtype="float64", progress=False, tp_size=2) as two:
        assert two.core.model.lm_head.weight.shape[0] == two.core.model.embed.weight.shape[0] == 449
        got = two.generate(input_ids=PROMPTS[:2], sampling_params=PARAMS[:2])
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in want]


def test_a_layout_the_model_cannot_take_is_refused(ckpt):
    with pytest.raises(ValueError, match="tp_size 3 does not divide num_attention_heads"):
        redraft.Engine(str(ckpt), dtype="float64", progress=False, tp_size=3)
    with pytest.raises(ValueError, match="ep_size must be 1 or equal to tp_size"):
        redraft.Engine(str(ckpt), dtype="float64", progress=False, tp_size=2, ep_size=4)


def test_serve_with_two_ranks_answers_as_one_process_and_fails_fast_when_a_rank_dies(ckpt, single, tmp_path):
    """`redraft serve --tp-size 2`: the single process's tokens over HTTP (plain and streamed); then rank 1 is
    killed and the next request gets a 503 at once instead of hanging (no restarts allowed here)."""
    import os
    import signal
    import time

    import httpx

    from live_server import RedraftServer, child_pids, cmdline, still_running, proc_stat

    srv = RedraftServer(ckpt, tmp_path, ["--tp-size", "2", "--dtype", "float64", "--engine-restarts", "0"])
    srv.start()
    try:
        body = {"input_ids": PROMPTS[0], "sampling_params": PARAMS[0]}
        r = httpx.post(f"{srv.url}/generate", json=body, timeout=120)
        assert r.status_code == 200 and r.json()["output_ids"] == single[0]["output_ids"], r.text[:300]
        streamed = httpx.post(f"{srv.url}/generate", json={**body, "stream": True}, timeout=120)
        assert streamed.status_code == 200 and "[DONE]" in streamed.text
        # an aborted request ends at once, and the ranks go on in step with the next one
        long = {"input_ids": PROMPTS[1], "rid": "tp-abort", "stream": True,
                "sampling_params": {"max_new_tokens": 512, "temperature": 0.0, "ignore_eos": True}}
        with httpx.stream("POST", f"{srv.url}/generate", json=long, timeout=120) as resp:
            chunks = resp.iter_lines()
            assert next(line for line in chunks if line.startswith("data:"))  # one committed block arrived
            assert httpx.post(f"{srv.url}/abort_request", json={"rid": "tp-abort"}, timeout=30).status_code == 200
            rest = list(chunks)
        assert len([line for line in rest if line.startswith("data: {")]) < 15  # not the 16 blocks of 512 tokens
        after = httpx.post(f"{srv.url}/generate", json={"input_ids": PROMPTS[1], "sampling_params": PARAMS[1]},
                           timeout=120)
        assert after.json()["output_ids"] == single[1]["output_ids"]
        engines = [p for p in child_pids(srv.proc.pid) if b"multiprocessing.spawn" in cmdline(p)]
        assert len(engines) == 1, engines
        ranks = [p for p in child_pids(engines[0]) if b"multiprocessing.spawn" in cmdline(p)]
        assert len(ranks) == 1, ranks  # rank 1; the engine process is rank 0
        start = proc_stat(ranks[0])[1]
        os.kill(ranks[0], signal.SIGKILL)
        t0 = time.monotonic()
        r = httpx.post(f"{srv.url}/generate", json=body, timeout=60)
        assert r.status_code == 503 and time.monotonic() - t0 < 30, r.text[:300]
    finally:
        srv.stop(check=False)  # it exits non-zero on purpose: its engine could not be restarted
    assert not still_running(ranks[0], start)
    assert not any(still_running(p, s) for p, s in srv.seen_descendants.items())


@pytest.mark.parametrize("ep", [1, 2], ids=["tp2", "tp2-ep2"])
def test_block_routing_two_ranks_give_the_single_process_tokens(tiny_checkpoint, ep):
    """A LLaDA2.2 block-routing checkpoint (expert_capacity 3 of 8): the router is replicated and every rank
    labels the routing blocks from the same broadcast metadata, so the ranks route identically and a batch
    (with its likelihood forwards) gives the single process's tokens and values."""
    path = tiny_checkpoint(seed=1, config_overrides={"expert_capacity": 3})
    with redraft.Engine(str(path), dtype="float64", progress=False) as one:
        want = one.generate(input_ids=PROMPTS[:3], sampling_params=PARAMS[:3])
        want_lp = one.prompt_logprobs(PROMPTS[3])
    with redraft.Engine(str(path), dtype="float64", progress=False, tp_size=2, ep_size=ep) as two:
        assert two.model_config.block_routing
        got = two.generate(input_ids=PROMPTS[:3], sampling_params=PARAMS[:3])
        got_lp = two.prompt_logprobs(PROMPTS[3])
    for k, (a, b) in enumerate(zip(want, got)):
        assert (b["output_ids"], b["meta_info"]["steps"]) == (a["output_ids"], a["meta_info"]["steps"]), k
    assert [g[0] for g in got_lp[1:]] == pytest.approx([w[0] for w in want_lp[1:]], abs=1e-12)


@pytest.fixture(scope="module")
def fp8_checkpoint(tiny_checkpoint):
    """A checkpoint FP8 can shard (head_dim 128, intermediates of 256: whole 128-blocks per rank), and the single
    process's FP8 tokens on it. float64 activations (the torch twins dequantise into them): each e4m3 rounding of
    an activation sees the float32 image of the sum, which the ranks' summation order cannot change; in float32 a
    one-ulp difference in a partial sum flips an e4m3 rounding now and then, and the random model follows it."""
    from test_sharding import ALIGNED

    path = tiny_checkpoint(seed=2, config_overrides=ALIGNED)
    params = [{**p, "temperature": 0.0} for p in PARAMS]
    with redraft.Engine(str(path), dtype="float64", quantization="fp8", progress=False) as one:
        want = one.generate(input_ids=PROMPTS, sampling_params=params)
    return path, params, want


@pytest.mark.parametrize("ep", [1, 2], ids=["tp2", "tp2-ep2"])
def test_fp8_two_ranks_give_the_single_process_tokens(fp8_checkpoint, ep):
    """FP8 weights shard with their block scales (each rank quantises only its slices): the same tokens."""
    path, params, want = fp8_checkpoint
    with redraft.Engine(str(path), dtype="float64", quantization="fp8", progress=False, tp_size=2, ep_size=ep) as two:
        assert two.core.model.layers[1].mlp.w13.dtype == torch.float8_e4m3fn
        got = two.generate(input_ids=PROMPTS, sampling_params=params)
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in want]
    assert len({t for o in want for t in o["output_ids"]}) > 5


def test_a_worker_that_dies_at_start_up_is_an_error_not_a_hang(ckpt):
    """A script piped to `python -` cannot be re-imported by spawned workers: rank 1 dies before the
    rendezvous. Rank 0 must say so within seconds (it used to wait in init_process_group for 30 minutes)."""
    import subprocess
    import sys

    script = (f"import redraft\nredraft.Engine({str(ckpt)!r}, dtype='float64', progress=False, tp_size=2)\n"
              "print('started')\n")
    run = subprocess.run([sys.executable, "-"], input=script, capture_output=True, text=True, timeout=120)
    assert run.returncode != 0 and "started" not in run.stdout
    assert "tensor-parallel worker redraft-tp1 exited during start-up" in run.stderr


def test_four_ranks_on_two_kv_heads_give_the_single_process_tokens(ckpt, single):
    """More ranks than KV heads: each KV head is kept (and cached) by the two ranks whose query heads read it
    (LLaDA2.1's 4 KV heads on 8 GPUs); ep 4 places 2 of the tiny model's 8 experts on each rank."""
    with redraft.Engine(str(ckpt), dtype="float64", progress=False, tp_size=4, ep_size=4) as eng:
        assert eng.core.runner.k_cache.shape[3] == 1
        got = eng.generate(input_ids=PROMPTS[1:3], sampling_params=PARAMS[1:3])  # Q, and S with an MBE window
    for k, (a, b) in enumerate(zip(single[1:3], got)):
        assert (b["output_ids"], b["meta_info"]["steps"]) == (a["output_ids"], a["meta_info"]["steps"]), k
