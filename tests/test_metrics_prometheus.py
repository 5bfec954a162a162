"""The metrics and the shipped Prometheus/Grafana files against a real Prometheus (Debian's `prometheus`).

A live `redraft serve` (tiny checkpoint, 127.0.0.1) gets OpenAI requests in several domains and both modes; a
real Prometheus (own config, 1s scrapes, 127.0.0.1, temp storage) scrapes it and loads the shipped alert rules.
Then every PromQL expression of deploy/grafana/dashboards/redraft.json is evaluated through Prometheus' HTTP
API (instant and range queries): none may error, and the per-domain and per-mode throughput panels must return a
series for every domain and mode sent. `promtool check config|rules` and `promtool test rules` run on the
shipped files, and `promtool check metrics` lints the exposition (only the `:` that SGLang's names carry is
allowed to be reported).

`.ci/run` installs Debian's prometheus package; without it this test installs it itself when it runs as root
with apt-get (as in CI), and is skipped elsewhere.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from live_server import RedraftServer, free_port
from optional_tools import missing

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

pytestmark = pytest.mark.timeout(420)  # the live tests below are also marked slow

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "redraft.json"
DOMAINS = ("code", "math", "chat")
# (domain as sent, how it is sent, mode, expected `domain` label)
REQUESTS = [
    ("code", "domain", "S", "code"),
    ("math", "metadata", "Q", "math"),
    ("chat", "domain", "Q", "chat"),
    ("code", "metadata", "Q", "code"),
    ("math", "domain", "S", "math"),
    ("poetry", "domain", "S", "other"),  # not configured: counted as "other"
]
SERVER_START_S = 120.0
SCRAPE_WAIT_S = 60.0


def _tool(name: str) -> str:
    """Path of a Prometheus binary; installs Debian's package once if it is missing and we may."""
    found = shutil.which(name)
    if found:
        return found
    if os.geteuid() == 0 and shutil.which("apt-get") and os.environ.get("REDRAFT_NO_APT") != "1":
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        subprocess.run(["apt-get", "update", "-qq"], env=env, timeout=300, check=False, capture_output=True)
        res = subprocess.run(["apt-get", "install", "-y", "-qq", "prometheus"], env=env, timeout=600,
                             capture_output=True, text=True)
        found = shutil.which(name)
        if found:
            return found
        pytest.fail(f"apt-get install prometheus failed:\n{res.stdout[-2000:]}\n{res.stderr[-2000:]}")
    missing(f"`{name}`", "Debian: apt-get install prometheus; .ci/run does this")


def _stop(proc: subprocess.Popen, timeout: float = 30.0) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def _wait_http(url: str, proc: subprocess.Popen, timeout: float, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"{proc.args[0]} exited ({proc.returncode}):\n{log.read_text(errors='replace')[-3000:]}")
        try:
            if httpx.get(url, timeout=2.0, trust_env=False).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    pytest.fail(f"{url} did not answer within {timeout:.0f}s:\n{log.read_text(errors='replace')[-3000:]}")


# ---- fixtures ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def promtool() -> str:
    return _tool("promtool")


@pytest.fixture(scope="module")
def redraft_server(request, ckpt, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("metrics-server")
    args = ["--domains", ",".join(DOMAINS), "--max-queued-requests", "64"]
    srv = RedraftServer(ckpt, tmp, args, env={"PROMETHEUS_MULTIPROC_DIR": None})
    request.addfinalizer(srv.stop)
    srv.start()
    return srv.url, srv.port, "tiny"


@pytest.fixture(scope="module")
def prometheus(redraft_server, tmp_path_factory):
    binary = _tool("prometheus")
    _, port, _ = redraft_server
    tmp = tmp_path_factory.mktemp("prometheus")
    config = tmp / "prometheus.yml"
    config.write_text(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        f"rule_files:\n  - {DEPLOY / 'alert_rules.yml'}\n"
        "scrape_configs:\n  - job_name: redraft\n    scrape_timeout: 1s\n"
        f"    static_configs:\n      - targets: ['127.0.0.1:{port}']\n"
    )
    web_port = free_port()
    log = tmp / "prometheus.log"
    cmd = [binary, f"--config.file={config}", f"--storage.tsdb.path={tmp / 'data'}",
           f"--web.listen-address=127.0.0.1:{web_port}", "--log.level=warn"]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=tmp)
    try:
        _wait_http(f"http://127.0.0.1:{web_port}/-/ready", proc, 60.0, log)
        yield f"http://127.0.0.1:{web_port}"
    finally:
        _stop(proc)


