"""A cluster's deployments, checked as files (no Docker, no Kubernetes here).

``docker-compose.yml``'s profile ``cluster`` (etcd and three nodes) and the manifests of
``deploy/kubernetes/``: every node's command is parsed by ``tensord serve``'s own parser and
passes its own checks of the cluster's and the endpoints' flags, and what the pieces say of
each other agrees (the etcd endpoints the nodes name are the ones etcd advertises, selectors
match labels, probes and Services name the ports the server listens on, the credentials'
files are the ones mounted).
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from tensord_server.cli import build_subcommand_parser
from tensord_server.cluster import parse_endpoints
from tensord_server.tools.serve import cluster_problem
from tensord_server.tools.serve_observability import check_arguments, split_address

yaml = pytest.importorskip("yaml")

REPO = Path(__file__).resolve().parents[2]
COMPOSE = REPO / "docker-compose.yml"
KUBERNETES = REPO / "deploy" / "kubernetes"
CLUSTER_GUIDE = REPO / "docs" / "guides" / "cluster.md"
# the services of the default profile, which the cluster profile leaves as they were
DEFAULT_SERVICES = {"server", "locust-master", "locust-worker"}
NODES = {"node-a": "a", "node-b": "b", "node-c": "c"}


def serve_args(command: list[str]) -> argparse.Namespace:
    """``tensord serve``'s arguments of a container's command, by the real parser, checked
    as ``tensord serve`` checks them at start (an unknown flag fails here, not in a pod)."""
    assert command[:2] == ["tensord", "serve"], command
    parser = build_subcommand_parser("serve")
    parser.exit_on_error = False
    try:
        args = parser.parse_args(command[2:])
    except (argparse.ArgumentError, SystemExit) as exc:
        pytest.fail(f"tensord serve refuses {command[2:]}: {exc}")
    assert cluster_problem(args) is None, cluster_problem(args)
    # every host is judged remote: the pods' and containers' addresses are
    assert check_arguments(args, lambda host: False) is None
    return args


def flag_values(command: list[str], flag: str) -> list[str]:
    return [part.split("=", 1)[1] for part in command if part.startswith(f"{flag}=")]


def port_of(address: str) -> int:
    return split_address(address)[1]


# ---- docker compose: the profile cluster -----------------------------------------------


def interpolate(text: str) -> str:
    """Compose's ``${VAR:-default}`` / ``${VAR}``, with every variable unset (as
    tests/tools/test_loadtest.py reads the file)."""
    return re.sub(r"\$\{[A-Z_]+(?::?-([^}]*))?\}", lambda m: m.group(1) or "", text)


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    config: dict[str, Any] = yaml.safe_load(interpolate(COMPOSE.read_text()))
    return config


def test_the_cluster_profile_follows_the_compose_spec_and_leaves_the_default_one(
    compose: dict[str, Any],
) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads((REPO / "tests" / "compose-spec.json").read_text())
    jsonschema.Draft201909Validator(schema).validate(compose)
    services = compose["services"]
    cluster = {name for name, s in services.items() if "cluster" in s.get("profiles", [])}
    assert cluster == {"etcd", "cluster-secret", *NODES}
    assert all(services[name]["profiles"] == ["cluster"] for name in cluster)
    unprofiled = {name for name, s in services.items() if "profiles" not in s}
    assert unprofiled == DEFAULT_SERVICES  # nothing of the cluster runs in the default one
    assert services["etcd"]["image"].startswith("quay.io/coreos/etcd:v3.5.")
    assert set(compose["volumes"]) == {"etcd-data", "cluster-secret"}


def etcd_client_endpoint(command: list[str]) -> str:
    """The HOST:PORT etcd's clients reach it at, checked against what it listens on."""
    (advertised,) = flag_values(command, "--advertise-client-urls")
    (listening,) = flag_values(command, "--listen-client-urls")
    match = re.fullmatch(r"http://([^:/]+):(\d+)", advertised)
    assert match, advertised
    assert listening == f"http://0.0.0.0:{match.group(2)}"
    return f"{match.group(1)}:{match.group(2)}"


