"""cluster.yaml validates against the schema that ships with Ray; the KubeRay manifest is well formed."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import ray
import yaml

REPO = Path(__file__).resolve().parents[1]


def test_cluster_yaml_matches_rays_schema() -> None:
    schema = json.loads((Path(ray.__file__).parent / "autoscaler" / "ray-schema.json").read_text())
    config = yaml.safe_load((REPO / "cluster.yaml").read_text())
    jsonschema.validate(config, schema)
    types = config["available_node_types"]
    assert config["head_node_type"] in types
    assert types[config["head_node_type"]]["resources"] == {"CPU": 0}
    workers = {name: t for name, t in types.items() if name != config["head_node_type"]}
    assert any(t["node_config"]["InstanceType"].startswith(("g", "p")) for t in workers.values())
    for t in workers.values():
        assert 0 <= t["min_workers"] <= t["max_workers"] <= config["max_workers"]
    assert any("[vllm" in cmd for cmd in config["setup_commands"])


def test_kuberay_rayjob_structure() -> None:
    manifest = yaml.safe_load((REPO / "deploy" / "kuberay" / "rayjob.yaml").read_text())
    assert manifest["apiVersion"] == "ray.io/v1" and manifest["kind"] == "RayJob"
    spec = manifest["spec"]
    assert "jobs/pipeline.py" in spec["entrypoint"]
    cluster = spec["rayClusterSpec"]
    assert cluster["rayVersion"] == ray.__version__
    head = cluster["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert {p["containerPort"] for p in head["ports"]} >= {6379, 8265}
    groups = cluster["workerGroupSpecs"]
    assert groups and all(g["minReplicas"] <= g["replicas"] <= g["maxReplicas"] for g in groups)
    gpu = [c for g in groups for c in g["template"]["spec"]["containers"]
           if "nvidia.com/gpu" in c["resources"]["limits"]]
    assert gpu, "at least one worker group must request GPUs"
    config = spec["entrypoint"].split()[-2]
    assert (REPO / config.removeprefix("/app/")).exists(), f"entrypoint config {config} is not in the repo"


def test_serve_deploy_config_matches_rays_schema_and_builds_a_serve_config() -> None:
    from ray.serve.schema import ServeDeploySchema

    from memprune.serve import ServeConfig

    config = yaml.safe_load((REPO / "deploy" / "serve.yaml").read_text())
    ServeDeploySchema.model_validate(config)
    (app,) = config["applications"]
    assert app["import_path"] == "memprune.serve.app:build"
    cfg = ServeConfig.model_validate(app["args"])
    assert cfg.max_replicas and set(cfg.stores) == {"mem0"}
    local = ServeConfig.model_validate(yaml.safe_load((REPO / "configs" / "serve-local.yaml").read_text()))
    assert local.host == "127.0.0.1"
