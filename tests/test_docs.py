"""The README and deploy/README checked against what they document: every setting, metric and command-line option
is in the README, and the README names none that is not there; deploy/README's autoscaling and shutdown figures are
the manifests', and its streams and consumer group the ones the workers use."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest
import yaml
from prometheus_client.metrics import MetricWrapperBase

from service.cli import build_parser
from service.config import OTHER_VARIABLES, Settings
from service.job_keys import DEAD_LETTER_STREAM, GROUP, ITEM_STREAMS, WEBHOOK_RETRIES_KEY, WEBHOOK_STREAM
from service.metrics import Metrics

REPO = Path(__file__).resolve().parent.parent
README = (REPO / "README.md").read_text()
DEPLOY_README = " ".join((REPO / "deploy" / "README.md").read_text().split())  # a phrase may wrap anywhere
K8S = REPO / "deploy" / "k8s"
SAMPLE_SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}  # the samples a scrape shows
OPTION = re.compile(r"(?<![\w-])--[a-z][\w-]*")
# where the BATCHASR_* variables that are not service settings are read: by one part alone (the CUDA graphs' switch,
# the tests' fixtures) or by docker-compose.yml
OTHER_VARIABLES_READ_IN = ("models", "decoding", "service", "tests", "scripts", "docker-compose.yml")


def section(text: str, start: str, end: str = "\n\n") -> str:
    """``text`` from ``start`` up to the next ``end`` (a paragraph by default)."""
    first = text.index(start)
    last = text.find(end, first + len(start))
    return text[first:last if last >= 0 else None]


SETTINGS = section(README, "Settings of `serve` and `worker` come from `BATCHASR_*`")
METRICS = section(README, "Metrics: `batchasr_")
COMMAND_LINE = section(README, "## Command line", "\n## ")
SYNOPSIS = section(COMMAND_LINE, "```\n", "```").removeprefix("```\n")


def documented_metric(metric: MetricWrapperBase) -> str:
    """How the README names a metric: as a scrape shows it (a counter with ``_total``), its labels in braces."""
    name = metric._name + ("_total" if metric._type == "counter" else "")  # prometheus_client has no public accessor
    labels = metric._labelnames
    return name + (f"{{{','.join(labels)}}}" if labels else "")


def service_metrics() -> list[MetricWrapperBase]:
    return [value for value in vars(Metrics()).values() if isinstance(value, MetricWrapperBase)]


def subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


def long_options(parser: argparse.ArgumentParser) -> set[str]:
    return {option for action in parser._actions for option in action.option_strings
            if option.startswith("--") and option != "--help"}


def k8s_objects() -> dict[tuple[str, str], dict]:
    return {(doc["kind"], doc["metadata"]["name"]): doc for path in sorted(K8S.glob("*.yaml"))
            for doc in yaml.safe_load_all(path.read_text()) if doc and "metadata" in doc}


# --- settings ------------------------------------------------------------------------------------------------------


def test_every_setting_is_in_the_readmes_settings():
    missing = [f"BATCHASR_{name.upper()}" for name in Settings.model_fields
               if not re.search(rf"`(BATCHASR_)?{name.upper()}`", SETTINGS)]
    assert not missing, f"the README's settings paragraph leaves out {missing}"


def test_the_readme_names_no_setting_that_is_not_there():
    fields = {name.upper() for name in Settings.model_fields}
    others = {name.removeprefix("BATCHASR_") for name in OTHER_VARIABLES}  # read by that prefix, not settings
    assert set(re.findall(r"`(?:BATCHASR_)?([A-Z][A-Z0-9_]+)`", SETTINGS)) - fields - others == set()
    assert {name for name in others if name not in README} == set()  # each checked below as read somewhere
    paths = [path for part in OTHER_VARIABLES_READ_IN for path in
             ([REPO / part] if (REPO / part).is_file() else (REPO / part).rglob("*"))]
    sources = [path.read_text() for path in paths if path.suffix in (".py", ".sh", ".yml") and path != Path(__file__)]
    for name in set(re.findall(r"BATCHASR_([A-Z][A-Z0-9_]*[A-Z0-9])", README + DEPLOY_README)) - fields:
        assert any(f"BATCHASR_{name}" in source for source in sources), f"BATCHASR_{name} is read nowhere"


# --- metrics -------------------------------------------------------------------------------------------------------


def test_every_metric_is_in_the_readmes_metrics_with_its_labels():
    missing = [documented_metric(m) for m in service_metrics() if f"`{documented_metric(m)}`" not in METRICS]
    assert not missing, f"the README's metrics paragraph leaves out (or names without their labels) {missing}"


def test_the_docs_name_no_metric_that_is_not_there():
    exposed = {m._name + suffix for m in service_metrics()  # a histogram by its own name too
               for suffix in SAMPLE_SUFFIXES.get(m._type, ()) + (("",) if m._type != "counter" else ())}
    adapter = yaml.safe_load((K8S / "prometheus-adapter-values.yaml").read_text())
    made_by_the_adapter = {rule["name"]["as"] for rule in adapter["rules"]["custom"]}
    for text in (README, DEPLOY_README):
        named = set(re.findall(r"batchasr_[a-z_]*[a-z]", text))
        assert named - exposed - made_by_the_adapter == set()


# --- the command line ----------------------------------------------------------------------------------------------


def test_every_option_of_every_command_is_in_the_readmes_command_line():
    missing = [f"batchasr {name} {option}" for name, parser in subcommands().items()
               for option in sorted(long_options(parser)) if not re.search(rf"{option}(?![\w-])", COMMAND_LINE)]
    missing += [f"batchasr {option}" for option in sorted(long_options(build_parser()))
                if not re.search(rf"{option}(?![\w-])", COMMAND_LINE)]
    assert not missing, f"the README's command line section leaves out {missing}"


def test_the_synopsis_gives_each_command_only_its_own_options():
    commands = subcommands()
    shown, command = set(), None
    for line in SYNOPSIS.splitlines():
        if start := re.match(r"batchasr (\w+)", line):
            command = start.group(1)
            shown.add(command)
        assert command in commands, line
        assert set(OPTION.findall(line)) - long_options(commands[command]) == set(), line
    assert shown == set(commands)


def test_the_readme_names_no_option_that_is_not_there():
    commands = subcommands()
    every = set().union(*map(long_options, commands.values()), long_options(build_parser()))
    assert set(OPTION.findall(COMMAND_LINE)) - every == set()
    # "`submit --priority`" and the like, anywhere: an option of that command
    for mention in re.finditer(rf"`(?:batchasr )?({'|'.join(commands)})((?: [^`-][^`]*?)?) (--[\w-]+)", README):
        assert mention.group(3) in long_options(commands[mention.group(1)]), mention.group(0)


# --- deploy/README against the manifests ---------------------------------------------------------------------------


def test_the_docs_name_the_streams_and_group_the_workers_use():
    known = {*ITEM_STREAMS.values(), DEAD_LETTER_STREAM, WEBHOOK_STREAM, WEBHOOK_RETRIES_KEY}
    for text in (README, DEPLOY_README):
        assert set(re.findall(r"`(batchasr:[a-z:]+)`", text)) - known == set()
    autoscaling = section(DEPLOY_README, "- Worker autoscaling", " ## ")
    triggers = k8s_objects()["ScaledObject", "batchasr-worker"]["spec"]["triggers"]
    streams = [t["metadata"] for t in triggers if t["type"] == "redis-streams"]
    for stream in {*ITEM_STREAMS.values(), *(trigger["stream"] for trigger in streams)}:
        assert f"`{stream}`" in autoscaling
    for group in {GROUP, *(trigger["consumerGroup"] for trigger in streams)}:
        assert f"consumer group `{group}`" in autoscaling
    for trigger in triggers:  # and the lag over every stream, API keys' included, from Prometheus
        assert f"`{trigger['type']}`" in autoscaling
        assert trigger["type"] != "prometheus" or f"`{trigger['metadata']['query']}`" in autoscaling


@pytest.mark.parametrize("figure", ["workers", "api", "termination"])
def test_deploy_readmes_figures_are_the_manifests(figure):
    objects = k8s_objects()
    if figure == "workers":
        scaled = objects["ScaledObject", "batchasr-worker"]["spec"]
        (lag,) = {t["metadata"].get("lagCount") or t["metadata"]["threshold"] for t in scaled["triggers"]}
        claims = [f"from {scaled['minReplicaCount']} to {scaled['maxReplicaCount']} workers",
                  f"at {lag} items per worker"]
    elif figure == "api":
        hpa = objects["HorizontalPodAutoscaler", "batchasr-api"]["spec"]
        target = hpa["metrics"][0]["pods"]["target"]["averageValue"]
        seconds = int(target.removesuffix("m")) / 1000 if target.endswith("m") else float(target)
        claims = [f"at {seconds:g} s", f"runs {hpa['minReplicas']} to {hpa['maxReplicas']} replicas"]
    else:
        pod = objects["Deployment", "batchasr-api"]["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        sleep = container["lifecycle"]["preStop"]["exec"]["command"]
        timeout = objects["ConfigMap", "batchasr-config"]["data"]["BATCHASR_REQUEST_TIMEOUT_S"]
        claims = [f"`preStop` sleeps {sleep[-1]} s", f"`BATCHASR_REQUEST_TIMEOUT_S` ({timeout} s)",
                  f"`terminationGracePeriodSeconds` ({pod['terminationGracePeriodSeconds']} s)"]
    assert [claim for claim in claims if claim not in DEPLOY_README] == []
