"""Renders charts/quiver with the pinned helm that `make chart-tools` builds, and validates what it
renders offline: built-in kinds against the Kubernetes API's own schemas (kubernetes-validate),
custom resources against the openAPIV3Schema of the CRDs that define them (GIE's and
prometheus-operator's, from their pinned Go modules)."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import yaml

from stack import REPO_ROOT

CHART = REPO_ROOT / "charts" / "quiver"
VALUES_DIR = Path(__file__).resolve().parent / "testdata" / "chart-values"
HELM = REPO_ROOT / ".cache" / "go" / "bin" / "helm"
CRD_DIR = REPO_ROOT / ".cache" / "crds"
# The oldest Kubernetes the chart supports (Chart.yaml's kubeVersion) and the newest whose
# schemas kubernetes-validate ships.
KUBERNETES_VERSIONS = ["1.30.0", kubernetes_validate.latest_version()]
# helm built by `go install` has no Kubernetes version linked in (it assumes 1.20, older than
# Chart.yaml's kubeVersion): render and lint as the oldest supported cluster.
KUBE_VERSION = KUBERNETES_VERSIONS[0]


class ChartError(RuntimeError):
    pass


def helm(*args: str) -> subprocess.CompletedProcess:
    if not HELM.exists():
        raise ChartError(f"{HELM} is missing: run `make chart-tools`")
    return subprocess.run([str(HELM), *args], capture_output=True, text=True, timeout=120)


def render(values_files: list[Path], sets: list[str] | None = None,
           release: str = "quiver") -> list[dict[str, Any]]:
    """`helm template` as a list of manifests; raises ChartError with helm's message on failure."""
    args = ["template", release, str(CHART), "--namespace", "llm", "--kube-version", KUBE_VERSION]
    for path in values_files:
        args += ["--values", str(path)]
    for item in sets or []:
        args += ["--set-json", item]
    run = helm(*args)
    if run.returncode != 0:
        raise ChartError(run.stderr)
    return [doc for doc in yaml.safe_load_all(run.stdout) if doc]


def only(manifests: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = [m for m in manifests if m["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, rendered {len(found)}"
    return found[0]


def kinds(manifests: list[dict[str, Any]]) -> list[str]:
    return sorted(m["kind"] for m in manifests)


# ---- custom resources -------------------------------------------------------------------------

def _closed(schema: Any) -> Any:
    """The CRD schema as `kubectl apply --validate=strict` reads it: an object with declared
    properties accepts no other field (the API server would prune or refuse it), unless the
    schema says it preserves unknown fields."""
    if isinstance(schema, list):
        return [_closed(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    closed = {key: _closed(value) for key, value in schema.items()}
    if ("properties" in closed and "additionalProperties" not in closed
            and not closed.get("x-kubernetes-preserve-unknown-fields")):
        closed["additionalProperties"] = False
    return closed


@cache
def crd_schemas() -> dict[tuple[str, str], dict[str, Any]]:
    """(apiVersion, kind) -> the served version's openAPIV3Schema, for every CRD in .cache/crds."""
    paths = sorted(CRD_DIR.glob("*/*.yaml"))
    if not paths:
        raise ChartError(f"no CRDs under {CRD_DIR}: run `make chart-tools`")
    schemas = {}
    for path in paths:
        crd = yaml.safe_load(path.read_text())
        group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
        for version in crd["spec"]["versions"]:
            if version.get("served"):
                schema = _closed(version["schema"]["openAPIV3Schema"])
                # Every object's metadata is the API server's ObjectMeta, not the CRD's.
                schema["properties"]["metadata"] = {"type": "object"}
                schemas[(f"{group}/{version['name']}", kind)] = schema
    return schemas


def validation_errors(manifest: dict[str, Any]) -> Iterator[str]:
    """Why the API server would refuse `manifest`, if it would: nothing when it is valid."""
    key = (manifest["apiVersion"], manifest["kind"])
    name = f"{manifest['kind']}/{manifest['metadata']['name']}"
    if key in crd_schemas():
        validator = jsonschema.Draft7Validator(crd_schemas()[key])
        for error in validator.iter_errors(manifest):
            yield f"{name}: {'.'.join(map(str, error.absolute_path))}: {error.message}"
        return
    for version in KUBERNETES_VERSIONS:
        try:
            kubernetes_validate.validate(manifest, version, strict=True)
        except kubernetes_validate.ValidationError as error:
            yield f"{name} (Kubernetes {version}): {error.message}"
        except kubernetes_validate.SchemaNotFoundError:
            yield f"{name}: no schema for {key} in Kubernetes {version} nor in {CRD_DIR}"


# ---- the pod ------------------------------------------------------------------------------------

def quiver_container(manifests: list[dict[str, Any]]) -> dict[str, Any]:
    pod = only(manifests, "Deployment")["spec"]["template"]["spec"]
    [container] = [c for c in pod["containers"] if c["name"] == "quiver"]
    return container


def flag_value(args: list[str], flag: str) -> str | None:
    """The value after `flag` in a rendered command line, or None when it is not there."""
    values = [args[i + 1] for i, arg in enumerate(args[:-1]) if arg == flag]
    assert len(values) <= 1, f"{flag} appears {len(values)} times in {args}"
    return values[0] if values else None