def test_the_nodes_join_the_profile_s_etcd_with_their_own_ids_and_ports(
    compose: dict[str, Any],
) -> None:
    services = compose["services"]
    etcd = services["etcd"]
    endpoint = etcd_client_endpoint(etcd["command"])
    assert endpoint == "etcd:2379"  # the service's name on the compose network
    assert "ports" not in etcd  # the host reaches the nodes, never etcd
    host_ports: list[str] = []
    for service in services.values():
        for mapping in service.get("ports", []):
            host, port, _ = mapping.split(":")
            assert host == "127.0.0.1", mapping
            host_ports.append(port)
    assert len(host_ports) == len(set(host_ports)), host_ports  # one port, one service
    for name, node_id in NODES.items():
        node = services[name]
        args = serve_args(node["command"])
        assert args.node_id == node_id
        assert parse_endpoints(args.cluster) == [endpoint]
        listen = port_of(args.address)
        # registered under its service name, on the port it listens on, published as is
        assert args.cluster_advertise == f"{name}:{listen}"
        assert f"127.0.0.1:{listen}:{listen}" in node["ports"]
        assert node["healthcheck"]["test"] == [
            "CMD", "tensord", "stats", "--address", f"127.0.0.1:{listen}",
        ]  # fmt: skip
        dashboard = port_of(args.dashboard_address)
        assert any(p.endswith(f":{dashboard}") for p in node["ports"])
        assert node["depends_on"] == {
            "etcd": {"condition": "service_healthy"},
            "cluster-secret": {"condition": "service_completed_successfully"},
        }
        assert "cluster" in node["build"]["args"]["EXTRAS"].split(",")  # etcd's client
        assert node["image"] != services["server"]["image"]  # neither build replaces the other
    ids = [serve_args(services[name]["command"]).node_id for name in NODES]
    assert len(set(ids)) == 3
    assert "healthcheck" in etcd


def test_every_node_reads_the_secret_the_profile_made(compose: dict[str, Any]) -> None:
    services = compose["services"]
    maker = services["cluster-secret"]
    (volume,) = maker["volumes"]
    source, folder = volume.split(":")[:2]
    script = maker["command"][-1]
    written = re.findall(r'os\.open\("([^"]+)"', script)
    assert len(written) == 1 and written[0].startswith(folder + "/")
    assert "secrets.token_urlsafe(32)" in script and "O_EXCL" in script  # once, at random
    for name in NODES:
        node = services[name]
        args = serve_args(node["command"])
        mounted = [v for v in node["volumes"] if v.startswith(f"{source}:")]
        assert len(mounted) == 1 and mounted[0].endswith(":ro")
        target = mounted[0].split(":")[1]
        assert args.cluster_token_file == written[0].replace(folder, target, 1)
    compile(script, "cluster-secret", "exec")  # the script is Python


# ---- Kubernetes: deploy/kubernetes ------------------------------------------------------


