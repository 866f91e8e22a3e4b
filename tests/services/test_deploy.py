"""Offline validation of the deployment files (no container engine runs here): the compose
file and the Kubernetes manifests parse, match their schemas, reference files, services,
secrets and ports that exist, and run only real `deltaboard` command lines."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import typer
import yaml

from deltaboard.board.server.settings import Settings
from deltaboard.services.cli import build_app

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
COMPOSE = yaml.safe_load((REPO / "docker-compose.yml").read_text())
MANIFESTS = [
    doc for path in sorted((DEPLOY / "k8s").glob("*.yaml")) for doc in yaml.safe_load_all(path.read_text())
]
URL_HOST = re.compile(r"^(?:https?|redis)://([^/:]+)(?::(\d+))?")


def parse_cli(args: list[str]) -> Any:
    """Parse a deltaboard command line as the CLI would (options and values), without running it."""
    command: Any = typer.main.get_command(build_app())
    args = list(args)
    path = ["deltaboard"]
    while hasattr(command, "get_command"):  # a group: descend into the named subcommand
        assert args, f"{' '.join(path)} needs a subcommand"
        name = args.pop(0)
        sub = command.get_command(typer.Context(command), name)
        assert sub is not None, f"`{' '.join(path)} {name}` is not a deltaboard command"
        command, path = sub, [*path, name]
    return command.make_context(" ".join(path), args)


def host_of(url: str) -> tuple[str, int | None]:
    match = URL_HOST.match(url)
    assert match is not None, f"not a URL: {url}"
    return match[1], int(match[2]) if match[2] else None


def settings_fields() -> set[str]:
    return {f"DELTABOARD_{name.upper()}" for name in Settings.model_fields}


def dockerfile_targets() -> set[str]:
    text = (DEPLOY / "Dockerfile").read_text()
    return set(re.findall(r"^FROM \S+ AS (\S+)$", text, flags=re.MULTILINE))


# ---- docker compose ----------------------------------------------------------------------


def services() -> dict[str, dict[str, Any]]:
    found: dict[str, dict[str, Any]] = COMPOSE["services"]
    return found


def deltaboard_services() -> dict[str, dict[str, Any]]:
    return {name: s for name, s in services().items() if "build" in s}


def command_of(service: dict[str, Any]) -> list[str]:
    command = service.get("command", [])
    return shlex.split(command) if isinstance(command, str) else list(command)


def test_compose_matches_its_schema():
    schema = json.loads((DEPLOY / "schemas" / "compose.schema.json").read_text())
    jsonschema.validate(COMPOSE, schema)


def test_compose_has_the_whole_system():
    assert {"redis", "seaweedfs", "board-1", "board-2", "board-proxy", "engine", "sidecar", "trainer"} <= set(
        services()
    )
    for replica in ("board-1", "board-2"):
        ctx = parse_cli(command_of(services()[replica]))
        assert ctx.params["store"].startswith("s3://")
        assert host_of(ctx.params["s3_endpoint"])[0] == "seaweedfs"
        assert host_of(ctx.params["redis"])[0] == "redis"


def test_compose_builds_and_mounts_files_that_exist():
    targets = dockerfile_targets()
    for name, service in deltaboard_services().items():
        build = service["build"]
        assert (REPO / build["context"] / build["dockerfile"]).is_file(), name
        assert build["target"] in targets, f"{name}: no stage {build['target']} in the Dockerfile"
    declared = set(COMPOSE.get("volumes") or {})
    for name, service in services().items():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith((".", "/")):
                assert (REPO / source).exists(), f"{name} mounts missing {source}"
            else:
                assert source in declared, f"{name} uses undeclared volume {source}"


def test_compose_commands_are_real_deltaboard_command_lines():
    for name, service in deltaboard_services().items():
        parse_cli(command_of(service))  # raises on an unknown command, option or bad value
        assert name


def test_compose_references_only_its_own_services():
    names = set(services())
    for name, service in services().items():
        depends = service.get("depends_on", [])
        assert set(depends) <= names, f"{name} depends on unknown services"
        for word in command_of(service):
            for match in re.finditer(r"(?:https?|redis)://([a-z0-9-]+)", word):
                assert match[1] in names, f"{name} talks to unknown host {match[1]}"


def test_compose_rollout_node_shares_the_follower_directory():
    engine, sidecar = (parse_cli(command_of(services()[n])) for n in ("engine", "sidecar"))
    assert str(engine.params["model"]) == str(sidecar.params["directory"])
    assert sidecar.params["engine_url"] == f"http://engine:{engine.params['port']}"
    assert set(services()["engine"]["volumes"]) & set(services()["sidecar"]["volumes"])
    trainer = parse_cli(command_of(services()["trainer"]))
    assert trainer.params["board"] == sidecar.params["board"] and trainer.params["nodes"] == 0


def test_board_environment_names_are_board_settings():
    env = COMPOSE["x-board"]["environment"]
    assert set(env) <= settings_fields()


def test_haproxy_balances_the_board_replicas():
    config = (DEPLOY / "haproxy.cfg").read_text()
    servers = re.findall(r"^\s*server (\S+) (\S+):(\d+)", config, flags=re.MULTILINE)
    assert {host for _, host, _ in servers} == {"board-1", "board-2"}
    for _, host, port in servers:
        assert parse_cli(command_of(services()[host])).params["port"] == int(port)


def test_haproxy_sends_a_runs_prepare_and_commit_to_one_replica():
    """A prepared manifest lives in the replica that prepared it: the publish routes that
    name it go by a consistent hash of the run's path, to the same servers as the rest."""
    config = (DEPLOY / "haproxy.cfg").read_text()
    acl = re.search(r"^\s*acl (\S+) path_reg (\S+)$", config, flags=re.MULTILINE)
    assert acl is not None
    use = re.search(rf"^\s*use_backend (\S+) if {acl[1]}$", config, flags=re.MULTILINE)
    assert use is not None
    pattern = re.compile(acl[2])
    for path in ("/v1/runs/r-1/prepare", "/v1/runs/r-1/commit"):
        assert pattern.search(path), path
    for path in ("/v1/runs/r-1/head", "/v1/runs/r-1/manifests/3", "/v1/runs/r-1/commit/x"):
        assert not pattern.search(path), path
    backends = dict(re.findall(r"^backend (\S+)\n((?:[ \t]+.*\n?)*)", config, flags=re.MULTILINE))
    by_run = backends[use[1]]
    assert re.search(r"^\s*balance uri depth 3$", by_run, flags=re.MULTILINE)  # /v1/runs/{run}
    assert re.search(r"^\s*hash-type consistent$", by_run, flags=re.MULTILINE)
    servers = {tuple(re.findall(r"^\s*server (.+)$", body, flags=re.MULTILINE)) for body in backends.values()}
    assert len(backends) == 2 and len(servers) == 1