@pytest.fixture(scope="module")
def traffic(redraft_server, prometheus):
    """Send the requests, then wait until Prometheus has scraped their results."""
    base, _, model = redraft_server
    # Prometheus applies new targets a few seconds after start: wait for a first scrape, so that the rates
    # below see the counters before and after the requests.
    deadline = time.monotonic() + SCRAPE_WAIT_S
    while not _query(prometheus, 'up{job="redraft"} == 1'):
        assert time.monotonic() < deadline, "Prometheus never scraped redraft"
        time.sleep(0.5)
    time.sleep(2.0)
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120.0,
                           http_client=httpx.Client(trust_env=False, timeout=120.0))
    for i, (domain, how, mode, _) in enumerate(REQUESTS):
        extra = {"mode": mode, ("domain" if how == "domain" else "metadata"): (
            domain if how == "domain" else {"domain": domain})}
        messages = [{"role": "user", "content": f"Question {i} about {domain}: tell me something."}]
        if i == 2:  # one constrained request: the structured-output counters
            extra["response_format"] = {"type": "json_object"}
        if i % 2 == 0:  # streamed, with the usage chunk that carries the diffusion figures
            stream = client.chat.completions.create(model=model, messages=messages, max_tokens=48, stream=True,
                                                    stream_options={"include_usage": True}, extra_body=extra)
            chunks = list(stream)
            assert chunks and chunks[-1].usage is not None
        else:
            out = client.chat.completions.create(model=model, messages=messages, max_tokens=48, extra_body=extra)
            assert out.usage.completion_tokens > 0
    # The exposition must show every request; then Prometheus must have scraped that state.
    text = httpx.get(base + "/metrics", trust_env=False).text
    total = sum(float(v) for v in re.findall(r'^sglang:num_requests_total\{[^}]*\} (\S+)$', text, re.M))
    assert total == len(REQUESTS), text
    deadline = time.monotonic() + SCRAPE_WAIT_S
    while time.monotonic() < deadline:
        got = _query(prometheus, "sum(sglang:num_requests_total)")
        if got and float(got[0]["value"][1]) == len(REQUESTS):
            time.sleep(3.0)  # a few more scrapes, so rates over the window have their points
            return text
        time.sleep(0.5)
    pytest.fail("Prometheus did not scrape the finished requests in time")


def _query(prom: str, expr: str, at: float | None = None) -> list[dict]:
    params = {"query": expr}
    if at is not None:
        params["time"] = f"{at:.3f}"
    r = httpx.get(prom + "/api/v1/query", params=params, timeout=10.0, trust_env=False)
    body = r.json()
    assert r.status_code == 200 and body.get("status") == "success", f"{expr}\n-> {r.status_code} {body}"
    return body["data"]["result"]


def _dashboard_exprs() -> list[tuple[str, str]]:
    dash = json.loads(DASHBOARD.read_text())
    out = []
    for panel in dash["panels"]:
        for target in panel.get("targets", []):
            out.append((panel["title"], target["expr"]))
    return out


def _substitute(expr: str, model: str) -> str:
    """Grafana's variables as Grafana would expand them for this server."""
    return (expr.replace("$__rate_interval", "1m").replace("$model_name", re.escape(model))
            .replace("$instance", ".*"))


# ---- tests ---------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_promtool_accepts_shipped_config_and_rules(promtool):
    for args in (["check", "config", str(DEPLOY / "prometheus.yml")],
                 ["check", "rules", str(DEPLOY / "alert_rules.yml")],
                 ["test", "rules", str(DEPLOY / "tests" / "alert_rules_test.yml")]):
        res = subprocess.run([promtool, *args], capture_output=True, text=True, timeout=60, cwd=ROOT)
        assert res.returncode == 0, f"promtool {' '.join(args)}:\n{res.stdout}\n{res.stderr}"


@pytest.mark.slow
def test_live_is_cheap_and_health_checks_the_engine(redraft_server):
    base, _, _ = redraft_server
    assert httpx.get(base + "/live", trust_env=False, timeout=5.0).status_code == 200
    assert httpx.get(base + "/health", trust_env=False, timeout=10.0).status_code == 200