def load_manifests() -> list[dict[str, Any]]:
    documents = []
    for path in sorted(KUBERNETES.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        documents += [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    return documents


@pytest.fixture(scope="module")
def manifests() -> list[dict[str, Any]]:
    return load_manifests()


def only(manifests: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    (found,) = [m for m in manifests if m["kind"] == kind and m["metadata"]["name"] == name]
    return found


def containers(workload: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield from workload["spec"]["template"]["spec"]["containers"]


def env_values(container: dict[str, Any], samples: dict[str, str]) -> dict[str, str]:
    """The container's variables; a downward-API one as ``samples`` give its field."""
    values = {}
    for variable in container.get("env", []):
        if "value" in variable:
            values[variable["name"]] = variable["value"]
        else:
            values[variable["name"]] = samples[variable["valueFrom"]["fieldRef"]["fieldPath"]]
    return values


def expand(command: list[str], values: dict[str, str]) -> list[str]:
    """Kubernetes' ``$(VAR)`` in a command; one it does not define would stay verbatim."""

    def one(match: re.Match[str]) -> str:
        assert match.group(1) in values, f"$({match.group(1)}) is not in the container's env"
        return values[match.group(1)]

    return [re.sub(r"\$\(([A-Z_]+)\)", one, part) for part in command]


def test_every_manifest_is_named_in_the_kustomization_and_one_namespace(
    manifests: list[dict[str, Any]],
) -> None:
    kustomization = yaml.safe_load((KUBERNETES / "kustomization.yaml").read_text())
    files = {p.name for p in KUBERNETES.glob("*.yaml")} - {"kustomization.yaml"}
    assert set(kustomization["resources"]) == files
    namespace = kustomization["namespace"]
    assert only(manifests, "Namespace", namespace)
    for manifest in manifests:
        assert {"apiVersion", "kind", "metadata"} <= set(manifest), manifest
        if manifest["kind"] != "Namespace":
            assert manifest["metadata"]["namespace"] == namespace, manifest["metadata"]
    assert [i["name"] for i in kustomization["images"]] == ["tensord"]


def test_selectors_match_the_labels_they_select(manifests: list[dict[str, Any]]) -> None:
    workloads = [m for m in manifests if m["kind"] in ("StatefulSet", "DaemonSet")]
    assert {w["kind"] for w in workloads} == {"StatefulSet", "DaemonSet"}
    pod_labels = []
    for workload in workloads:
        labels = workload["spec"]["template"]["metadata"]["labels"]
        assert workload["spec"]["selector"]["matchLabels"].items() <= labels.items()
        pod_labels.append(labels)

    def selects(selector: dict[str, str]) -> list[dict[str, str]]:
        return [labels for labels in pod_labels if selector.items() <= labels.items()]

    for manifest in manifests:
        spec = manifest.get("spec", {})
        if manifest["kind"] == "Service":
            assert len(selects(spec["selector"])) == 1, manifest["metadata"]["name"]
        elif manifest["kind"] in ("PodDisruptionBudget",):
            assert len(selects(spec["selector"]["matchLabels"])) == 1
        elif manifest["kind"] == "NetworkPolicy":
            assert len(selects(spec["podSelector"]["matchLabels"])) == 1
            for rule in spec["ingress"]:
                for peer in rule["from"]:
                    assert len(selects(peer["podSelector"]["matchLabels"])) == 1


def test_etcd_is_three_members_that_name_each_other(manifests: list[dict[str, Any]]) -> None:
    etcd = only(manifests, "StatefulSet", "etcd")
    service = only(manifests, "Service", etcd["spec"]["serviceName"])
    assert service["spec"]["clusterIP"] == "None"  # headless: a name per member
    assert service["spec"]["publishNotReadyAddresses"] is True
    replicas = etcd["spec"]["replicas"]
    assert replicas == 3
    (container,) = containers(etcd)
    assert container["image"].startswith("quay.io/coreos/etcd:v3.5.")
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert {p["name"]: p["port"] for p in service["spec"]["ports"]} == {
        "client": ports["client"],
        "peer": ports["peer"],
    }
    assert all(p["targetPort"] in ports for p in service["spec"]["ports"])
    name, domain = etcd["metadata"]["name"], service["metadata"]["name"]
    members = [f"{name}-{i}" for i in range(replicas)]
    pod_name = {"metadata.name": members[1]}
    command = expand(container["command"], env_values(container, pod_name))
    (initial,) = flag_values(command, "--initial-cluster")
    assert initial == ",".join(f"{m}=http://{m}.{domain}:{ports['peer']}" for m in members)
    assert flag_values(command, "--name") == [members[1]]
    assert flag_values(command, "--initial-advertise-peer-urls") == [
        f"http://{members[1]}.{domain}:{ports['peer']}"
    ]
    assert flag_values(command, "--listen-peer-urls") == [f"http://0.0.0.0:{ports['peer']}"]
    assert etcd_client_endpoint(command) == f"{members[1]}.{domain}:{ports['client']}"
    (metrics,) = flag_values(command, "--listen-metrics-urls")
    assert metrics == f"http://0.0.0.0:{ports['metrics']}"
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert container[probe]["httpGet"]["port"] == "metrics"
        assert container[probe]["httpGet"]["path"].startswith("/health")
    volume = etcd["spec"]["volumeClaimTemplates"][0]["metadata"]["name"]
    (mount,) = container["volumeMounts"]
    assert mount["name"] == volume
    assert flag_values(command, "--data-dir") == [mount["mountPath"]]


def tensord_pod(manifests: list[dict[str, Any]]) -> tuple[dict[str, Any], argparse.Namespace]:
    daemonset = only(manifests, "DaemonSet", "tensord")
    (container,) = containers(daemonset)
    samples = {"spec.nodeName": "gpu-node-7", "status.podIP": "10.2.3.4"}
    args = serve_args(expand(container["command"], env_values(container, samples)))
    return container, args


def test_tensord_runs_on_every_gpu_machine_under_its_name(
    manifests: list[dict[str, Any]],
) -> None:
    daemonset = only(manifests, "DaemonSet", "tensord")
    pod = daemonset["spec"]["template"]["spec"]
    assert any(key.startswith("nvidia.com/gpu") for key in pod["nodeSelector"])
    assert any(
        t["key"] == "nvidia.com/gpu" and t["operator"] == "Exists" for t in pod["tolerations"]
    )
    container, args = tensord_pod(manifests)
    assert container["resources"]["limits"]["nvidia.com/gpu"] >= 1
    assert args.node_id == "gpu-node-7"  # the downward API's spec.nodeName
    assert args.cluster_advertise == f"10.2.3.4:{port_of(args.address)}"
    assert any(d.startswith("cuda:") for d in args.devices)


def test_tensord_joins_every_etcd_member(manifests: list[dict[str, Any]]) -> None:
    etcd = only(manifests, "StatefulSet", "etcd")
    (etcd_container,) = containers(etcd)
    client = {p["name"]: p["containerPort"] for p in etcd_container["ports"]}["client"]
    domain = etcd["spec"]["serviceName"]
    members = [f"etcd-{i}" for i in range(etcd["spec"]["replicas"])]
    _, args = tensord_pod(manifests)
    assert parse_endpoints(args.cluster) == [f"{m}.{domain}:{client}" for m in members]


def test_tensord_s_credentials_come_from_the_documented_secret(
    manifests: list[dict[str, Any]],
) -> None:
    daemonset = only(manifests, "DaemonSet", "tensord")
    container, args = tensord_pod(manifests)
    volumes = {v["name"]: v for v in daemonset["spec"]["template"]["spec"]["volumes"]}
    files = {}
    for mount in container["volumeMounts"]:
        secret = volumes[mount["name"]]["secret"]
        assert mount["readOnly"] is True
        for item in secret["items"]:
            files[f"{mount['mountPath']}/{item['path']}"] = (secret["secretName"], item["key"])
    assert args.auth_tokens in files and args.cluster_token_file in files
    (secret_name,) = {files[args.auth_tokens][0], files[args.cluster_token_file][0]}
    keys = {files[args.auth_tokens][1], files[args.cluster_token_file][1]}
    # the guide's command makes that secret with those keys
    guide = CLUSTER_GUIDE.read_text()
    made = re.search(rf"create secret generic {secret_name}((?:.*\\\n)*.*)", guide)
    assert made, f"{CLUSTER_GUIDE.name} does not say how to make the secret {secret_name}"
    assert set(re.findall(r"--from-file=([\w-]+)=", made.group(1))) == keys
    assert args.operator_tenants  # /metrics with --auth-tokens needs an operator's token


def test_probes_and_the_service_name_the_ports_tensord_listens_on(
    manifests: list[dict[str, Any]],
) -> None:
    container, args = tensord_pod(manifests)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["grpc"] == port_of(args.address)
    assert ports["metrics"] == port_of(args.metrics_address)
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        # gRPC's health Check: the server answers it without a token
        assert container[probe]["grpc"]["port"] == ports["grpc"]
    service = only(manifests, "Service", "tensord")
    by_name = {p["name"]: p for p in service["spec"]["ports"]}
    assert by_name["metrics"]["targetPort"] == "metrics"
    assert by_name["grpc"]["targetPort"] == "grpc"
    annotations = service["metadata"]["annotations"]
    assert int(annotations["prometheus.io/port"]) == ports["metrics"]
