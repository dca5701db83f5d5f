"""The Helm chart (deploy/helm/jpaged): rendered by a real Helm for the default values and every example, each
object valid against Kubernetes' and the CRDs' schemas, and consistent with the server it runs: its args parse
with `jpaged serve`'s own parser, its grace period covers the drain, its probes and metric are the server's."""

from __future__ import annotations

import dataclasses
import re
import subprocess

import pytest
import yaml
from chart_tools import CHART, has_crd_schema, helm_binary, render, validate
from jpaged_server.lifecycle import ABORTED_RESPONSE_SECONDS, CONNECTION_CLOSE_SECONDS
from jpaged_server.metrics import _GAUGES

from jpaged.config import EngineConfig
from jpaged.entrypoints.cli import build_parser, engine_config_from_args

SERVICE_MONITOR = "monitoring.coreos.com/v1/ServiceMonitor"
EXAMPLES = sorted((CHART / "examples").glob("*.yaml"))
CASES = {"default": [], **{path.stem: [path] for path in EXAMPLES}}
# The server flags the chart sets itself (host and port for the pod, the API key from a Secret).
CHART_OWNED_SERVER_FLAGS = {"host", "port", "api_key"}


@pytest.fixture(scope="session")
def helm(tmp_path_factory):
    return helm_binary(tmp_path_factory.mktemp("helm"))


@pytest.fixture(scope="session")
def rendered(helm) -> dict[str, list[dict]]:
    """Every case rendered twice: for a cluster with the Prometheus operator, and for one without it."""
    out = {}
    for name, values in CASES.items():
        out[name] = render(helm, values, [SERVICE_MONITOR])
        out[f"{name} (no prometheus operator)"] = render(helm, values)
    return out


def values_of(case: str) -> dict:
    """values.yaml with the case's file over it, as Helm merges them."""
    merged = yaml.safe_load((CHART / "values.yaml").read_text())
    for path in CASES[case.removesuffix(" (no prometheus operator)")]:
        _merge(merged, yaml.safe_load(path.read_text()))
    return merged


def _merge(base: dict, over: dict) -> None:
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            _merge(base[key], value)
        else:
            base[key] = value


def snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


def of_kind(objects: list[dict], kind: str) -> list[dict]:
    return [obj for obj in objects if obj["kind"] == kind]


def pod_specs(objects: list[dict]) -> list[tuple[str, dict, dict]]:
    """(role, pod metadata, pod spec) of every pod template: a Deployment's, a LeaderWorkerSet's leader and worker."""
    specs = []
    for obj in of_kind(objects, "Deployment"):
        specs.append(("server", obj["spec"]["template"]["metadata"], obj["spec"]["template"]["spec"]))
    for obj in of_kind(objects, "LeaderWorkerSet"):
        templates = obj["spec"]["leaderWorkerTemplate"]
        specs.append(("server", templates["leaderTemplate"]["metadata"], templates["leaderTemplate"]["spec"]))
        specs.append(("worker", templates["workerTemplate"]["metadata"], templates["workerTemplate"]["spec"]))
    return specs


def engine_container(spec: dict) -> dict:
    (container,) = spec["containers"]
    return container


def test_helm_lint_is_clean_for_the_default_values_and_every_example(helm):
    for values in CASES.values():
        command = [str(helm), "lint", str(CHART), *[arg for path in values for arg in ("-f", str(path))]]
        result = subprocess.run(command, capture_output=True, text=True, check=False)
        assert result.returncode == 0 and "[WARNING]" not in result.stdout, result.stdout + result.stderr


def test_every_rendered_object_is_valid_against_its_schema(rendered):
    for case, objects in rendered.items():
        for obj in objects:
            try:
                validate(obj)
            except Exception as err:
                raise AssertionError(f"{case}: {obj['kind']} {obj['metadata']['name']}: {err}") from err


def test_a_leaderworkersets_pod_templates_are_valid_pods(rendered):
    """The LWS CRD's schema of its templates is the pod's; checking them as Pods adds Kubernetes' own schema."""
    for objects in rendered.values():
        for _, metadata, spec in pod_specs(of_kind(objects, "LeaderWorkerSet")):
            validate(
                {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "pod", **metadata}, "spec": spec}
            )


def test_the_custom_resources_are_the_ones_the_vendored_crds_describe(rendered):
    kinds = {obj["kind"] for objects in rendered.values() for obj in objects if has_crd_schema(obj)}
    assert kinds == {"ResourceFlavor", "ClusterQueue", "LocalQueue", "LeaderWorkerSet", "ServiceMonitor"}