@pytest.mark.slow
def test_exposition_lints_clean_but_for_sglang_colons(promtool, redraft_server, traffic):
    res = subprocess.run([promtool, "check", "metrics"], input=traffic, capture_output=True, text=True, timeout=30)
    problems = [ln for ln in (res.stdout + res.stderr).splitlines() if ln.strip()]
    unexpected = [ln for ln in problems if "metric names should not contain ':'" not in ln]
    assert not unexpected, "\n".join(unexpected)
    for name in ("redraft:forwards_total", "redraft:tokens_committed_total", "redraft:edits_total",
                 "redraft:mbe_edits_total", "redraft:mbe_window_bucket", "redraft:constrained_requests_total",
                 "redraft:grammar_rejected_tokens_total", "redraft:grammar_remasked_positions_total",
                 "redraft:grammar_forced_tokens_total",
                 "redraft:block_steps_bucket", "redraft:tokens_per_forward_bucket",
                 "sglang:time_to_first_token_seconds_bucket", "sglang:inter_token_latency_seconds_bucket",
                 "redraft:inter_block_latency_seconds_bucket", "sglang:e2e_request_latency_seconds_bucket",
                 "sglang:queue_time_seconds_bucket", "sglang:num_running_reqs", "sglang:num_queue_reqs",
                 "sglang:num_used_tokens", "sglang:token_usage", "sglang:cache_hit_rate",
                 "sglang:prompt_tokens_total", "sglang:generation_tokens_total"):
        assert re.search(rf"^{re.escape(name)}\{{", traffic, re.M), f"{name} missing from /metrics"
    domains = set(re.findall(r'domain="([^"]*)"', traffic))
    assert domains == {*DOMAINS, "other"}, f"the domain label must stay within the configured set: {domains}"


@pytest.mark.slow
def test_every_dashboard_expression_evaluates(redraft_server, prometheus, traffic):
    _, _, model = redraft_server
    exprs = _dashboard_exprs()
    assert len(exprs) >= 20
    now = time.time()
    results: dict[str, list[dict]] = {}
    for title, expr in exprs:
        q = _substitute(expr, model)
        assert "$" not in q, f"unexpanded variable in {title!r}: {q}"
        results[q] = _query(prometheus, q, at=now)  # asserts status success
        r = httpx.get(prometheus + "/api/v1/query_range", trust_env=False, timeout=10.0,
                      params={"query": q, "start": f"{now - 60:.3f}", "end": f"{now:.3f}", "step": "5"})
        assert r.status_code == 200 and r.json()["status"] == "success", f"{title}: {q}\n-> {r.text[:500]}"

    def series(title: str, label: str) -> dict[str, float]:
        expr = next(e for t, e in exprs if t == title)
        return {s["metric"].get(label, ""): float(s["value"][1]) for s in results[_substitute(expr, model)]}

    per_domain = series("Output tokens/s per domain", "domain")
    sent_domains = {label for *_, label in REQUESTS}
    assert sent_domains <= set(per_domain), per_domain
    assert all(per_domain[d] > 0 for d in sent_domains), per_domain
    per_mode = series("Output tokens/s per mode", "mode")
    assert per_mode.get("S", 0) > 0 and per_mode.get("Q", 0) > 0, per_mode
    tpf = results[_substitute(next(e for t, e in exprs if t == "Tokens per forward per domain and mode"), model)]
    pairs = {(s["metric"]["domain"], s["metric"]["mode"]) for s in tpf if s["value"][1] not in ("NaN", "+Inf")}
    assert {(d, m) for _, _, m, d in REQUESTS} <= pairs, pairs
    ttft = results[_substitute(next(e for t, e in exprs if t.startswith("Time to first token")), model)]
    assert ttft and all(float(s["value"][1]) > 0 for s in ttft), ttft
    up = series("Engine up", "")
    assert up == {"": 1.0}, up


@pytest.mark.slow
def test_dashboard_variables_resolve(redraft_server, prometheus, traffic):
    _, _, model = redraft_server
    dash = json.loads(DASHBOARD.read_text())
    for var in dash["templating"]["list"]:
        if var["type"] != "query":
            continue
        m = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", var["definition"])
        assert m, var["definition"]
        selector, label = _substitute(m.group(1), model), m.group(2)
        r = httpx.get(f"{prometheus}/api/v1/label/{label}/values", params={"match[]": selector},
                      trust_env=False, timeout=10.0)
        assert r.status_code == 200 and r.json()["data"], f"{var['name']}: {r.text[:300]}"