def test_the_board_service_keeps_a_client_on_one_replica():
    """The publisher's prepare and the commit that names it reach the same board pod."""
    assert objects("Service")["deltaboard-board"]["spec"]["sessionAffinity"] == "ClientIP"


def test_dockerfile_copies_what_exists():
    text = (DEPLOY / "Dockerfile").read_text()
    for source in re.findall(r"^COPY (.+) \S+$", text, flags=re.MULTILINE):
        for path in source.split():
            assert (REPO / path).exists(), f"Dockerfile copies missing {path}"
    assert {"board", "rollout"} <= dockerfile_targets()


# ---- kubernetes ----------------------------------------------------------------------


def objects(kind: str) -> dict[str, dict[str, Any]]:
    return {doc["metadata"]["name"]: doc for doc in MANIFESTS if doc["kind"] == kind}


def containers(deployment: dict[str, Any]) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = deployment["spec"]["template"]["spec"]["containers"]
    return found


@pytest.mark.parametrize("doc", MANIFESTS, ids=lambda d: f"{d['kind']}/{d['metadata']['name']}")
def test_manifest_matches_its_schema(doc):
    jsonschema.validate(doc, json.loads((DEPLOY / "schemas" / "k8s.schema.json").read_text()))


def test_selectors_labels_and_named_ports_agree():
    deployments = objects("Deployment")
    for name, deployment in deployments.items():
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items(), name
    for name, service in objects("Service").items():
        selected = [
            d
            for d in deployments.values()
            if service["spec"]["selector"].items() <= d["spec"]["template"]["metadata"]["labels"].items()
        ]
        assert len(selected) == 1, f"service {name} selects {len(selected)} deployments"
        ports = {p.get("name") for c in containers(selected[0]) for p in c.get("ports", [])}
        numbers = {p["containerPort"] for c in containers(selected[0]) for p in c.get("ports", [])}
        for port in service["spec"]["ports"]:
            target = port.get("targetPort", port["port"])
            assert target in (ports if isinstance(target, str) else numbers), f"{name}: no port {target}"


