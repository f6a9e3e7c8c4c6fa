"""Dockerfile, compose, Prometheus, Grafana and configs/*.yaml, checked without a Docker engine."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))
DASHBOARD = ROOT / "configs" / "grafana" / "dashboards" / "specserve.json"

from server.settings import Settings  # noqa: E402

SETTINGS_KEYS = set(Settings.model_fields)


def _yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return _yaml(ROOT / "docker-compose.yml")


@pytest.fixture(scope="module")
def dockerfile() -> str:
    return (ROOT / "Dockerfile").read_text()


# --- docker-compose.yml ----------------------------------------------------------------


def test_compose_services(compose: dict[str, Any]) -> None:
    services = compose["services"]
    default = {name for name, service in services.items() if not service.get("profiles")}
    assert default == {"specserve", "prometheus", "grafana"}
    assert services["specserve"]["build"]["context"] == "."
    assert "FETCH_MODELS" in services["specserve"]["build"]["args"]
    assert services["prometheus"]["depends_on"] == ["specserve"]
    assert services["grafana"]["depends_on"] == ["prometheus"]


@pytest.mark.parametrize(
    ("service", "port"), [("specserve", 8000), ("prometheus", 9090), ("grafana", 3000)]
)
def test_compose_ports(compose: dict[str, Any], service: str, port: int) -> None:
    assert f"{port}:{port}" in compose["services"][service]["ports"]


def _mounts(compose: dict[str, Any], service: str) -> dict[str, str]:
    """container path -> host path or named volume."""
    out = {}
    for spec in compose["services"][service]["volumes"]:
        source, target = spec.split(":")[:2]
        out[target] = source
    return out


def test_compose_volumes(compose: dict[str, Any]) -> None:
    named = set(compose["volumes"])
    models = _mounts(compose, "specserve")["/models"]
    assert models in named
    assert compose["services"]["specserve"]["environment"]["SPECSERVE_CACHE"] == "/models"
    prom = _mounts(compose, "prometheus")
    assert prom["/etc/prometheus/prometheus.yml"] == "./configs/prometheus.yml"
    graf = _mounts(compose, "grafana")
    assert graf["/etc/grafana/provisioning"] == "./configs/grafana/provisioning"
    assert graf["/var/lib/grafana/dashboards"] == "./configs/grafana/dashboards"
    for mounts in (prom, graf):
        for source in mounts.values():
            assert source in named or (ROOT / source).exists(), source


def test_compose_router_profile(compose: dict[str, Any]) -> None:
    """`--profile router`: replicas like the default one behind vllm-router, all scraped."""
    services = compose["services"]
    profiled = {
        name for name, service in services.items() if "router" in service.get("profiles", [])
    }
    assert profiled == {"router", "replica-2"}
    replicas = ["specserve", "replica-2"]
    for name in replicas:
        service = services[name]
        assert service["command"] == services["specserve"]["command"]
        assert _mounts(compose, name)["/models"] == _mounts(compose, "specserve")["/models"]
    args = services["router"]["command"]
    assert args[0] == "vllm-router" and "--policy=cache_aware" in args
    urls = args[args.index("--worker-urls") + 1 : args.index("--worker-urls") + 1 + len(replicas)]
    assert urls == [f"http://{name}:8000" for name in replicas]
    assert set(services["router"]["depends_on"]) == set(replicas)
    router_args = pytest.importorskip("vllm_router.launch_router")
    assert router_args.parse_router_args(args[1:]).worker_urls == urls, "vllm-router accepts it"
    jobs = _yaml(ROOT / "configs" / "prometheus.yml")["scrape_configs"]
    targets = {t for job in jobs for c in job["static_configs"] for t in c["targets"]}
    metrics_port = next(a for a in args if a.startswith("--prometheus-port=")).split("=")[1]
    assert {f"{name}:8000" for name in replicas} | {f"router:{metrics_port}"} <= targets


# --- Prometheus and Grafana -------------------------------------------------------------


def test_prometheus_scrapes_the_server(compose: dict[str, Any]) -> None:
    jobs = _yaml(ROOT / "configs" / "prometheus.yml")["scrape_configs"]
    job = next(j for j in jobs if j["job_name"] == "specserve")
    assert job.get("metrics_path", "/metrics") == "/metrics"
    published = compose["services"]["specserve"]["ports"][0].split(":")[-1]
    assert job["static_configs"][0]["targets"] == [f"specserve:{published}"]


def test_grafana_provisioning_points_at_prometheus_and_dashboards(compose: dict[str, Any]) -> None:
    prov = ROOT / "configs" / "grafana" / "provisioning"
    (source,) = _yaml(prov / "datasources" / "prometheus.yml")["datasources"]
    assert source["type"] == "prometheus"
    assert source["url"] == "http://prometheus:9090"
    (provider,) = _yaml(prov / "dashboards" / "specserve.yml")["providers"]
    assert provider["options"]["path"] in _mounts(compose, "grafana")
    uids = {t["datasource"]["uid"] for p in _panels() for t in p["targets"]}
    assert uids == {source["uid"]}


def _panels() -> list[dict[str, Any]]:
    return list(json.loads(DASHBOARD.read_text())["panels"])


def _queried_metrics() -> set[str]:
    exprs = [t["expr"] for p in _panels() for t in p["targets"]]
    names = {m for e in exprs for m in re.findall(r"specserve:[a-zA-Z_:]+", e)}
    return {re.sub(r"_(bucket|sum|count)$", "", n) for n in names}


def test_dashboard_queries_only_exported_metrics() -> None:
    from server.metrics import METRIC_NAMES

    queried = _queried_metrics()
    assert queried - set(METRIC_NAMES) == set()


def test_dashboard_shows_the_issue_panels() -> None:
    wanted = {
        "specserve:spec_decode_num_accepted_tokens_total",
        "specserve:spec_decode_num_draft_tokens_total",
        "specserve:spec_decode_num_drafts_total",
        "specserve:spec_decode_num_accepted_tokens_per_pos_total",
        "specserve:time_to_first_token_seconds",
        "specserve:inter_token_latency_seconds",
        "specserve:generation_tokens_total",
        "specserve:num_requests_running",
        "specserve:num_requests_waiting",
        "specserve:kv_cache_usage_perc",
    }
    assert wanted <= _queried_metrics()
    exprs = " ".join(t["expr"] for p in _panels() for t in p["targets"])
    for q in ("0.5", "0.9", "0.99"):
        assert f"histogram_quantile({q}," in exprs
    assert len({p["id"] for p in _panels()}) == len(_panels())


# --- Dockerfile -------------------------------------------------------------------------


def _instructions(dockerfile: str) -> list[str]:
    joined = re.sub(r"\\\n", " ", dockerfile)
    return [ln.strip() for ln in joined.splitlines() if ln.strip() and not ln.startswith("#")]


def test_dockerfile_essentials(dockerfile: str) -> None:
    lines = _instructions(dockerfile)
    keywords = [ln.split()[0] for ln in lines]
    assert keywords[0] == "ARG" and lines[0].startswith("ARG BASE_IMAGE=python:3.11-slim")
    assert "FROM ${BASE_IMAGE}" in lines
    for arg in ("TORCH_INDEX=https://download.pytorch.org/whl/cpu", "TORCH_VERSION=2.13.0",
                "FETCH_MODELS=0"):  # fmt: skip
        assert f"ARG {arg}" in lines
    user = [ln for ln in lines if ln.startswith("USER ")]
    assert user and user[-1] != "USER root"
    username = user[-1].split()[1]
    assert any(re.search(rf"useradd [^&;]*\b{username}\b", ln) for ln in lines)
    health = next(ln for ln in lines if ln.startswith("HEALTHCHECK"))
    assert "/health" in health
    cmd = json.loads(next(ln for ln in lines if ln.startswith("CMD "))[4:])
    assert cmd == ["specserve", "serve", "--config", "configs/default.yaml", "--host", "0.0.0.0"]


def test_dockerfile_copies_what_the_package_needs(dockerfile: str) -> None:
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = [p.rstrip("*") for p in project["tool"]["setuptools"]["packages"]["find"]["include"]]
    copied = {ln.split()[1] for ln in _instructions(dockerfile) if ln.startswith("COPY ")}
    for needed in (*packages, "configs", "heads", project["project"]["readme"]):
        assert needed in copied, needed
        assert (ROOT / needed).exists(), needed
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert not set(ignored) & copied


# --- configs/*.yaml ---------------------------------------------------------------------


def test_there_are_the_shipped_configs() -> None:
    assert {p.name for p in CONFIGS} >= {
        "default.yaml",
        "pair.yaml",
        "ngram.yaml",
        "cpu-small.yaml",
    }


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """SPECSERVE_* variables of the developer's shell must not leak into the settings."""
    import os

    for name in list(os.environ):
        if name.startswith("SPECSERVE_"):
            monkeypatch.delenv(name)


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_validates_with_the_server_settings(path: Path, clean_env: None) -> None:
    data = _yaml(path)
    assert isinstance(data, dict) and set(data) <= SETTINGS_KEYS, set(data) - SETTINGS_KEYS
    dumped = Settings.load(path).model_dump()
    assert {key: dumped[key] for key in data} == data