@pytest.mark.slow
def test_alert_rules_load_and_stay_quiet(prometheus, traffic):
    r = httpx.get(prometheus + "/api/v1/rules", trust_env=False, timeout=10.0).json()
    rules = [rule for group in r["data"]["groups"] for rule in group["rules"]]
    assert {rule["name"] for rule in rules} >= {"RedraftServerDown", "RedraftEngineDown", "RedraftQueueSaturated",
                                                "RedraftKVCacheFull"}
    deadline = time.monotonic() + 10.0
    while any(rule.get("health") == "unknown" for rule in rules) and time.monotonic() < deadline:
        time.sleep(1.0)
        r = httpx.get(prometheus + "/api/v1/rules", trust_env=False, timeout=10.0).json()
        rules = [rule for group in r["data"]["groups"] for rule in group["rules"]]
    for rule in rules:
        assert rule["health"] == "ok", rule
        assert rule["state"] == "inactive", f"{rule['name']} is {rule['state']} on a healthy server"


# ---- the collector alone (fast) -------------------------------------------------------------------------------
def _out(rid: str, n: int, steps: int, blocks: int, finished: bool = False, **meta):
    from redraft.protocol.messages import RequestOutput

    reason = ({"type": meta.pop("reason", "stop")}) if finished else None
    base = {"steps": steps, "blocks": blocks}
    if finished:
        base |= {"prompt_tokens": 10, "completion_tokens": n, "cached_tokens": 0, "edits": 3, "queue_time": 0.25}
    return RequestOutput(rid, list(range(n)), finished, reason, meta=base | meta)  # n: tokens new in this message


def _value(metrics, name: str, **labels) -> float:
    v = metrics.registry.get_sample_value(name, labels)
    return 0.0 if v is None else v


def _aborted_and_failed_count_apart(m, lab: dict) -> None:
    from redraft.protocol.sampling_params import SamplingParams

    # unknown and missing domains are "other"; an aborted request counts as aborted, with no latency
    m.on_submit("b", SamplingParams(mode="Q", domain="poetry"))
    m.on_message(_out("b", 0, steps=0, blocks=0, finished=True, reason="abort"))
    q = dict(lab, mode="Q", domain="other")
    assert _value(m, "sglang:num_aborted_requests_total", **q) == 1
    assert _value(m, "sglang:e2e_request_latency_seconds_count", **q) == 0
    assert _value(m, "sglang:time_to_first_token_seconds_count", **q) == 0
    assert _value(m, "redraft:failed_requests_total", **q) == 0
    # one that a failure inside the engine ended: counted as failed, neither aborted nor given a latency
    m.on_submit("e", SamplingParams(mode="Q", domain="poetry"))
    m.on_message(_out("e", 0, steps=2, blocks=0, finished=True, reason="error"))
    assert _value(m, "redraft:failed_requests_total", **q) == 1
    assert _value(m, "sglang:num_aborted_requests_total", **q) == 1
    assert _value(m, "sglang:num_requests_total", **q) == 2
    assert _value(m, "sglang:e2e_request_latency_seconds_count", **q) == 0