def test_secrets_config_maps_and_volumes_exist():
    secrets = {n: set(s.get("stringData", {})) | set(s.get("data", {})) for n, s in objects("Secret").items()}
    maps = {n: set(m.get("data", {})) for n, m in objects("ConfigMap").items()}
    for name, deployment in objects("Deployment").items():
        pod = deployment["spec"]["template"]["spec"]
        volumes = {v["name"] for v in pod.get("volumes", [])}
        for container in pod["containers"]:
            for source in container.get("envFrom", []):
                if "secretRef" in source:
                    assert source["secretRef"]["name"] in secrets, name
                if "configMapRef" in source:
                    assert source["configMapRef"]["name"] in maps, name
            for var in container.get("env", []):
                ref = var.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    assert ref["key"] in secrets[ref["name"]], f"{name}: secret key {ref}"
            for mount in container.get("volumeMounts", []):
                assert mount["name"] in volumes, f"{name}: mounts unknown volume {mount['name']}"


def test_deltaboard_containers_run_real_command_lines():
    for deployment in objects("Deployment").values():
        for container in containers(deployment):
            if container["image"].startswith("deltaboard-"):
                parse_cli(container["args"])


def test_board_deployment_uses_s3_and_redis_settings():
    board = objects("Deployment")["deltaboard-board"]
    assert board["spec"]["replicas"] >= 2
    config = objects("ConfigMap")["deltaboard-board"]["data"]
    assert set(config) <= settings_fields()
    assert config["DELTABOARD_STORE"].startswith("s3://") and config["DELTABOARD_S3_ENDPOINT"]
    assert host_of(config["DELTABOARD_REDIS"])[0] in objects("Service")
    s3_keys = set(objects("Secret")["deltaboard-s3"]["stringData"])
    assert (
        s3_keys <= settings_fields() and {"DELTABOARD_S3_ACCESS_KEY", "DELTABOARD_S3_SECRET_KEY"} <= s3_keys
    )
    container = containers(board)[0]
    port = int(config["DELTABOARD_PORT"])
    assert container["ports"][0]["containerPort"] == port


def test_rollout_pod_pairs_engine_and_sidecar():
    rollout = objects("Deployment")["deltaboard-rollout"]
    by_name = {c["name"]: c for c in containers(rollout)}
    engine, sidecar = parse_cli(by_name["engine"]["args"]), parse_cli(by_name["sidecar"]["args"])
    assert str(engine.params["model"]) == str(sidecar.params["directory"])
    assert sidecar.params["engine_url"] == f"http://127.0.0.1:{engine.params['port']}"
    mounts = [{m["name"] for m in c["volumeMounts"]} for c in by_name.values()]
    assert mounts[0] & mounts[1], "engine and sidecar must share the model volume"
    host, port = host_of(sidecar.params["board"])
    assert host in objects("Service") and port == objects("Service")[host]["spec"]["ports"][0]["port"]
    assert by_name["sidecar"]["ports"][0]["containerPort"] == sidecar.params["port"]


def test_the_cli_check_rejects_what_is_not_a_command_line():
    with pytest.raises(AssertionError):
        parse_cli(["serve-everything"])
    with pytest.raises(Exception, match="No such option"):
        parse_cli(["sidecar", "--board=http://b", "--run=r", "--dir=/m", "--engine=http://e", "--bogus"])


