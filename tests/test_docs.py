"""The README, its pages under docs/ and deploy/README checked against what they document: every setting is a row of
docs/settings.md's table, every metric one of docs/metrics.md's, every command-line option in docs/cli.md, and the
docs name none that is not there; deploy/README's autoscaling and shutdown figures are the manifests', and its streams
and consumer group the ones the workers use. Every relative link leads to a file and heading that exist, and the
README's set-up still gives its two commands."""

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
DOCS = REPO / "docs"
PAGES = [REPO / "README.md", *sorted(DOCS.glob("*.md"))]  # the README and its pages
# what the README and its pages say, for what may be mentioned anywhere in them; not docs/benchmarks.md, a record of
# measurements that names the settings of trials since removed (BATCHASR_SPLIT_PADDING_ABOVE)
PAGES_TEXT = "\n\n".join(page.read_text() for page in PAGES if page.name != "benchmarks.md")
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


SETTINGS = (DOCS / "settings.md").read_text()  # its table, a row per setting, and the prose around it
METRICS = (DOCS / "metrics.md").read_text()  # its table, a row per metric
COMMAND_LINE = (DOCS / "cli.md").read_text()
SYNOPSIS = section(COMMAND_LINE, "```\n", "```").removeprefix("```\n")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def table_column(text: str, header: str) -> list[str]:
    """The first cells of the rows of ``text``'s table whose first column is headed ``header``."""
    for table in re.findall(r"(?:^\|.*\n?)+", text, re.MULTILINE):
        head, rule, *rows = table.splitlines()
        if head.split("|")[1].strip() == header:
            assert set(rule) <= set("|- :"), rule
            return [row.split("|")[1].strip() for row in rows]
    raise AssertionError(f"no table headed {header!r}")


def setting_rows() -> list[str]:
    """The settings docs/settings.md's table has a row for, by name without ``BATCHASR_``; a row that names none
    as `` `BATCHASR_NAME` `` fails."""
    cells = table_column(SETTINGS, "setting")
    assert [cell for cell in cells if not re.fullmatch(r"`BATCHASR_[A-Z0-9_]+`", cell)] == []
    return [cell.strip("`").removeprefix("BATCHASR_") for cell in cells]


def metric_rows() -> list[str]:
    """The metrics docs/metrics.md's table has a row for, as it names them (labels in braces)."""
    cells = table_column(METRICS, "metric")
    assert [cell for cell in cells if not re.fullmatch(r"`batchasr_[a-z_]+(\{[a-z_,]+\})?`", cell)] == []
    return [cell.strip("`") for cell in cells]


