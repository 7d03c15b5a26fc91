"""docs/k8s/rlflow.yaml, the Kubernetes sketch of docs/operations.md, is not run on a cluster here. What is
checked without one: the manifests parse, name the Ray version rlflow is installed with, declare the stage
resource on every node group, read only Secret keys that exist, and open no port to anything but the
cluster's own Ray pods. `kubectl apply --dry-run=client` needs an API server to map kinds, which this
machine does not have."""

from __future__ import annotations

import json
from pathlib import Path

import ray
import yaml

from infra.stack import STAGE_RESOURCE

MANIFESTS = Path(__file__).resolve().parent.parent / "docs" / "k8s" / "rlflow.yaml"


def _docs() -> dict[str, dict]:
    return {doc["kind"]: doc for doc in yaml.safe_load_all(MANIFESTS.read_text())}


def test_the_ray_cluster_matches_this_install() -> None:
    cluster = _docs()["RayCluster"]["spec"]
    assert cluster["rayVersion"] == ray.__version__
    groups = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
    for group in groups:  # stage tasks may run on any node: each declares the stage slots
        resources = json.loads(json.loads(group["rayStartParams"]["resources"]))
        assert resources[STAGE_RESOURCE] >= 1
    assert cluster["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"  # no engine rank on the head


def test_credentials_come_from_the_secret_only() -> None:
    docs = _docs()
    keys = set(docs["Secret"]["stringData"])
    cluster = docs["RayCluster"]["spec"]
    for group in [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]:
        for container in group["template"]["spec"]["containers"]:
            env = {e["name"]: e for e in container["env"]}
            for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
                ref = env[name]["valueFrom"]["secretKeyRef"]
                assert ref["name"] == docs["Secret"]["metadata"]["name"] and ref["key"] in keys
                assert "value" not in env[name]


def test_only_the_ray_pods_reach_the_ray_pods() -> None:
    policy = _docs()["NetworkPolicy"]["spec"]
    assert policy["policyTypes"] == ["Ingress"]
    assert policy["podSelector"] == {"matchLabels": {"ray.io/cluster": "rlflow"}}
    sources = [src for rule in policy["ingress"] for src in rule["from"]]
    assert sources == [{"podSelector": {"matchLabels": {"ray.io/cluster": "rlflow"}}}]