# ---- metrics: Prometheus and Grafana ----------------------------------------------------

GRAFANA = DEPLOY / "grafana"
DASHBOARD = json.loads((GRAFANA / "deltaboard.json").read_text())
METRIC_NAME = re.compile(r"\bdeltaboard_[a-z0-9_]+\b")
SERIES_SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "gauge": ("",),
}


def exported_series() -> set[str]:
    """Every series name the board's and the sidecar's registries expose (a counter `x` as
    `x_total`, a histogram as `x_bucket`, `x_sum`, `x_count`), read from the real classes."""
    from deltaboard.board.server.metrics import BoardMetrics
    from deltaboard.services.sidecar.metrics import SidecarMetrics

    return {
        family.name + suffix
        for registry in (BoardMetrics().registry, SidecarMetrics().registry)
        for family in registry.collect()
        for suffix in SERIES_SUFFIXES[family.type]
    }


def unknown_metrics(expr: str) -> set[str]:
    return set(METRIC_NAME.findall(expr)) - exported_series()


def test_grafana_dashboard_matches_its_schema_and_names_real_metrics():
    schema = json.loads((DEPLOY / "schemas" / "grafana-dashboard.schema.json").read_text())
    jsonschema.validate(DASHBOARD, schema)
    panels = DASHBOARD["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    exprs = [t["expr"] for p in panels for t in p["targets"]]
    for expr in exprs:
        assert METRIC_NAME.search(expr), expr
        assert not unknown_metrics(expr), f"{expr}: no such metric {unknown_metrics(expr)}"
    # What operators ask for: commit rate and latency, bytes in and out, wake latency,
    # fleet lag, swap pause.
    named = {name for expr in exprs for name in METRIC_NAME.findall(expr)}
    assert {
        "deltaboard_commits_total",
        "deltaboard_commit_seconds_bucket",
        "deltaboard_blob_bytes_in_total",
        "deltaboard_blob_bytes_out_total",
        "deltaboard_sidecar_version_wait_seconds_bucket",
        "deltaboard_sidecar_head_version",
        "deltaboard_sidecar_served_version",
        "deltaboard_sidecar_swap_seconds_bucket",
    } <= named


def test_the_metric_check_can_fail():
    assert unknown_metrics("rate(deltaboard_commits_total[1m])") == set()
    assert unknown_metrics("rate(deltaboard_commits[1m]) + deltaboard_nope") == {
        "deltaboard_commits",
        "deltaboard_nope",
    }


def mount_sources(service: dict[str, Any]) -> dict[str, str]:
    """The service's bind mounts: the path in the container -> the path in the repository."""
    return {target: source for source, target, *_ in (v.split(":") for v in service["volumes"])}


def test_compose_provisions_prometheus_and_grafana():
    grafana, prometheus = services()["grafana"], services()["prometheus"]
    mounts = mount_sources(grafana)
    provisioning = REPO / mounts["/etc/grafana/provisioning"]
    (source,) = yaml.safe_load((provisioning / "datasources" / "prometheus.yaml").read_text())["datasources"]
    assert host_of(source["url"]) == ("prometheus", 9090)
    assert {p["datasource"]["uid"] for p in DASHBOARD["panels"]} == {source["uid"]}
    (provider,) = yaml.safe_load((provisioning / "dashboards" / "deltaboard.yaml").read_text())["providers"]
    dashboards = REPO / mounts[provider["options"]["path"]]
    assert (dashboards / "deltaboard.json").is_file()

    config = yaml.safe_load((REPO / mount_sources(prometheus)["/etc/prometheus/prometheus.yml"]).read_text())
    targets = {t for job in config["scrape_configs"] for c in job["static_configs"] for t in c["targets"]}
    ports = {
        name: parse_cli(command_of(services()[name])).params["port"]
        for name in ("board-1", "board-2", "sidecar")
    }
    assert targets == {f"{name}:{port}" for name, port in ports.items()}