def test_default_config_is_the_bundled_target_and_its_head(clean_env: None) -> None:
    from engine.model import bundled

    settings = Settings.load(ROOT / "configs" / "default.yaml")
    assert settings.speculative_method == "hybrid-eagle3"
    assert settings.model is not None and settings.draft_model is not None
    bundled.lookup(settings.model)
    assert (bundled.head_folder(settings.draft_model) / "config.json").is_file()
    assert set(_yaml(ROOT / "configs" / "default.yaml")) == SETTINGS_KEYS


def test_pair_config_is_the_bundled_pair(clean_env: None) -> None:
    from engine.model import bundled

    settings = Settings.load(ROOT / "configs" / "pair.yaml")
    assert settings.speculative_method == "hybrid"
    for model in (settings.model, settings.draft_model):
        assert model is not None and model.startswith("bundled:")
        bundled.lookup(model)


def test_settings_reject_unknown_keys(tmp_path: Path, clean_env: None) -> None:
    from server.settings import SettingsError

    bad = tmp_path / "bad.yaml"
    bad.write_text("model: bundled:qwen2.5-coder-0.5b-instruct\nnum_speculative_tokns: 3\n")
    with pytest.raises(SettingsError, match="num_speculative_tokns"):
        Settings.load(bad)


def test_readme_documents_every_setting() -> None:
    readme = (ROOT / "README.md").read_text()
    for key in SETTINGS_KEYS:
        assert f"`{key}`" in readme, key
        assert f"SPECSERVE_{key.upper()}" in readme or "SPECSERVE_<KEY>" in readme
        assert f"--{key.replace('_', '-')}" in readme, key


