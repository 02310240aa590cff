"""charts/quiver: `helm lint --strict`, `helm template` for every values set in
testdata/chart-values validated offline (Kubernetes API schemas; GIE's and prometheus-operator's
CRD schemas), what the manifests mean (probes, launcher command line, secrets, volumes, scaling,
pool), and the rendered container command line serving on this machine.

helm and the CRDs come from `make chart-tools` (pinned Go modules, into .cache)."""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from helm_chart import (
    CHART,
    KUBE_VERSION,
    VALUES_DIR,
    ChartError,
    flag_value,
    helm,
    kinds,
    only,
    quiver_container,
    render,
    validation_errors,
)
from stack import LAUNCHER, Stack, StackConfig, free_port

VALUES_SETS = sorted(p.stem for p in VALUES_DIR.glob("*.yaml"))
# Environment variables that carry a secret: each must come from a Secret, never a literal.
SECRET_ENV = re.compile(r"TOKEN|KEY|SECRET|PASSWORD", re.IGNORECASE)


def rendered(name: str) -> list[dict[str, Any]]:
    return render([VALUES_DIR / f"{name}.yaml"])


def only_named(manifests, kind, name):
    [found] = [m for m in manifests if m["kind"] == kind and m["metadata"]["name"] == name]
    return found


def test_values_sets_cover_the_deployments_the_docs_describe():
    assert {"defaults", "gpu-two-shards", "hub-adapters-token", "autoscaling-monitoring",
            "inference-pool", "s3-adapters"} <= set(VALUES_SETS)


@pytest.mark.parametrize("name", VALUES_SETS)
def test_helm_lint_strict(name):
    run = helm("lint", "--strict", str(CHART), "--kube-version", KUBE_VERSION,
               "--values", str(VALUES_DIR / f"{name}.yaml"))
    assert run.returncode == 0, run.stdout + run.stderr


@pytest.mark.parametrize("name", VALUES_SETS)
def test_every_manifest_is_valid_for_its_api(name):
    manifests = rendered(name)
    errors = [error for manifest in manifests for error in validation_errors(manifest)]
    assert not errors, "\n".join(errors)


def test_the_validation_catches_a_wrong_field():
    """The validators are not vacuous: a misspelt field is refused by each of them."""
    manifests = rendered("inference-pool")
    deployment = only(manifests, "Deployment")
    deployment["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGett"] = {}
    pool = only(manifests, "InferencePool")
    pool["spec"]["targetPorts"] = [{"number": 0}]
    objective = only_named(manifests, "InferenceObjective", "interactive")
    objective["spec"]["modelName"] = "x"
    for manifest in (deployment, pool, objective):
        assert list(validation_errors(manifest)), manifest["kind"]


@pytest.mark.parametrize("name", VALUES_SETS)
def test_probes_ask_health_on_the_port_the_launcher_listens_on(name):
    container = quiver_container(rendered(name))
    [port] = container["ports"]
    assert flag_value(container["args"], "--port") == str(port["containerPort"])
    assert flag_value(container["args"], "--hostname") == "0.0.0.0"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        get = container[probe]["httpGet"]
        assert get["path"] == "/health", probe
        assert get["port"] in (port["name"], port["containerPort"]), probe
    startup = container["startupProbe"]
    # A model download gets at least as long as the launcher gives the shards.
    shard_timeout = int(flag_value(container["args"], "--shard-startup-timeout-secs") or 1800)
    assert startup["periodSeconds"] * startup["failureThreshold"] >= shard_timeout


@pytest.mark.parametrize("name", VALUES_SETS)
def test_the_launcher_parses_the_rendered_command_line(name):
    """clap validates every argument before `--help`: an unknown flag or a bad value exits 2."""
    container = quiver_container(rendered(name))
    assert container["command"] == [LAUNCHER.name]
    run = subprocess.run([str(LAUNCHER), *container["args"], "--help"], capture_output=True,
                         text=True, timeout=30)
    assert run.returncode == 0, f"{container['args']}\n{run.stderr}"