def test_collector_labels_and_per_block_figures():
    from redraft.protocol.sampling_params import SamplingParams
    from redraft.protocol.messages import Accepted, Rejected
    from redraft.server.metrics import ServerMetrics, parse_domains

    assert parse_domains("Code, math,,chat,code") == ("code", "math", "chat")
    for bad in ("other", "a b", "x" * 65):
        with pytest.raises(ValueError):
            parse_domains(bad)
    m = ServerMetrics("tiny", "code,math")
    lab = {"model_name": "tiny"}
    m.on_submit("a", SamplingParams(mode="auto", domain="Math"))  # auto + math -> S
    m.on_message(Accepted("a", "S", 64))  # the engine resolved auto + math to S
    m.on_message(_out("a", 20, steps=4, blocks=1))  # first block: 20 tokens after 4 forwards
    m.on_message(_out("a", 32, steps=10, blocks=2))  # second block: 32 tokens, 6 forwards
    m.on_message(_out("a", 8, steps=13, blocks=3, finished=True, completion_tokens=60, mbe_edits=2, mbe_window=3))
    s = dict(lab, mode="S", domain="math")
    assert _value(m, "sglang:time_to_first_token_seconds_count", **s) == 1
    assert _value(m, "redraft:inter_block_latency_seconds_count", **s) == 2
    assert _value(m, "sglang:inter_token_latency_seconds_count", **s) == 40  # one per token after the first block
    assert _value(m, "redraft:tokens_committed_total", **s) == 60
    assert _value(m, "redraft:block_steps_count", **s) == 3 and _value(m, "redraft:block_steps_sum", **s) == 13
    assert _value(m, "redraft:forwards_total", **s) == 13 and _value(m, "redraft:edits_total", **s) == 3
    assert _value(m, "redraft:blocks_committed_total", **s) == 3
    assert _value(m, "redraft:mbe_edits_total", **s) == 2 and _value(m, "redraft:mbe_window_sum", **s) == 3
    assert _value(m, "sglang:generation_tokens_total", **s) == 60 and _value(m, "sglang:num_requests_total", **s) == 1
    assert _value(m, "redraft:tokens_per_forward_sum", **s) == pytest.approx(60 / 13)
    assert _value(m, "sglang:queue_time_seconds_sum", **s) == 0.25
    assert _value(m, "sglang:e2e_request_latency_seconds_count", **s) == 1
    _aborted_and_failed_count_apart(m, lab)
    m.on_submit("c", SamplingParams())
    m.on_message(Rejected("c", 503, "queue full", "queue_full"))
    assert _value(m, "redraft:rejected_requests_total", code="queue_full", **lab) == 1
    assert not m._inflight
    m.on_message(_out("zzz", 5, 1, 1, finished=True))  # never submitted here: ignored, no error
    m.on_message(object())  # a callback must never raise into the receive loop
    m.set_engine_down()
    assert _value(m, "redraft:engine_up", **lab) == 0
    text = m.render().decode()
    assert set(re.findall(r'domain="([^"]*)"', text)) == {"code", "math", "other"}
    assert "_created" not in text
    # structured output: a constrained request's grammar figures (engine/decoding/constrained.py GrammarStats)
    assert _value(m, "redraft:constrained_requests_total", **s) == 0
    m.on_submit("g", SamplingParams(mode="S", domain="math", regex="[0-9]+"))
    m.on_message(Accepted("g", "S", 64))
    m.on_message(_out("g", 3, steps=2, blocks=1, finished=True, grammar={"rejected": 5, "remasked": 2, "forced": 1}))
    assert _value(m, "redraft:constrained_requests_total", **s) == 1
    assert [_value(m, f"redraft:grammar_{k}_total", **s) for k in ("rejected_tokens", "remasked_positions",
                                                                   "forced_tokens")] == [5, 2, 1]


def test_collector_never_raises(monkeypatch):
    from redraft.protocol.sampling_params import SamplingParams
    from redraft.server.metrics import ServerMetrics

    m = ServerMetrics("tiny")
    monkeypatch.setattr(m.ttft, "labels", lambda *a: 1 / 0)
    m.on_submit("a", SamplingParams(domain="code"))
    m.on_message(_out("a", 32, steps=2, blocks=1))  # the histogram fails: swallowed, logged
    assert m._callback_errors == 1


_MULTIPROC_CHILD = """
import sys
from redraft.protocol.sampling_params import SamplingParams
from redraft.protocol.messages import RequestOutput
from redraft.server.metrics import ServerMetrics
m = ServerMetrics("tiny")
m.on_submit("r", SamplingParams(mode="S", domain="code"))
m.on_message(RequestOutput("r", [1] * 40, True, {"type": "stop"}, meta={"steps": 8, "blocks": 2,
                                                                         "completion_tokens": 40, "prompt_tokens": 5}))
m.set_engine_stats({"num_running_reqs": int(sys.argv[1])}, {})
if sys.argv[2] == "render":
    sys.stdout.write(m.render().decode())
"""


def test_multiprocess_mode_merges_workers(tmp_path):
    """With PROMETHEUS_MULTIPROC_DIR, what every worker process recorded shows in any worker's /metrics."""
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    subprocess.run([sys.executable, "-c", _MULTIPROC_CHILD, "3", "quiet"], env=env, check=True, timeout=60)
    res = subprocess.run([sys.executable, "-c", _MULTIPROC_CHILD, "5", "render"], env=env, check=True, timeout=60,
                         capture_output=True, text=True)
    text = res.stdout
    labels = r'\{domain="code",mode="S",model_name="tiny"\}'
    requests = re.search(rf"^sglang:num_requests_total{labels} (\S+)$", text, re.M)
    assert requests and float(requests.group(1)) == 2.0, text[:3000]
    tokens = re.search(rf"^redraft:tokens_committed_total{labels} (\S+)$", text, re.M)
    assert tokens and float(tokens.group(1)) == 80.0
    # engine gauges are not summed across workers (there is one engine): the latest value of a live worker
    running = re.findall(r'^sglang:num_running_reqs\{[^}]*\} (\S+)$', text, re.M)
    assert [float(v) for v in running] == [5.0], running
