"""Deployment files checked by parsing: Dockerfile, docker-compose.yml, Prometheus, Grafana, Kubernetes, locust.

No Docker engine or cluster is needed. docker-compose.yml is validated against the compose-spec schema kept in
deploy/schemas (with jsonschema). Checks that need an optional tool skip without it: a Compose v2 CLI (`docker
compose config`), kubernetes-validate (Kubernetes OpenAPI schemas), kubectl (`kubectl kustomize`), promtool
(Debian's `prometheus` package: the dashboard's and the autoscaler's PromQL evaluated over the service's own
scrapes) and locust (`pip install -e '.[loadtest]'`).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from prometheus_client import CollectorRegistry

from service.config import Settings
from service.job_keys import GROUP, ITEM_STREAMS
from service.job_types import JobStatus
from service.metrics import Metrics
from service.processes import STOP_GRACE_S

REPO = Path(__file__).resolve().parent.parent
DEPLOY = REPO / "deploy"
K8S = DEPLOY / "k8s"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "batchasr.json"
# The jobs issue's metric names (registered by service/metrics.py): the dashboard and autoscalers read them.
JOB_METRIC_NAMES = {"batchasr_jobs_total", "batchasr_job_items_total", "batchasr_job_stream_lag"}
CONSUMER_GROUP = GROUP
FINAL_JOB_STATUSES = [s.value for s in JobStatus if s not in (JobStatus.QUEUED, JobStatus.IN_PROGRESS)]
SAMPLE_SUFFIXES = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count"),
                   "summary": ("", "_sum", "_count"), "info": ("_info",)}


# --- helpers -----------------------------------------------------------------------------------------------


def _exposed_names(registry: CollectorRegistry) -> set[str]:
    """The sample names a scrape of ``registry`` can show (counters as ``_total``, histograms' three)."""
    return {family.name + suffix for family in registry.collect()
            for suffix in SAMPLE_SUFFIXES.get(family.type, ("",))}


def service_metric_names() -> set[str]:
    return _exposed_names(Metrics().registry)


def settings_env_names() -> set[str]:
    return {f"BATCHASR_{name.upper()}" for name in Settings.model_fields}


def load_yaml_docs(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", (REPO / "Dockerfile").read_text())
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1] if " " in line else "") for line in lines]


def compose() -> dict:
    return yaml.safe_load((REPO / "docker-compose.yml").read_text())


def k8s_objects(directory: Path = K8S) -> dict[tuple[str, str], dict]:
    """Every object the kustomization in ``directory`` applies, by (kind, name)."""
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    objects = {}
    for resource in kustomization["resources"]:
        for doc in load_yaml_docs(directory / resource):
            key = (doc["kind"], doc["metadata"]["name"])
            assert key not in objects, f"{key} defined twice"
            objects[key] = doc
    return objects


def parse_quantity(text: str) -> int:
    """Bytes from a Kubernetes quantity (``4Gi``) or a Redis one (``2560mb``: binary, as Redis reads it)."""
    units = {"": 1, "ki": 2**10, "mi": 2**20, "gi": 2**30, "kb": 2**10, "mb": 2**20, "gb": 2**30}
    number = text.rstrip("".join(chr(c) for c in range(ord("A"), ord("z") + 1)))
    return int(number) * units[text[len(number):].lower()]


def container(deployment: dict) -> dict:
    (only,) = deployment["spec"]["template"]["spec"]["containers"]
    return only


def env_names(spec: dict) -> set[str]:
    return {item["name"] for item in spec.get("env", [])}


def promql_metric_names(expr: str) -> set[str]:
    return set(re.findall(r"\bbatchasr_[a-z0-9_]+\b", expr))


def dashboard_exprs() -> list[str]:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return [t["expr"] for p in panels for t in p.get("targets", [])]


def dashboard_panel_exprs(title: str, rate_interval: str) -> list[str]:
    """A panel's queries, with Grafana's ``$__rate_interval`` as given."""
    (panel,) = [p for p in json.loads(DASHBOARD.read_text())["panels"] if p["title"] == title]
    return [t["expr"].replace("$__rate_interval", rate_interval) for t in panel["targets"]]


def adapter_rule() -> dict:
    (rule,) = yaml.safe_load((K8S / "prometheus-adapter-values.yaml").read_text())["rules"]["custom"]
    return rule


def adapter_query(rule: dict, group_by: str, matchers: str) -> str:
    """The metricsQuery as prometheus-adapter sends it, its template filled in."""
    return rule["metricsQuery"].replace("<<.GroupBy>>", group_by).replace("<<.LabelMatchers>>", matchers)


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.skip("promtool not installed (Debian: apt-get install prometheus)")
    return path


def promtool_series(scrapes: list[str], labels: str = "") -> list[dict]:
    """promtool's ``input_series`` for /metrics texts taken one interval apart (``labels``, such as ``pod="p"``,
    added to each series as a scrape job would); a series missing from a scrape has no sample there."""
    from prometheus_client.parser import text_string_to_metric_families

    series: dict[str, list[str]] = {}
    for i, text in enumerate(scrapes):
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                pairs = [*(f'{k}="{v}"' for k, v in sorted(sample.labels.items())), *filter(None, [labels])]
                key = f"{sample.name}{{{','.join(pairs)}}}"
                series.setdefault(key, ["_"] * len(scrapes))[i] = repr(float(sample.value))
    return [{"series": key, "values": " ".join(values)} for key, values in series.items()]


def promtool_test(tmp_path: Path, scrapes: list[str], interval: str, tests: list[dict], labels: str = "") -> None:
    """``promtool test rules``: each of ``tests`` (expr, eval_time, exp_samples) evaluated over ``scrapes``."""
    spec = {"rule_files": [], "tests": [{"interval": interval, "input_series": promtool_series(scrapes, labels),
                                         "promql_expr_test": tests}]}
    path = tmp_path / "promql_test.yml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    result = subprocess.run([promtool(), "test", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


# --- Dockerfile --------------------------------------------------------------------------------------------