def test_the_command_line_check_refuses_what_the_launcher_refuses():
    container = quiver_container(rendered("defaults"))
    for bad in (["--dtype", "int4"], ["--no-such-flag"]):
        run = subprocess.run([str(LAUNCHER), *container["args"], *bad, "--help"],
                             capture_output=True, text=True, timeout=30)
        assert run.returncode == 2, bad


def test_startup_probe_follows_the_launchers_startup_timeout():
    container = quiver_container(render([], sets=["server.shardStartupTimeoutSecs=7200"]))
    startup = container["startupProbe"]
    assert flag_value(container["args"], "--shard-startup-timeout-secs") == "7200"
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 7200 + 60


@pytest.mark.parametrize("name", VALUES_SETS)
def test_drain_fits_in_the_termination_grace_period(name):
    manifests = rendered(name)
    pod = only(manifests, "Deployment")["spec"]["template"]["spec"]
    container = quiver_container(manifests)
    graceful = int(flag_value(container["args"], "--graceful-shutdown-secs") or 30)
    pre_stop = container["lifecycle"]["preStop"]["sleep"]["seconds"]
    # After the preStop sleep, SIGTERM: the router drains for `graceful`, then gets 5 s to exit,
    # then the shards 10 s (docs/flags.md).
    assert pod["terminationGracePeriodSeconds"] > pre_stop + graceful + 5 + 10


@pytest.mark.parametrize("name", VALUES_SETS)
def test_pod_runs_unprivileged_and_writes_only_to_volumes(name):
    manifests = rendered(name)
    pod = only(manifests, "Deployment")["spec"]["template"]["spec"]
    container = quiver_container(manifests)
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    security = container["securityContext"]
    assert security["readOnlyRootFilesystem"] is True
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"]["drop"] == ["ALL"]
    writable = [m["mountPath"] for m in container["volumeMounts"] if not m.get("readOnly")]
    env = {e["name"]: e.get("value") for e in container["env"]}
    written = [env["HOME"], env["TMPDIR"], env["HF_HOME"], flag_value(container["args"], "--cache-dir")]
    for path in written:
        assert any(Path(path).is_relative_to(mount) for mount in writable), (path, writable)


@pytest.mark.parametrize("name", VALUES_SETS)
def test_secrets_are_referenced_never_inlined(name):
    manifests = rendered(name)
    assert "Secret" not in kinds(manifests)
    container = quiver_container(manifests)
    for var in container["env"]:
        if SECRET_ENV.search(var["name"]):
            assert "value" not in var and "secretKeyRef" in var["valueFrom"], var
    assert "--api-key" not in container["args"]


def test_hub_token_and_api_key_come_from_the_named_secrets():
    container = quiver_container(rendered("hub-adapters-token"))
    refs = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in container["env"] if "valueFrom" in e}
    assert refs == {"HF_TOKEN": {"name": "hf-token", "key": "HF_TOKEN"},
                    "QUIVER_API_KEY": {"name": "quiver-api-key", "key": "api-key"}}
    assert flag_value(container["args"], "--preload-adapters") == "org/support-bot-lora,org/sql-lora"
    assert flag_value(container["args"], "--adapter-source") == "hub"
    assert flag_value(container["args"], "--lora-rank-classes") == "8:4,16:4"
    assert "--lora-rank-classes" not in quiver_container(rendered("defaults"))["args"]


def test_s3_buckets_and_store_credentials_reach_the_launcher():
    container = quiver_container(rendered("s3-adapters"))
    assert flag_value(container["args"], "--s3-adapter-buckets") == "team-a-adapters,shared.adapters"
    assert flag_value(container["args"], "--adapter-source") == "s3"
    assert flag_value(container["args"], "--adapter-disk-cache-gib") == "20"
    refs = {e["name"]: e["valueFrom"]["secretKeyRef"]["name"] for e in container["env"] if "valueFrom" in e}
    assert refs == {"AWS_ACCESS_KEY_ID": "adapter-store", "AWS_SECRET_ACCESS_KEY": "adapter-store"}
    with pytest.raises(ChartError, match="s3Buckets"):
        render([], sets=["adapters.s3Buckets={Team_A}"])