def test_the_values_name_every_engine_flag_and_every_server_flag_the_chart_does_not_set():
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    fields = {field.name for field in dataclasses.fields(EngineConfig)} - {"model"}
    assert {snake(key) for key in values["engine"]} == fields
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    server_flags = {action.dest for action in serve._actions if action.option_strings} - fields
    server_flags -= {"help", "distributed"}
    assert {snake(key) for key in values["server"]} == server_flags - CHART_OWNED_SERVER_FLAGS


def test_the_container_args_parse_with_jpaged_serve_and_every_value_reaches_the_engine(rendered):
    for case, objects in rendered.items():
        values = values_of(case)
        for _, _, spec in pod_specs(objects):
            container = engine_container(spec)
            assert container["command"] == ["jpaged", "serve"]
            args = build_parser().parse_args(["serve", *container["args"]])  # exits on a rejected flag
            config = engine_config_from_args(args)
            for key, value in values["engine"].items():
                if value is not None:
                    assert getattr(config, snake(key)) == value, (case, key)
            for key, value in values["server"].items():
                parsed = getattr(args, snake(key))
                if key == "loraModules" and value is not None:  # name=path items, parsed into LoRAModules
                    parsed = [f"{module.name}={module.path}" for module in parsed]
                if value is not None:
                    assert parsed == value, (case, key)
            assert args.model_tag == (values["model"]["name"] or None)
            assert (args.host, args.port) == ("0.0.0.0", values["service"]["port"])
            assert args.distributed == values["multihost"]["enabled"]


def test_large_and_fractional_engine_values_render_exactly(helm, tmp_path):
    """YAML numbers reach templates as floats: whole ones must print as integers, fractions as themselves."""
    values = tmp_path / "values.yaml"
    values.write_text("engine: {kvCacheMemory: 8589934592, gpuMemoryUtilization: 0.85}\n")
    objects = render(helm, [values])
    args = build_parser().parse_args(["serve", *engine_container(pod_specs(objects)[0][2])["args"]])
    assert (args.kv_cache_memory, args.gpu_memory_utilization) == (8589934592, 0.85)


def test_termination_grace_covers_the_prestop_wait_and_the_whole_drain(rendered):
    for case, objects in rendered.items():
        values = values_of(case)
        drain = values["server"]["shutdownGracePeriod"] + ABORTED_RESPONSE_SECONDS + CONNECTION_CLOSE_SECONDS
        for role, _, spec in pod_specs(objects):
            assert spec["terminationGracePeriodSeconds"] >= values["preStopSleepSeconds"] + drain, case
            if role == "server":
                pre_stop = engine_container(spec)["lifecycle"]["preStop"]["exec"]["command"]
                assert pre_stop == ["sleep", str(values["preStopSleepSeconds"])]


def test_servers_probe_health_for_liveness_and_ready_for_readiness_and_workers_serve_no_http(rendered):
    for objects in rendered.values():
        for role, _, spec in pod_specs(objects):
            container = engine_container(spec)
            if role == "server":
                assert container["livenessProbe"]["httpGet"]["path"] == "/health"
                assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
            else:
                assert "livenessProbe" not in container and "readinessProbe" not in container


def test_prometheus_scrapes_through_a_servicemonitor_or_else_pod_annotations(rendered):
    for case, objects in rendered.items():
        monitors = of_kind(objects, "ServiceMonitor")
        annotated = [
            meta.get("annotations", {}).get("prometheus.io/scrape")
            for role, meta, _ in pod_specs(objects)
            if role == "server"
        ]
        if "no prometheus operator" in case:
            assert not monitors and set(annotated) == {"true"}, case
        else:
            assert len(monitors) == 1 and set(annotated) == {None}, case
            assert monitors[0]["spec"]["endpoints"][0]["path"] == "/metrics"


def test_the_autoscaler_scales_the_workload_on_the_servers_waiting_requests(rendered):
    assert "num_requests_waiting" in _GAUGES
    scaled = 0
    for objects in rendered.values():
        for hpa in of_kind(objects, "HorizontalPodAutoscaler"):
            scaled += 1
            assert hpa["spec"]["metrics"][0]["pods"]["metric"]["name"] == "jpaged:num_requests_waiting"
            (workload,) = [o for o in objects if o["kind"] == hpa["spec"]["scaleTargetRef"]["kind"]]
            assert workload["metadata"]["name"] == hpa["spec"]["scaleTargetRef"]["name"]
            assert "replicas" not in workload["spec"]  # the autoscaler owns the count
    assert scaled