def test_dockerfile_is_multi_stage_cuda_non_root_with_healthcheck():
    steps = dockerfile_instructions()
    args = dict(a.split("=", 1) for i, a in steps if i == "ARG" and "=" in a)
    stages = [a for i, a in steps if i == "FROM"]
    assert len(stages) >= 2, "multi-stage build"
    final_base = stages[-1].split()[0].replace("${CUDA_IMAGE}", args.get("CUDA_IMAGE", ""))
    assert final_base.startswith("nvidia/cuda:") and "runtime" in final_base
    assert args["TORCH_SPEC"].strip('"').startswith("torch")
    assert any("pip install" in a and "$TORCH_SPEC" in a for i, a in steps if i == "RUN"), "torch installed"
    users = [a for i, a in steps if i == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0")
    (health,) = [a for i, a in steps if i == "HEALTHCHECK"]
    assert "/healthz" in health
    exposed = {int(p.split("/")[0]) for i, a in steps if i == "EXPOSE" for p in a.split()}
    env = dict(re.findall(r"(BATCHASR_[A-Z_]+)=(\S+)", " ".join(a for i, a in steps if i == "ENV")))
    assert set(env) <= settings_env_names()
    assert env["BATCHASR_HOST"] == "0.0.0.0" and int(env["BATCHASR_PORT"]) in exposed
    assert "BATCHASR_MODEL" not in env, "unset BATCHASR_MODEL means the embedded default model"
    assert [a for i, a in steps if i == "ENTRYPOINT"] == ['["batchasr"]']


def test_image_carries_the_embedded_model():
    copied = [a.split()[0] for i, a in dockerfile_instructions() if i == "COPY" and not a.startswith("--from")]
    assert "models" in copied
    package_data = (REPO / "pyproject.toml").read_text()
    assert re.search(r'models = \[[^\]]*"assets/\*"', package_data), "models/assets ships in the wheel"
    ignored = [line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")]
    assert ".git" in ignored
    assert not [p for p in ignored if p in ("models", "models/assets", "*.nemo", "**/*.nemo")]


# --- docker-compose.yml ------------------------------------------------------------------------------------


def test_compose_services_gpu_redis_and_monitoring():
    services = compose()["services"]
    assert {"api", "worker", "redis", "prometheus", "grafana"} <= set(services)
    for name in ("api", "worker"):
        (device,) = services[name]["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]
        assert set(services[name]["environment"]) <= settings_env_names(), name
    assert services["api"]["command"][0] == "serve"
    # Redis from the environment, not the command line (where a password shows in the process list)
    assert services["worker"]["command"][0] == "worker" and "--redis-url" not in services["worker"]["command"]
    assert services["worker"]["environment"]["BATCHASR_REDIS_URL"]
    assert "/readyz" in " ".join(services["api"]["healthcheck"]["test"])
    for name in ("api", "worker"):  # processes are given this long, then the engine drains: not cut off by the kill
        timeout_s = float(services[name]["environment"]["BATCHASR_REQUEST_TIMEOUT_S"])
        minutes, _, seconds = services[name]["stop_grace_period"].rstrip("s").partition("m")
        assert int(minutes) * 60 + int(seconds or 0) > timeout_s + STOP_GRACE_S, name
    assert services["redis"]["command"][services["redis"]["command"].index("--appendonly") + 1] == "yes"
    assert services["redis"]["command"][services["redis"]["command"].index("--maxmemory-policy") + 1] == "noeviction"
    mounts = {v.split(":")[0]: v.split(":")[1] for s in services.values() for v in s.get("volumes", [])
              if v.startswith("./")}
    for source in mounts:
        assert (REPO / source).exists(), source
    assert mounts["./deploy/prometheus.yml"] == "/etc/prometheus/prometheus.yml"
    provider = yaml.safe_load((DEPLOY / "grafana/provisioning/dashboards/batchasr.yml").read_text())
    assert provider["providers"][0]["options"]["path"] == mounts["./deploy/grafana/dashboards"]
    assert mounts["./deploy/grafana/provisioning"] == "/etc/grafana/provisioning"


def test_compose_file_matches_the_compose_spec_schema():
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads((DEPLOY / "schemas" / "compose-spec.json").read_text())
    validator = jsonschema.validators.validator_for(schema)(schema)
    errors = sorted(validator.iter_errors(compose()), key=str)
    assert not errors, "\n".join(f"{list(e.absolute_path)}: {e.message}" for e in errors)


def _compose_cli() -> list[str] | None:
    """`docker compose` (the v2 plugin) or a v2 `docker-compose` binary; None when neither is here."""
    for command in (["docker", "compose"], ["docker-compose"]):
        if shutil.which(command[0]) is None:
            continue
        version = subprocess.run([*command, "version", "--short"], capture_output=True, text=True, timeout=20)
        if version.returncode == 0 and version.stdout.strip().lstrip("v").startswith("2"):
            return command
    return None


def test_docker_compose_config():
    command = _compose_cli()
    if command is None:
        pytest.skip("no Compose v2 CLI (docker compose plugin or docker-compose v2)")
    result = subprocess.run([*command, "-f", str(REPO / "docker-compose.yml"), "config", "--quiet"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


# --- Prometheus and Grafana --------------------------------------------------------------------------------


def _option(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def test_prometheus_scrapes_api_and_worker_metrics():
    config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    services = compose()["services"]
    expected = {"batchasr-api": f"api:{services['api']['environment']['BATCHASR_PORT']}",
                "batchasr-worker": f"worker:{_option(services['worker']['command'], '--metrics-port')}"}
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    for name, target in expected.items():
        assert [t for sc in jobs[name]["static_configs"] for t in sc["targets"]] == [target]
        assert jobs[name].get("metrics_path", "/metrics") == "/metrics"


def test_dashboard_uses_only_metrics_the_service_exports():
    exported = service_metric_names()
    assert exported >= JOB_METRIC_NAMES
    used = set().union(*map(promql_metric_names, dashboard_exprs()))
    assert used, "no batchasr metric in the dashboard"
    assert not used - exported, f"dashboard metrics the service does not export: {sorted(used - exported)}"


def test_dashboard_covers_throughput_queue_latency_jobs_and_gpu():
    used = set().union(*map(promql_metric_names, dashboard_exprs()))
    bases = {re.sub(r"_(total|bucket|sum|count)$", "", name) for name in used}
    assert {"batchasr_audio_seconds", "batchasr_compute_seconds", "batchasr_rtfx", "batchasr_queue_depth",
            "batchasr_queue_wait_seconds", "batchasr_batch_size", "batchasr_request_duration_seconds",
            "batchasr_job_items", "batchasr_job_stream_lag", "batchasr_gpu_memory_bytes"} <= bases
    assert any("histogram_quantile(0.99" in e and "request_duration" in e for e in dashboard_exprs())


def test_dashboard_panels_use_the_provisioned_datasource():
    dashboard = json.loads(DASHBOARD.read_text())
    (source,) = yaml.safe_load((DEPLOY / "grafana/provisioning/datasources/prometheus.yml").read_text())["datasources"]
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        for t in panel.get("targets", []):
            assert t["datasource"]["uid"] == source["uid"], panel["title"]
            assert t["expr"].count("(") == t["expr"].count(")"), panel["title"]


def test_promtool_accepts_the_prometheus_config_and_every_query(tmp_path):
    """Each dashboard query and the adapter's, as recording rules: promtool parses them as Prometheus would."""
    tool = promtool()
    result = subprocess.run([tool, "check", "config", str(DEPLOY / "prometheus.yml")], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    exprs = [e.replace("$__rate_interval", "1m") for e in dashboard_exprs()]
    exprs.append(adapter_query(adapter_rule(), "namespace,pod", 'namespace="default",pod="p"'))
    rules = {"groups": [{"name": "batchasr", "rules": [{"record": f"batchasr:query_{i}", "expr": expr}
                                                        for i, expr in enumerate(exprs)]}]}
    (tmp_path / "rules.yml").write_text(yaml.safe_dump(rules))
    result = subprocess.run([tool, "check", "rules", str(tmp_path / "rules.yml")], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_dashboard_job_panels_count_the_first_job_and_item_of_each_status(tmp_path):
    """Prometheus evaluates the job panels over two scrapes, one before a job and one after it finished with a failed
    item. The counters by status used to appear only when first counted, at 1: rate() and increase() had no sample
    before it to count from, and the panels showed neither the job nor its failed item."""
    metrics = Metrics()
    before = metrics.render().decode()
    for status in ("completed", "completed", "failed"):
        metrics.count_job_item(status)
    metrics.count_job("completed_with_errors")
    after = metrics.render().decode()
    (items,) = dashboard_panel_exprs("Job items by status", "2m")
    (jobs,) = dashboard_panel_exprs("Jobs by final status", "2m")
    promtool_test(tmp_path, [before, after], "1m", [
        {"expr": items, "eval_time": "1m", "exp_samples": [  # per second over the 2 min window
            {"labels": '{status="completed"}', "value": 2 / 120}, {"labels": '{status="failed"}', "value": 1 / 120}]},
        {"expr": jobs, "eval_time": "1m", "exp_samples": [
            {"labels": f'{{status="{status}"}}', "value": float(status == "completed_with_errors")}
            for status in FINAL_JOB_STATUSES]},
    ])


def test_queue_wait_panel_shows_http_requests_and_job_items_apart(tmp_path):
    """Job items wait behind HTTP requests by design: the panel summed the two, so a minute-long bulk wait showed as
    the API's (54.6 s, the mean of four 0.5 s requests and forty 60 s items) where the autoscaler read 0.5 s."""
    metrics = Metrics()

    def minute(m: int) -> None:
        metrics.observe_batch(44, 16.0, 16.0, 16.0, 0.2, {}, [(0.5, "http")] * 4 + [(60.0, "job")] * 40)

    scrapes = minutes_of(metrics, 3, minute)
    mean = dashboard_panel_exprs("Queue wait", "2m")[-1]
    promtool_test(tmp_path, scrapes, "1m", [{"expr": mean, "eval_time": "2m", "exp_samples": [
        {"labels": '{source="http"}', "value": 0.5}, {"labels": '{source="job"}', "value": 60.0}]}])


def test_usage_panel_counts_each_keys_first_batch(tmp_path):
    """Prometheus evaluates the usage panel over two scrapes, one as the service started and one after a key's first
    batch: the keys' series are there from the start at 0, so the panel counts that batch's seconds (a series that
    appeared at its first value would give rate() nothing to count from)."""
    metrics = Metrics()
    metrics.expect_owners(["a1", "b2"])
    before = metrics.render().decode()
    metrics.count_owner_audio({("a1", "http"): 60.0, ("b2", "job"): 120.0})
    after = metrics.render().decode()
    (usage,) = dashboard_panel_exprs("Audio seconds per second by API key", "2m")
    promtool_test(tmp_path, [before, after], "1m", [
        {"expr": usage, "eval_time": "1m", "exp_samples": [  # per second over the 2 min window
            {"labels": f'{{owner="{owner}",source="{source}"}}', "value": seconds / 120}
            for owner, source, seconds in (("a1", "http", 60), ("a1", "job", 0), ("b2", "http", 0),
                                           ("b2", "job", 120))]},
    ])


def test_adapter_query_gives_the_hpa_a_value_at_a_one_minute_scrape_interval(tmp_path):
    """A pod scraped every minute (Prometheus's default, and the prometheus-community chart's), its HTTP requests
    waiting 0.25 s each: the adapter's query reads 0.25 between scrapes too. Its [1m] window held one scrape there, and
    gave the HPA no metric at all."""
    metrics = Metrics()
    scrapes = []
    for _ in range(4):
        scrapes.append(metrics.render().decode())
        metrics.observe_batch(4, 8.0, 8.0, 8.0, 0.1, {}, [(0.25, "http")] * 4 + [(30.0, "job")])
    query = adapter_query(adapter_rule(), "pod", 'namespace="default",pod="api-0"')
    promtool_test(tmp_path, scrapes, "1m", [{"expr": query, "eval_time": "3m20s",
                                             "exp_samples": [{"labels": '{pod="api-0"}', "value": 0.25}]}],
                  labels='namespace="default",pod="api-0"')


def test_adapter_query_gives_the_hpa_a_value_for_a_pod_that_has_served_no_request(tmp_path):
    """A pod exported no queue-wait series until its first HTTP request: the HPA got no metric from a new pod, or
    from a deployment used only for jobs (FailedGetPodsMetric, never scaling). Idle, it reads 0."""
    metrics = Metrics()
    scrapes = [metrics.render().decode() for _ in range(4)]
    query = adapter_query(adapter_rule(), "pod", 'namespace="default",pod="api-0"')
    promtool_test(tmp_path, scrapes, "1m", [{"expr": query, "eval_time": "3m20s",
                                             "exp_samples": [{"labels": '{pod="api-0"}', "value": 0}]}],
                  labels='namespace="default",pod="api-0"')


# --- alerting rules ------------------------------------------------------------------------------------------


ALERTS = DEPLOY / "alerts.yml"


def alert_rules() -> list[dict]:
    return [rule for group in yaml.safe_load(ALERTS.read_text())["groups"] for rule in group["rules"]]


def test_alerts_load_and_use_only_metrics_the_service_exports():
    result = subprocess.run([promtool(), "check", "rules", str(ALERTS)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    used = set().union(*(promql_metric_names(rule["expr"]) for rule in alert_rules()))
    assert used and not used - service_metric_names(), sorted(used - service_metric_names())
    assert all(rule["labels"]["severity"] in ("warning", "critical") and rule["annotations"]["summary"]
               for rule in alert_rules())
    # Prometheus loads them from beside its config, in the container as here
    assert yaml.safe_load((DEPLOY / "prometheus.yml").read_text())["rule_files"] == ["alerts.yml"]
    assert "./deploy/alerts.yml:/etc/prometheus/alerts.yml:ro" in compose()["services"]["prometheus"]["volumes"]


def promtool_alerts(tmp_path: Path, scrapes: list[str], tests: list[dict]) -> None:
    """``promtool test rules``: the alerts firing (``exp_alerts``: their labels) at each ``eval_time`` over
    ``scrapes`` taken a minute apart. Their annotations are left out: what is tested is when each fires."""
    groups = yaml.safe_load(ALERTS.read_text())["groups"]
    for group in groups:
        for rule in group["rules"]:
            rule.pop("annotations", None)
    (tmp_path / "alerts.yml").write_text(yaml.safe_dump({"groups": groups}))
    spec = {"rule_files": ["alerts.yml"], "evaluation_interval": "1m",
            "tests": [{"interval": "1m", "input_series": promtool_series(scrapes), "alert_rule_test": tests}]}
    (tmp_path / "alerts_test.yml").write_text(yaml.safe_dump(spec, sort_keys=False))
    result = subprocess.run([promtool(), "test", "rules", str(tmp_path / "alerts_test.yml")], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def minutes_of(metrics: Metrics, minutes: int, each_minute=lambda minute: None) -> list[str]:
    """A scrape of ``metrics`` a minute for ``minutes`` minutes, ``each_minute(minute)`` counted before each."""
    scrapes = []
    for minute in range(minutes):
        each_minute(minute)
        scrapes.append(metrics.render().decode())
    return scrapes


def test_jobs_stalled_fires_a_quarter_hour_after_a_backlog_stops_moving(tmp_path):
    """Items finish every minute for ten minutes, then none does while the backlog stays: nothing finished in the
    15 min window from about minute 25, and the alert fires 15 min after that; a backlog that keeps moving never."""
    stopping = Metrics()
    stopping.observe_job_backlog(3, 4)
    moving = Metrics()
    moving.observe_job_backlog(3, 4)

    def minute(m: int) -> None:
        if m < 10:
            stopping.count_job_item("completed")

    promtool_alerts(tmp_path, minutes_of(stopping, 50, minute), [
        {"eval_time": "30m", "alertname": "BatchasrJobsStalled", "exp_alerts": []},
        {"eval_time": "45m", "alertname": "BatchasrJobsStalled",
         "exp_alerts": [{"exp_labels": {"severity": "critical"}}]}])
    promtool_alerts(tmp_path, minutes_of(moving, 50, lambda m: moving.count_job_item("completed")), [
        {"eval_time": "45m", "alertname": "BatchasrJobsStalled", "exp_alerts": []}])


def test_job_store_at_risk_fires_with_the_risk_the_consumers_read(tmp_path):
    metrics = Metrics()
    promtool_alerts(tmp_path, minutes_of(metrics, 30, lambda minute: metrics.observe_job_store_risks(
        ("no_appendonly",) if minute >= 5 else ())), [
        {"eval_time": "10m", "alertname": "BatchasrJobStoreAtRisk", "exp_alerts": []},
        {"eval_time": "20m", "alertname": "BatchasrJobStoreAtRisk",
         "exp_alerts": [{"exp_labels": {"severity": "warning", "risk": "no_appendonly"}}]}])


def test_dead_letters_and_failed_webhooks_fire_for_half_an_hour(tmp_path):
    metrics = Metrics()

    def minute(m: int) -> None:
        if m == 3:
            metrics.count_job_item_dead_lettered()
            metrics.count_webhook("failed")

    scrapes = minutes_of(metrics, 50, minute)
    firing = [{"exp_labels": {"severity": "warning"}}]
    promtool_alerts(tmp_path, scrapes, [
        {"eval_time": f"{at}m", "alertname": name, "exp_alerts": firing if at == 10 else []}
        for name in ("BatchasrJobItemsDeadLettered", "BatchasrWebhooksFailing") for at in (2, 10, 45)])


def test_server_errors_fire_past_one_request_in_twenty_and_a_full_queue_after_a_quarter_hour(tmp_path):
    metrics = Metrics()

    def minute(m: int) -> None:
        for _ in range(10):
            metrics.observe_request("transcriptions", 200, 0.2)
        metrics.observe_request("transcriptions", 503, 0.01)  # 1 in 11: 9%
        metrics.observe_request("transcriptions", 429, 0.01)

    critical, warning = [{"exp_labels": {"severity": "critical"}}], [{"exp_labels": {"severity": "warning"}}]
    promtool_alerts(tmp_path, minutes_of(metrics, 40, minute), [
        {"eval_time": "8m", "alertname": "BatchasrServerErrors", "exp_alerts": []},
        {"eval_time": "20m", "alertname": "BatchasrServerErrors", "exp_alerts": critical},
        {"eval_time": "12m", "alertname": "BatchasrQueueFull", "exp_alerts": []},
        {"eval_time": "30m", "alertname": "BatchasrQueueFull", "exp_alerts": warning}])
    healthy = Metrics()
    scrapes = minutes_of(healthy, 40, lambda m: healthy.observe_request("transcriptions", 200, 0.2))
    promtool_alerts(tmp_path, scrapes, [{"eval_time": "30m", "alertname": name, "exp_alerts": []}
                                        for name in ("BatchasrServerErrors", "BatchasrQueueFull")])
    paced = Metrics()  # a backfill submit paced by its key's limit on queued items: 429 on the job routes, by design

    def backfill_minute(m: int) -> None:
        paced.observe_request("/v1/transcribe", 200, 0.2)
        for _ in range(2):
            paced.observe_request("/v1/jobs", 429, 0.01)
        paced.observe_request("/v1/jobs/{job_id}/retry", 429, 0.01)

    promtool_alerts(tmp_path, minutes_of(paced, 40, backfill_minute),
                    [{"eval_time": "30m", "alertname": "BatchasrQueueFull", "exp_alerts": []}])


def test_queue_wait_fires_on_http_waits_not_on_job_items_waiting(tmp_path):
    """Job items wait behind HTTP requests by design (a lower priority): only HTTP's wait counts."""
    for http_wait_s, firing in ((8.0, [{"exp_labels": {"severity": "warning"}}]), (0.5, [])):
        metrics = Metrics()
        waits = [(http_wait_s, "http")] * 4 + [(60.0, "job")] * 4  # (seconds, source) per item of a batch

        def minute(m: int, metrics: Metrics = metrics, waits: list = waits) -> None:
            metrics.observe_batch(8, 16.0, 16.0, 16.0, 0.2, {}, waits)

        promtool_alerts(tmp_path, minutes_of(metrics, 30, minute), [
            {"eval_time": "25m", "alertname": "BatchasrQueueWaitHigh", "exp_alerts": firing}])


# --- Kubernetes --------------------------------------------------------------------------------------------


def test_k8s_manifests_have_the_expected_kinds():
    kinds = {kind for kind, _ in k8s_objects()}
    assert {"ConfigMap", "Deployment", "Service", "PodDisruptionBudget", "HorizontalPodAutoscaler",
            "ScaledObject", "StatefulSet"} <= kinds
    listed = set(yaml.safe_load((K8S / "kustomization.yaml").read_text())["resources"])
    manifests = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml", "prometheus-adapter-values.yaml"}
    assert manifests == listed, "every manifest is in the kustomization"


def test_k8s_api_deployment_probes_gpu_ports_and_termination():
    objects = k8s_objects()
    api = objects["Deployment", "batchasr-api"]
    pod, c = api["spec"]["template"]["spec"], container(api)
    assert c["args"] == ["serve"]
    assert int(c["resources"]["limits"]["nvidia.com/gpu"]) == 1
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz?redis=optional"  # Redis away: transcription goes on
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    config = objects["ConfigMap", "batchasr-config"]["data"]
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports["http"] == int(config["BATCHASR_PORT"])
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert c[probe]["httpGet"]["port"] in (*ports, *ports.values()), probe
    annotations = api["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == config["BATCHASR_PORT"]
    sleep_s = int(c["lifecycle"]["preStop"]["exec"]["command"][-1])
    # the front ends' and consumers' graceful stop, then the engine's drain: not cut off by the kubelet's kill
    assert pod["terminationGracePeriodSeconds"] > sleep_s + float(config["BATCHASR_REQUEST_TIMEOUT_S"]) + STOP_GRACE_S
    service = objects["Service", "batchasr-api"]
    assert {p["targetPort"] for p in service["spec"]["ports"]} <= set(ports)


def test_k8s_redis_refuses_writes_when_full_rather_than_dropping_jobs():
    redis = next(o for (kind, _), o in k8s_objects().items() if kind == "StatefulSet")
    c = container(redis)
    args = c["args"]
    assert args[args.index("--maxmemory-policy") + 1] == "noeviction"
    assert args[args.index("--appendonly") + 1] == "yes"
    limit = parse_quantity(c["resources"]["limits"]["memory"])
    maxmemory = parse_quantity(args[args.index("--maxmemory") + 1])
    assert maxmemory <= 0.75 * limit  # room for the fork that rewrites the append-only file


def test_k8s_selectors_match_their_pods():
    objects = k8s_objects()
    for (kind, name), obj in objects.items():
        if kind in ("Deployment", "StatefulSet"):
            labels = obj["spec"]["template"]["metadata"]["labels"]
            assert obj["spec"]["selector"]["matchLabels"].items() <= labels.items(), name
    for (kind, name), obj in objects.items():
        if kind == "Service":
            selector = obj["spec"]["selector"]
        elif kind == "PodDisruptionBudget":
            selector = obj["spec"]["selector"]["matchLabels"]
        else:
            continue
        pods = [o["spec"]["template"]["metadata"]["labels"] for (k, _), o in objects.items()
                if k in ("Deployment", "StatefulSet")]
        assert any(selector.items() <= labels.items() for labels in pods), f"{kind} {name} selects no pod"


def test_k8s_env_names_are_service_settings():
    objects = k8s_objects()
    known = settings_env_names()
    assert set(objects["ConfigMap", "batchasr-config"]["data"]) <= known
    for (kind, _name), obj in objects.items():
        if kind == "Deployment":
            c = container(obj)
            assert env_names(c) <= known
            refs = {ref["configMapRef"]["name"] for ref in c.get("envFrom", []) if "configMapRef" in ref}
            assert all(("ConfigMap", ref) in objects for ref in refs)


def test_k8s_workers_know_the_api_keys_as_the_api_does():
    """The keys name each key's usage series at 0 from the start; a worker without them counted a key's first job
    batch as that series' first sample, which increase() and rate() leave out."""
    objects = k8s_objects()
    keys = [[e for e in container(objects["Deployment", name]).get("env", []) if e["name"] == "BATCHASR_API_KEYS"]
            for name in ("batchasr-api", "batchasr-worker")]
    assert keys[0] and keys[0] == keys[1]


def test_k8s_worker_scales_on_stream_lag_with_keda():
    objects = k8s_objects()
    worker = objects["Deployment", "batchasr-worker"]
    c = container(worker)
    assert c["args"][0] == "worker" and "--redis-url" not in c["args"]  # from BATCHASR_REDIS_URL (the ConfigMap)
    metrics_port = _option(c["args"], "--metrics-port")
    assert worker["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"] == metrics_port
    assert {p["containerPort"] for p in c["ports"]} == {int(metrics_port)}
    assert int(c["resources"]["limits"]["nvidia.com/gpu"]) == 1
    timeout_s = float(objects["ConfigMap", "batchasr-config"]["data"]["BATCHASR_REQUEST_TIMEOUT_S"])
    assert worker["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > timeout_s + STOP_GRACE_S
    scaled = objects["ScaledObject", "batchasr-worker"]
    assert scaled["apiVersion"] == "keda.sh/v1alpha1"
    assert scaled["spec"]["scaleTargetRef"]["name"] == "batchasr-worker"
    triggers = [t for t in scaled["spec"]["triggers"] if t["type"] != "prometheus"]
    assert sorted(t["metadata"]["stream"] for t in triggers) == sorted(ITEM_STREAMS.values())  # every priority's
    # API keys' streams are named as keys come: the lag over every stream, from Prometheus, covers them
    (every,) = [t["metadata"] for t in scaled["spec"]["triggers"] if t["type"] == "prometheus"]
    # waiting items only: those in a consumer's hands are being worked through, and a worker added for them would
    # find nothing to read (2,000 items one consumer held asked for 8 workers)
    assert promql_metric_names(every["query"]) == {"batchasr_job_items_waiting"} <= service_metric_names()
    assert every["threshold"] == triggers[0]["metadata"]["lagCount"] and every["activationThreshold"] == "0"
    adapter = yaml.safe_load((K8S / "prometheus-adapter-values.yaml").read_text())["prometheus"]
    assert every["serverAddress"] == f"{adapter['url']}:{adapter['port']}"
    redis_url = objects["ConfigMap", "batchasr-config"]["data"]["BATCHASR_REDIS_URL"]
    # KEDA connects from its own namespace: a bare Service name was looked up there ("no such host")
    namespace = yaml.safe_load((K8S / "kustomization.yaml").read_text())["namespace"]
    assert objects["Namespace", namespace]
    for trigger in triggers:
        meta = trigger["metadata"]
        assert trigger["type"] == "redis-streams"
        assert meta["address"] == f"batchasr-redis.{namespace}.svc:6379"
        assert meta["consumerGroup"] == CONSUMER_GROUP
        assert int(meta["lagCount"]) > 0 and "activationLagCount" in meta
        assert all(isinstance(v, str) for v in meta.values()), "KEDA trigger metadata values are strings"
        host, port = meta["address"].split(":")
        service = host.removesuffix(f".{namespace}.svc")  # the pods' URL names it within the namespace
        assert redis_url.startswith(f"redis://{service}:{port}/{meta.get('databaseIndex', '0')}")
    assert int(port) in {p["port"] for p in objects["Service", service]["spec"]["ports"]}


def test_k8s_api_hpa_reads_the_adapter_queue_wait_metric():
    objects = k8s_objects()
    hpa = objects["HorizontalPodAutoscaler", "batchasr-api"]
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "batchasr-api"}
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods"
    adapter = yaml.safe_load((K8S / "prometheus-adapter-values.yaml").read_text())
    (rule,) = adapter["rules"]["custom"]
    assert rule["name"]["as"] == metric["pods"]["metric"]["name"]
    used = promql_metric_names(rule["seriesQuery"]) | promql_metric_names(rule["metricsQuery"])
    assert used and used <= service_metric_names()
    assert {"batchasr_queue_wait_seconds_sum", "batchasr_queue_wait_seconds_count"} <= used
    # HTTP requests' waits only: job items wait by design, and would scale the API on bulk backlog
    assert 'source="http"' in rule["seriesQuery"] and rule["metricsQuery"].count('source="http"') == 2
    # a rate needs two scrapes in its window: at Prometheus's default interval of 1 m, a [1m] window holds one
    windows = re.findall(r"\[(\d+)m\]", rule["metricsQuery"])
    assert windows and min(map(int, windows)) >= 2
    # more replicas than the PDB keeps: a node drain can always evict one
    assert hpa["spec"]["minReplicas"] > objects["PodDisruptionBudget", "batchasr-api"]["spec"]["minAvailable"]


def test_k8s_manifests_match_kubernetes_schemas():
    pytest.importorskip("kubernetes_validate", reason="kubernetes-validate carries the Kubernetes schemas")
    import kubernetes_validate

    for (kind, name), obj in k8s_objects().items():
        if obj["apiVersion"].startswith("keda.sh/"):
            continue  # a CRD: its fields are checked above
        kubernetes_validate.validate(obj, "1.30", strict=True)
        assert obj["metadata"]["name"] == name, kind


def kustomize(directory: Path) -> list[dict]:
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl not installed")
    result = subprocess.run(["kubectl", "kustomize", str(directory)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def test_kustomize_builds():
    built = kustomize(K8S)
    assert len(built) == len(k8s_objects())
    deployments = [d["spec"]["template"]["spec"] for d in built if d["kind"] == "Deployment"]
    images = {c["image"] for pod in deployments for c in pod["containers"]}
    assert images == {"batchasr:0.1.0"}


# --- with the Prometheus Operator (deploy/k8s/monitoring) ---------------------------------------------------------

MONITORING = K8S / "monitoring"


def test_operator_rules_are_the_alerts_prometheus_loads():
    """The PrometheusRule holds deploy/alerts.yml's group, rule for rule (the promtool tests above cover both)."""
    rule = k8s_objects(MONITORING)[("PrometheusRule", "batchasr")]
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["spec"]["groups"] == yaml.safe_load((DEPLOY / "alerts.yml").read_text())["groups"]


def test_pod_monitor_scrapes_every_pod_the_annotations_name_and_nothing_else():
    """What Prometheus's usual kubernetes-pods job scrapes by the pods' prometheus.io annotations, the PodMonitor
    scrapes: for each Deployment whose pods say prometheus.io/scrape, an endpoint on the container port of that
    number, at that path."""
    monitor = k8s_objects(MONITORING)[("PodMonitor", "batchasr")]
    selector = monitor["spec"]["selector"]["matchLabels"]
    scraped = set()
    for (kind, name), obj in k8s_objects().items():
        if kind != "Deployment":
            continue
        pod = obj["spec"]["template"]
        annotations = pod["metadata"].get("annotations", {})
        if annotations.get("prometheus.io/scrape") != "true":
            continue
        assert selector.items() <= pod["metadata"]["labels"].items(), name
        ports = {port["containerPort"]: port["name"] for port in container(obj)["ports"]}
        scraped.add((ports[int(annotations["prometheus.io/port"])], annotations["prometheus.io/path"]))
    assert scraped == {("http", "/metrics"), ("metrics", "/metrics")}
    assert {(e["port"], e["path"]) for e in monitor["spec"]["podMetricsEndpoints"]} == scraped


def test_monitoring_kustomization_builds_and_lists_every_manifest():
    listed = set(yaml.safe_load((MONITORING / "kustomization.yaml").read_text())["resources"])
    assert listed == {p.name for p in MONITORING.glob("*.yaml")} - {"kustomization.yaml"}
    built = kustomize(MONITORING)
    assert {(doc["kind"], doc["metadata"]["name"]) for doc in built} == set(k8s_objects(MONITORING))
    # beside the pods the PodMonitor selects (in its own namespace)
    namespace = yaml.safe_load((K8S / "kustomization.yaml").read_text())["namespace"]
    assert all(doc["metadata"]["namespace"] == namespace for doc in built)
    assert all(doc["metadata"]["labels"]["app.kubernetes.io/part-of"] == "batchasr" for doc in built)


# --- load tests --------------------------------------------------------------------------------------------

LOCUST_PROBE = """
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("locustfile", sys.argv[1])
module = importlib.util.module_from_spec(spec)
sys.modules["locustfile"] = module
spec.loader.exec_module(module)
from locust import HttpUser
users = {name: [t.__name__ for t in cls.tasks] for name, cls in vars(module).items()
         if isinstance(cls, type) and issubclass(cls, HttpUser) and not cls.__dict__.get("abstract")}
short, long = module.audio_pool()
print(json.dumps({"users": users, "short": len(short), "long": [c.duration_s for c in long],
                  "calls": [c.duration_s for c in module.call_pool()],
                  "loopback": [module.is_loopback(u) for u in sys.argv[2:]]}))
"""


def test_locustfile_defines_http_and_jobs_users(tmp_path):
    if importlib.util.find_spec("locust") is None:
        pytest.skip("locust not installed (pip install -e '.[loadtest]')")
    import wave

    for i, seconds in enumerate((1.0, 2.0)):
        with wave.open(str(tmp_path / f"clip{i}.wav"), "wb") as w:
            w.setparams((1, 2, 16000, 0, "NONE", "not compressed"))
            w.writeframes(b"\0\0" * int(16000 * seconds))
    # a subprocess: importing locust monkey-patches the standard library (gevent), which must not leak here
    result = subprocess.run(
        [sys.executable, "-c", LOCUST_PROBE, str(REPO / "loadtest" / "locustfile.py"),
         "http://127.0.0.1:8000", "http://localhost:9", "http://[::1]:8000", "http://10.1.2.3:8000",
         "http://example.com"],
        capture_output=True, text=True, timeout=60, env={**os.environ, "LOADTEST_AUDIO_DIR": str(tmp_path)},
    )
    assert result.returncode == 0, result.stderr
    probe = json.loads(result.stdout.strip().splitlines()[-1])
    assert probe["users"] == {"TranscribeUser": ["openai_transcriptions", "streamed_transcription",
                                                 "native_transcribe", "stereo_call"],
                              "JobsUser": ["bulk_job"]}
    assert probe["short"] == 2 and probe["long"] and min(probe["long"]) >= 30  # joined from the short clips
    assert sorted(probe["calls"]) == [1.0 + 2.5 + 2.0] * 2  # one clip a side, 2.5 s apart
    assert probe["loopback"] == [True, True, True, False, False]


LOCUST_CHECKS_PROBE = """
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("locustfile", sys.argv[1])
module = importlib.util.module_from_spec(spec)
sys.modules["locustfile"] = module
spec.loader.exec_module(module)


class Response:  # what a catch_response block is given: status, text, and failure() to mark it
    def __init__(self, status_code, text="", error=None):
        self.status_code, self.text, self.error, self.failed = status_code, text, error, None

    def json(self):
        return json.loads(self.text)

    def failure(self, why):
        self.failed = why


short, long = module.audio_pool()
clip = next(c for c in short if c.name == "fox.wav")
checks = {}
for name, heard in (("right", "the Quick brown fox."), ("wrong", "the quick brown box"), ("none", None)):
    response = Response(200)
    module._check_text(response, heard, clip.text, clip.name)
    checks[name] = response.failed
refused = Response(0, error=ConnectionRefusedError(111, "Connection refused"))
module._json_or_fail(refused, 200, {"text"})
print(json.dumps({"texts": [c.text for c in short], "long": [c.text for c in long],
                  "calls": [c.channel_texts for c in module.call_pool()], "checks": checks,
                  "refused": refused.failed}))
"""


def _wav(path: Path, seconds: float) -> None:
    import wave

    with wave.open(str(path), "wb") as w:
        w.setparams((1, 2, 16000, 0, "NONE", "not compressed"))
        w.writeframes(b"\0\0" * int(16000 * seconds))


def test_locustfile_fails_a_wrong_transcript_and_says_why_no_answer_came(tmp_path):
    """A 200 with the wrong words used to count as a success, and a refused connection failed as "HTTP 0"."""
    if importlib.util.find_spec("locust") is None:
        pytest.skip("locust not installed (pip install -e '.[loadtest]')")
    _wav(tmp_path / "fox.wav", 1.0)
    _wav(tmp_path / "dog.wav", 2.0)
    (tmp_path / "expected.json").write_text(json.dumps({"fox.wav": "the quick brown fox", "dog.wav": "a lazy dog"}))
    result = subprocess.run([sys.executable, "-c", LOCUST_CHECKS_PROBE, str(REPO / "loadtest" / "locustfile.py")],
                            capture_output=True, text=True, timeout=60,
                            env={**os.environ, "LOADTEST_AUDIO_DIR": str(tmp_path)})
    assert result.returncode == 0, result.stderr
    probe = json.loads(result.stdout.strip().splitlines()[-1])
    assert probe["texts"] == ["a lazy dog", "the quick brown fox"]
    assert all(set(text.split()) == {"a", "lazy", "dog", "the", "quick", "brown", "fox"} for text in probe["long"])
    assert sorted(map(tuple, probe["calls"])) == [("a lazy dog", "the quick brown fox"),
                                                  ("the quick brown fox", "a lazy dog")]
    assert probe["checks"]["right"] is None  # case and punctuation aside
    assert "1 of 4 words wrong" in probe["checks"]["wrong"] and "4 of 4" in probe["checks"]["none"]
    assert probe["refused"].startswith("no response: ConnectionRefusedError")


def test_locust_stops_at_once_when_its_audio_folder_holds_no_audio(tmp_path):
    """Not a whole run of tasks that each fail on it, the reason only in locust's log file."""
    if importlib.util.find_spec("locust") is None:
        pytest.skip("locust not installed (pip install -e '.[loadtest]')")
    (tmp_path / "notes.txt").write_text("not audio")
    command = ["locust", "-f", str(REPO / "loadtest" / "locustfile.py"), "--headless", "--host", "http://127.0.0.1:9",
               "--users", "1", "--run-time", "20s", "--logfile", str(tmp_path / "locust.log"), "--only-summary"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=60,
                            env={**os.environ, "LOADTEST_AUDIO_DIR": str(tmp_path)})
    assert result.returncode == 2
    assert f"LOADTEST_AUDIO_DIR={tmp_path} holds no audio" in result.stderr


@pytest.mark.parametrize("host", ["http://192.0.2.1:8000", "http://127.0.0.1.nip.io:8000", "http://127.evil.example",
                                  "http://localhost:8000@example.com/"])
def test_run_sh_refuses_hosts_off_this_machine(host, tmp_path):
    """Names that start like a loopback address passed a pattern, and /metrics was fetched from them first."""
    script = REPO / "loadtest" / "run.sh"
    result = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=20,
                            env={"LOADTEST_HOST": host, "LOADTEST_RESULTS_DIR": str(tmp_path / "results"),
                                 "PATH": "/usr/bin:/bin"})
    assert result.returncode == 2 and "refusing" in result.stderr
    assert not (tmp_path / "results").exists()  # nothing fetched


def _metrics(audio_s: float, compute_s: float) -> str:
    return f"batchasr_audio_seconds_total {audio_s}\nbatchasr_compute_seconds_total {compute_s}\n"


@pytest.mark.parametrize(("scrapes", "expected"), [
    ([_metrics(100, 4), _metrics(150, 6)], "audio 50.0 s, engine compute 2.0 s, RTFx 25.00"),
    ([_metrics(100, 4)], "no RTFx: no /metrics snapshot after the run"),  # the server went away
    ([_metrics(100, 4), _metrics(20, 1)], "no RTFx: the server's counters went back"),  # it restarted
])
def test_run_sh_gives_no_rtfx_without_both_snapshots_of_one_server(tmp_path, scrapes, expected):
    """A snapshot missing, or taken from a restarted server, used to count as zeros: negative seconds, and an RTFx
    that looked real."""
    import http.server
    import threading

    answers = list(scrapes)

    class Metrics(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = answers.pop(0).encode() if answers else b""
            self.send_response(200 if body else 503)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "locust").write_text("#!/bin/sh\nexit 0\n")  # the load itself is not what is tested
    (fake / "locust").chmod(0o755)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Metrics)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        result = subprocess.run(["bash", str(REPO / "loadtest" / "run.sh")], capture_output=True, text=True,
                                timeout=60, env={**os.environ, "PATH": f"{fake}:{os.environ['PATH']}",
                                                 "LOADTEST_HOST": f"http://127.0.0.1:{server.server_address[1]}",
                                                 "LOADTEST_RESULTS_DIR": str(tmp_path / "results")})
    finally:
        server.shutdown()
        server.server_close()
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "results" / "rtfx.txt").read_text().startswith(expected)
    assert f"server: {expected}" in result.stdout