def test_a_secret_value_has_no_place_in_the_values():
    """The schema refuses a literal where only a Secret's name may go."""
    for bad in ('secrets.hfToken.value="hf_canary"', 'secrets.apiKey.apiKey="sk-canary"'):
        with pytest.raises(ChartError, match="additional properties"):
            render([VALUES_DIR / "hub-adapters-token.yaml"], sets=[bad])


def test_tenants_file_is_mounted_from_its_secret():
    """--api-keys-file reads a file: the Secret is mounted read-only, as a volume (not subPath,
    so that an update of the Secret reaches the running pod), and the flag names that file."""
    manifests = render([], sets=['secrets.apiKeysFile.secretName="quiver-tenants"'])
    pod = only(manifests, "Deployment")["spec"]["template"]["spec"]
    container = quiver_container(manifests)
    [volume] = [v for v in pod["volumes"] if "secret" in v]
    assert volume["secret"]["secretName"] == "quiver-tenants"
    [mount] = [m for m in container["volumeMounts"] if m["name"] == volume["name"]]
    assert mount["readOnly"] is True and "subPath" not in mount
    keys_file = flag_value(container["args"], "--api-keys-file")
    assert keys_file == f"{mount['mountPath']}/{volume['secret']['items'][0]['path']}"
    with pytest.raises(ChartError, match="cannot be used together"):
        render([], sets=['secrets.apiKeysFile.secretName="t"', 'secrets.apiKey.secretName="k"'])