def test_readme_flags_exist_in_the_cli() -> None:
    from specserve.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    serve_flags = {s for a in sub.choices["serve"]._actions for s in a.option_strings}
    readme = (ROOT / "README.md").read_text()
    mentioned = set(re.findall(r"`(--[a-z][a-z0-9-]*)`", readme))
    assert mentioned - serve_flags == set()
    assert {"fetch", "list", "path"} <= set(_subcommands(sub.choices["models"]))


def _subcommands(parser: argparse.ArgumentParser) -> list[str]:
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return list(sub.choices)


# --- README and docs ---------------------------------------------------------------------

RAW_LOGS = ("*.log", "*.log.gz", "*.jsonl", "*.jsonl.gz", "*.ndjson")
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")  # [text](target) and ![alt](target)


def test_docs_hold_no_raw_logs_and_stay_small() -> None:
    docs = ROOT / "docs"
    raw = [p.relative_to(ROOT) for pattern in RAW_LOGS for p in docs.rglob(pattern)]
    assert raw == [], "raw logs belong in the bench's --raw-logs folder, not in docs/"
    size = sum(p.stat().st_size for p in docs.rglob("*") if p.is_file())
    assert size < 1_500_000, f"docs/ holds {size:,} bytes"


def test_readme_is_short_and_links_every_doc() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 260
    linked = {t for t in LINK.findall(readme) if t.startswith("docs/")}
    assert {f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md")} <= linked


@pytest.mark.parametrize(
    "page", ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").rglob("*.md"))]
)
def test_relative_links_resolve(page: str) -> None:
    path = ROOT / page
    targets = [t for t in LINK.findall(path.read_text()) if "://" not in t]
    missing = [t for t in targets if not (path.parent / t).exists()]
    assert missing == [], f"{page} links to missing files"