def test_kueue_admits_each_workload_through_its_local_queue_with_every_requested_resource_covered(rendered):
    for case, objects in rendered.items():
        if not values_of(case)["kueue"]["enabled"]:
            assert not of_kind(objects, "LocalQueue") and not of_kind(objects, "ClusterQueue")
            continue
        (local,) = of_kind(objects, "LocalQueue")
        (cluster,) = of_kind(objects, "ClusterQueue")
        assert local["spec"]["clusterQueue"] == cluster["metadata"]["name"]
        assert cluster["spec"]["namespaceSelector"] == {
            "matchLabels": {"kubernetes.io/metadata.name": "serving"}
        }
        for workload in of_kind(objects, "Deployment") + of_kind(objects, "LeaderWorkerSet"):
            assert workload["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == local["metadata"]["name"]
        (group,) = cluster["spec"]["resourceGroups"]
        for _, _, spec in pod_specs(objects):
            assert set(engine_container(spec)["resources"]["requests"]) <= set(group["coveredResources"]), (
                case
            )


def test_two_models_share_a_cohort_and_a_flavor_under_separate_quotas(rendered):
    team_a, team_b = (of_kind(rendered[name], "ClusterQueue")[0] for name in ("team-a-llama", "team-b-qwen"))
    (flavor,) = of_kind(rendered["team-a-llama"], "ResourceFlavor")
    assert not of_kind(rendered["team-b-qwen"], "ResourceFlavor")  # one release owns the cluster-wide flavor
    assert team_a["metadata"]["name"] != team_b["metadata"]["name"]
    assert team_a["spec"]["cohortName"] == team_b["spec"]["cohortName"]
    for queue in (team_a, team_b):
        (group,) = queue["spec"]["resourceGroups"]
        (used,) = group["flavors"]
        assert used["name"] == flavor["metadata"]["name"]
        gpu = next(r for r in used["resources"] if r["name"] == "nvidia.com/gpu")
        assert "borrowingLimit" in gpu


def test_a_multihost_engine_is_a_leaderworkerset_whose_pods_run_one_command_and_join_through_jax(rendered):
    objects = rendered["tpu-multihost"]
    values = values_of("tpu-multihost")
    (lws,) = of_kind(objects, "LeaderWorkerSet")
    assert not of_kind(objects, "Deployment")
    assert lws["spec"]["leaderWorkerTemplate"]["size"] == values["multihost"]["size"]
    (leader, worker) = [engine_container(spec) for _, _, spec in pod_specs(objects)]
    assert leader["args"] == worker["args"] and "--distributed" in leader["args"]
    for container in (leader, worker):
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env["JAX_COORDINATOR_ADDRESS"].startswith("$(LWS_LEADER_ADDRESS):")
        assert (env["JAX_NUM_PROCESSES"], env["JAX_PROCESS_ID"]) == (
            "$(LWS_GROUP_SIZE)",
            "$(LWS_WORKER_INDEX)",
        )
    chips = values["accelerator"]["count"] * values["multihost"]["size"]
    assert values["engine"]["tensorParallelSize"] == chips  # one engine over every chip of the slice
    (service,) = of_kind(objects, "Service")
    assert service["spec"]["selector"]["app.kubernetes.io/component"] == "server"  # the leaders serve


def test_images_name_a_version_and_secrets_come_from_secret_objects(rendered, helm):
    for objects in rendered.values():
        for _, _, spec in pod_specs(objects):
            container = engine_container(spec)
            repository, tag = container["image"].rsplit(":", 1)
            assert tag and tag != "latest"
            for env in container["env"]:
                if env["name"] in ("JPAGED_API_KEY", "HF_TOKEN"):
                    assert "secretKeyRef" in env["valueFrom"]
    with pytest.raises(AssertionError, match="not latest"):
        render(helm, sets={"image.tag": "latest"})


def test_the_chart_runs_the_image_as_a_non_root_user_with_caches_on_volumes(rendered):
    for objects in rendered.values():
        for _, _, spec in pod_specs(objects):
            assert spec["securityContext"]["runAsNonRoot"] is True
            container = engine_container(spec)
            assert container["securityContext"]["readOnlyRootFilesystem"] is True
            mounts = {m["mountPath"] for m in container["volumeMounts"]}
            args = container["args"]
            cache_dir = args[args.index("--compilation-cache-dir") + 1]
            assert any(
                cache_dir.startswith(m + "/") for m in mounts
            )  # a restarted pod finds its compiled steps


def test_validation_rejects_a_field_that_the_schema_does_not_know(rendered):
    """Strict checks, or a misspelt field would pass here and be dropped silently by the cluster."""
    objects = rendered["tpu-multihost"]
    for kind, path in (("LeaderWorkerSet", ("spec", "leaderWorkerTemplate")), ("ClusterQueue", ("spec",))):
        (obj,) = of_kind(objects, kind)
        broken = yaml.safe_load(yaml.safe_dump(obj))
        target = broken
        for key in path:
            target = target[key]
        target["sise"] = 4
        with pytest.raises(Exception, match="sise"):
            validate(broken)
    (service,) = of_kind(objects, "Service")
    with pytest.raises(Exception, match="sise"):
        validate({**service, "spec": {**service["spec"], "sise": 4}})