def test_two_shards_get_two_gpus_and_shared_memory():
    manifests = rendered("gpu-two-shards")
    pod = only(manifests, "Deployment")["spec"]["template"]["spec"]
    container = quiver_container(manifests)
    assert flag_value(container["args"], "--num-shard") == "2"
    assert flag_value(container["args"], "--max-request-body-bytes") == "8388608"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert container["resources"]["limits"]["memory"] == "64Gi"
    [shm] = [v for v in pod["volumes"] if v["name"] == "dshm"]
    assert shm["emptyDir"]["medium"] == "Memory"
    assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]
    assert pod["tolerations"][0]["key"] == "nvidia.com/gpu"
    claim = only(manifests, "PersistentVolumeClaim")
    [cache] = [v for v in pod["volumes"] if v["name"] == "model-cache"]
    assert cache["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]


def test_fewer_gpus_than_shards_is_refused():
    with pytest.raises(ChartError, match="gpu.count must be at least model.numShard"):
        render([VALUES_DIR / "gpu-two-shards.yaml"], sets=["gpu.count=1"])


def test_values_outside_the_schema_are_refused():
    for bad in ('model.dtpye="bfloat16"', 'model.dtype="int4"', "model.numShard=0",
                'adapters.source="gcs"', 'adapters.loraRankClasses="8x4"'):
        with pytest.raises(ChartError, match="values don't meet the specifications of the schema"):
            render([], sets=[bad])


def test_autoscaler_reads_waiting_requests_of_this_deployment():
    manifests = rendered("autoscaling-monitoring")
    deployment = only(manifests, "Deployment")
    assert "replicas" not in deployment["spec"], "the HPA owns the replica count"
    hpa = only(manifests, "HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                             "name": deployment["metadata"]["name"]}
    [metric] = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods"
    assert metric["pods"]["metric"]["name"] == "quiver_requests_waiting"
    assert metric["pods"]["target"] == {"type": "AverageValue", "averageValue": "2"}
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    pdb = only(manifests, "PodDisruptionBudget")
    assert pdb["spec"]["minAvailable"] == 1 and "maxUnavailable" not in pdb["spec"]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    service = only(manifests, "Service")
    monitor = only(manifests, "ServiceMonitor")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    [endpoint] = monitor["spec"]["endpoints"]
    assert endpoint["path"] == "/metrics"
    assert endpoint["port"] in [p["name"] for p in service["spec"]["ports"]]
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    container = quiver_container(manifests)
    assert flag_value(container["args"], "--adapter-source") == "local"
    assert flag_value(container["args"], "--adapter-root") == "/adapters"
    assert {"name": "adapters", "mountPath": "/adapters", "readOnly": True} in container["volumeMounts"]


def test_the_service_monitor_sends_an_admin_key_where_metrics_need_one():
    """With API keys, /metrics needs an admin key (docs/security.md): Prometheus sends the one
    key of secrets.apiKey, or the Secret serviceMonitor.authorization names (with a keys file,
    which holds digests only, there is no other); without keys it sends none."""
    monitoring = VALUES_DIR / "autoscaling-monitoring.yaml"

    def endpoint(manifests):
        [found] = only(manifests, "ServiceMonitor")["spec"]["endpoints"]
        return found

    assert "authorization" not in endpoint(rendered("autoscaling-monitoring"))
    one_key = render([monitoring], sets=['secrets.apiKey.secretName="quiver-api-key"'])
    assert endpoint(one_key)["authorization"] == {
        "type": "Bearer", "credentials": {"name": "quiver-api-key", "key": "QUIVER_API_KEY"}}
    tenants = render([monitoring], sets=['secrets.apiKeysFile.secretName="quiver-tenants"',
                                         'serviceMonitor.authorization.secretName="prometheus-scrape"',
                                         'serviceMonitor.authorization.key="token"'])
    assert endpoint(tenants)["authorization"]["credentials"] == {"name": "prometheus-scrape", "key": "token"}
    for manifests in (one_key, tenants):
        assert not list(validation_errors(only(manifests, "ServiceMonitor")))
        assert "--metrics-open" not in quiver_container(manifests)["args"]
    with pytest.raises(ChartError, match="serviceMonitor.authorization.secretName"):
        render([monitoring], sets=['secrets.apiKeysFile.secretName="quiver-tenants"'])
    opened = render([monitoring], sets=['secrets.apiKeysFile.secretName="quiver-tenants"',
                                        "server.metricsOpen=true"])
    assert "authorization" not in endpoint(opened)
    assert flag_value(quiver_container(opened)["args"], "--metrics-open") == "true"


def test_the_endpoint_picker_reads_metrics_without_a_key():
    """GIE's endpoint picker scrapes each pod's /metrics and cannot send a key (its model-server
    client has no such setting), so a pool opens /metrics unless server.metricsOpen says no."""
    assert flag_value(quiver_container(rendered("inference-pool"))["args"], "--metrics-open") == "true"
    closed = render([VALUES_DIR / "inference-pool.yaml"], sets=["server.metricsOpen=false"])
    assert "--metrics-open" not in quiver_container(closed)["args"]
    assert "--metrics-open" not in quiver_container(rendered("defaults"))["args"]


def test_body_and_logprob_limits_reach_the_launcher():
    container = quiver_container(render([], sets=[
        "server.bodyReadTimeoutSecs=45", "server.bodyReadMinRate=0", "limits.maxLogprobEntries=100000"]))
    assert flag_value(container["args"], "--body-read-timeout-secs") == "45"
    assert flag_value(container["args"], "--body-read-min-rate") == "0"
    assert flag_value(container["args"], "--max-logprob-entries") == "100000"
    defaults = quiver_container(rendered("defaults"))["args"]
    for flag in ("--body-read-timeout-secs", "--body-read-min-rate", "--max-logprob-entries"):
        assert flag not in defaults, flag


def test_inference_pool_selects_the_pods_on_the_serving_port():
    manifests = rendered("inference-pool")
    deployment = only(manifests, "Deployment")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    pool = only(manifests, "InferencePool")
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    assert pool["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    [port] = quiver_container(manifests)["ports"]
    assert pool["spec"]["targetPorts"] == [{"number": port["containerPort"]}]
    assert pool["spec"]["endpointPickerRef"]["name"] == "quiver-epp"
    objectives = [m for m in manifests if m["kind"] == "InferenceObjective"]
    assert sorted(o["metadata"]["name"] for o in objectives) == ["batch", "interactive"]
    for objective in objectives:
        assert objective["apiVersion"] == "inference.networking.x-k8s.io/v1alpha2"
        assert objective["spec"]["poolRef"]["name"] == pool["metadata"]["name"]
    with pytest.raises(ChartError, match="endpointPicker.serviceName"):
        render([VALUES_DIR / "inference-pool.yaml"], sets=['inferencePool.endpointPicker.serviceName=""'])


def test_defaults_render_only_the_core_objects():
    assert kinds(rendered("defaults")) == ["Deployment", "Service", "ServiceAccount"]


class RenderedCommand(StackConfig):
    """A stack whose launcher arguments are the rendered container's, verbatim."""

    def __init__(self, args: list[str], env: dict[str, str]):
        super().__init__(model_id=None, extra_env=env)
        self.rendered_args = args

    def args(self, port: int) -> list[str]:
        return self.rendered_args


@pytest.fixture
def volumes_root() -> Iterator[Path]:
    """Where the pod's volumes are laid out: short, since the shards' unix sockets go in the
    /tmp volume and a socket path may not exceed 107 bytes (pytest's tmp_path is longer)."""
    with tempfile.TemporaryDirectory(prefix="quiver-pod-") as root:
        yield Path(root)


def test_the_rendered_command_serves(pool, volumes_root, tmp_path):
    """The container's command line, environment and volume paths, run on this machine: each
    volume mount becomes a directory of its own, the port a free one on loopback, and the
    model the tiny llama the other integration tests build, put on the model-cache volume as an
    operator would put weights on the claim."""
    port = free_port()
    manifests = render([], sets=[
        'model.id="/var/cache/quiver/models/tiny-llama"', 'model.dtype="float32"', 'model.device="cpu"',
        'memory.cpuKvCacheGib=0.05', 'server.hostname="127.0.0.1"', f"server.port={port}",
        'model.servedModelName="tiny-llama"',
    ])
    container = quiver_container(manifests)
    mounts = {m["mountPath"]: volumes_root / m["name"] for m in container["volumeMounts"]}

    def local(value: str) -> str:
        for mount_path, directory in mounts.items():
            if value == mount_path or value.startswith(mount_path + "/"):
                directory.mkdir(parents=True, exist_ok=True)
                return str(directory) + value[len(mount_path):]
        return value

    args = [local(arg) for arg in container["args"]]
    env = {e["name"]: local(e["value"]) for e in container["env"]}
    shutil.copytree(pool.model_dir("llama"), local(flag_value(container["args"], "--model-id") or ""))
    # torch's OpenMP workers would busy-wait on every core of this small machine.
    env["OMP_NUM_THREADS"] = "1"
    stack = Stack(RenderedCommand(args, env), tmp_path / "rendered.log")
    stack.port, stack.base_url = port, f"http://127.0.0.1:{port}"
    stack.start(timeout_s=180)
    try:
        probe = container["readinessProbe"]["httpGet"]
        assert stack.get(probe["path"])[0] == 200
        status, body = stack.get("/v1/models")
        assert status == 200 and b'"tiny-llama"' in body, body
        assert list((mounts["/tmp"]).iterdir()), "TMPDIR was not the tmp volume"
    finally:
        # SIGTERM, as the kubelet sends after preStop: a drained launcher exits 0.
        assert stack.terminate(timeout_s=60) == 0, stack.log()[-3000:]