def without_code(text: str) -> str:
    """Markdown less its code blocks and code spans (a span may wrap), where brackets are not links."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.MULTILINE | re.DOTALL)
    return re.sub(r"`[^`]*`", "code", text)


def github_anchors(text: str) -> set[str]:
    """The anchors GitHub gives a page's headings: lowercased, punctuation but hyphens dropped, spaces as hyphens,
    and a heading met again numbered (-1, -2, ...)."""
    anchors: set[str] = set()
    seen: dict[str, int] = {}
    for heading in re.findall(r"^#{1,6}[ \t]+(.+?)[ \t#]*$", without_code(text), re.MULTILINE):
        anchor = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        seen[anchor] = seen.get(anchor, -1) + 1
        anchors.add(f"{anchor}-{seen[anchor]}" if seen[anchor] else anchor)
    return anchors


def documented_metric(metric: MetricWrapperBase) -> str:
    """How docs/metrics.md names a metric: as a scrape shows it (a counter with ``_total``), its labels in braces."""
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


def test_every_setting_has_a_row_in_the_settings_table():
    rows = setting_rows()
    missing = [f"BATCHASR_{name.upper()}" for name in Settings.model_fields if name.upper() not in rows]
    assert not missing, f"docs/settings.md's table has no row for {missing}"


def test_the_docs_name_no_setting_that_is_not_there():
    fields = {name.upper() for name in Settings.model_fields}
    rows = setting_rows()
    assert set(rows) - fields == set(), "docs/settings.md's table has a row for a setting the code lacks"
    assert sorted(rows) == sorted(set(rows)), "docs/settings.md's table has a setting twice"
    others = {name.removeprefix("BATCHASR_") for name in OTHER_VARIABLES}  # read by that prefix, not settings
    assert set(re.findall(r"`(?:BATCHASR_)?([A-Z][A-Z0-9_]+)`", SETTINGS)) - fields - others == set()
    assert {name for name in others if name not in PAGES_TEXT} == set()  # each checked below as read somewhere
    paths = [path for part in OTHER_VARIABLES_READ_IN for path in
             ([REPO / part] if (REPO / part).is_file() else (REPO / part).rglob("*"))]
    sources = [path.read_text() for path in paths if path.suffix in (".py", ".sh", ".yml") and path != Path(__file__)]
    for name in set(re.findall(r"BATCHASR_([A-Z][A-Z0-9_]*[A-Z0-9])", PAGES_TEXT + DEPLOY_README)) - fields:
        assert any(f"BATCHASR_{name}" in source for source in sources), f"BATCHASR_{name} is read nowhere"


# --- metrics -------------------------------------------------------------------------------------------------------


def test_every_metric_has_a_row_in_the_metrics_table_with_its_labels():
    rows = metric_rows()
    missing = [documented_metric(m) for m in service_metrics() if documented_metric(m) not in rows]
    assert not missing, f"docs/metrics.md's table has no row for (or names without their labels) {missing}"
    assert sorted(rows) == sorted(set(rows)), "docs/metrics.md's table has a metric twice"
    assert set(rows) - {documented_metric(m) for m in service_metrics()} == set(), "a row for no metric"


def test_the_docs_name_no_metric_that_is_not_there():
    exposed = {m._name + suffix for m in service_metrics()  # a histogram by its own name too
               for suffix in SAMPLE_SUFFIXES.get(m._type, ()) + (("",) if m._type != "counter" else ())}
    adapter = yaml.safe_load((K8S / "prometheus-adapter-values.yaml").read_text())
    made_by_the_adapter = {rule["name"]["as"] for rule in adapter["rules"]["custom"]}
    for text in (PAGES_TEXT, DEPLOY_README):
        named = set(re.findall(r"batchasr_[a-z_]*[a-z]", text))
        assert named - exposed - made_by_the_adapter == set()


# --- the command line ----------------------------------------------------------------------------------------------


def test_every_option_of_every_command_is_in_the_command_line_page():
    missing = [f"batchasr {name} {option}" for name, parser in subcommands().items()
               for option in sorted(long_options(parser)) if not re.search(rf"{option}(?![\w-])", COMMAND_LINE)]
    missing += [f"batchasr {option}" for option in sorted(long_options(build_parser()))
                if not re.search(rf"{option}(?![\w-])", COMMAND_LINE)]
    assert not missing, f"docs/cli.md leaves out {missing}"


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


def test_the_docs_name_no_option_that_is_not_there():
    commands = subcommands()
    every = set().union(*map(long_options, commands.values()), long_options(build_parser()))
    assert set(OPTION.findall(COMMAND_LINE)) - every == set()
    # "`submit --priority`" and the like, anywhere: an option of that command
    for mention in re.finditer(rf"`(?:batchasr )?({'|'.join(commands)})((?: [^`-][^`]*?)?) (--[\w-]+)", PAGES_TEXT):
        assert mention.group(3) in long_options(commands[mention.group(1)]), mention.group(0)


# --- links and the set-up -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("page", [*PAGES, REPO / "deploy" / "README.md"], ids=lambda page: str(page.relative_to(REPO)))
def test_every_relative_link_leads_to_a_file_and_heading_there(page):
    for target in LINK.findall(without_code(page.read_text())):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto: and the like
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        assert linked.is_relative_to(REPO) and linked.exists(), f"{target}: no such file"
        assert not anchor or anchor in github_anchors(linked.read_text()), f"{target}: no such heading"


def test_the_readmes_set_up_gives_exactly_two_commands_one_serving_one_testing():
    set_up = section(PAGES[0].read_text(), "## Set up on a fresh machine\n", "\n## ")
    blocks = re.findall(r"^```[^\n]*\n(.*?)^```", set_up, re.MULTILINE | re.DOTALL)
    assert [block.count("\n") for block in blocks] == [1, 1]  # two blocks, of one line each
    serve, tests = (block.strip() for block in blocks)
    assert serve.startswith("pip install torch==") and serve.endswith(" && batchasr serve")
    assert tests.startswith("pip install torch==") and " && python -m pytest " in tests


def test_the_architecture_page_names_every_module_and_script():
    """A module added without a line there is one a newcomer cannot find; loadtest's scripts may be named in
    docs/benchmarks.md instead, beside the question each answers."""
    architecture = (DOCS / "architecture.md").read_text()
    benchmarks = (DOCS / "benchmarks.md").read_text()
    modules = [path for package in ("models", "models/training", "decoding", "service")
               for path in sorted((REPO / package).glob("*.py")) if path.name != "__init__.py"]
    scripts = [path for path in sorted((REPO / "scripts").iterdir()) if path.suffix in (".py", ".sh")]
    unnamed = [path for path in modules + scripts if f"`{path.name}`" not in architecture]
    unnamed += [path for path in sorted((REPO / "loadtest").glob("*.py"))
                if f"`{path.name}`" not in architecture and path.name not in benchmarks]
    assert [str(path.relative_to(REPO)) for path in unnamed] == []


# --- deploy/README against the manifests ---------------------------------------------------------------------------


def test_the_docs_name_the_streams_and_group_the_workers_use():
    known = {*ITEM_STREAMS.values(), DEAD_LETTER_STREAM, WEBHOOK_STREAM, WEBHOOK_RETRIES_KEY}
    for text in (PAGES_TEXT, DEPLOY_README):
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
