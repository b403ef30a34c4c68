"""The Helm chart (deploy/helm/quantserve): lint, render and validate offline.

Helm's own Go library (through helm-python-sdk: no helm binary, no cluster) lints the chart and
renders it, enforcing values.schema.json; kubernetes-validate checks every rendered core object
against the Kubernetes API schema.  A broken values file must fail, and the container's
arguments must be flags `quantserve serve` really has.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import yaml

from tests.support import REPO

helm = pytest.importorskip("helm_python", reason="helm-python-sdk is in the test extra")
kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate is in the test extra")

CHART = REPO / "deploy" / "helm" / "quantserve"
KUBE = "1.30.0"
T4 = yaml.safe_load((CHART / "values-t4.yaml").read_text())
HPA = {"autoscaling": {"enabled": True, "kind": "hpa"}}


def render(values: dict | None) -> list[dict]:
    manifests = helm.Chart.load(CHART).render(values, name="qs", namespace="llm")
    return [doc for text in manifests.values() for doc in yaml.safe_load_all(text) if doc]


def test_the_chart_lints_clean():
    report = helm.lint(CHART, strict=True, kube_version=f"v{KUBE}")
    assert not report["errors"], report
    assert not [m for m in report["messages"] if m["severity"] >= 2], report["messages"]
    for values in (T4, HPA):
        assert not helm.lint(CHART, values, strict=True)["errors"]


@pytest.mark.parametrize("values", [None, T4, HPA], ids=["defaults", "t4", "hpa"])
def test_every_rendered_object_is_valid_kubernetes(values):
    docs = render(values)
    kinds = sorted(d["kind"] for d in docs)
    autoscaled = (values or {}).get("autoscaling", {}).get("enabled", False)
    want = {None: ["Deployment", "Service"], "keda": ["Deployment", "ScaledObject", "Service"],
            "hpa": ["Deployment", "HorizontalPodAutoscaler", "Service"]}
    assert kinds == want[(values or {}).get("autoscaling", {}).get("kind", "keda") if autoscaled else None]
    for doc in docs:
        if doc["apiVersion"].startswith("keda.sh/"):  # a CRD: no schema in kubernetes-validate
            assert doc["spec"]["scaleTargetRef"]["name"] == "qs-quantserve"
            assert "quantserve:num_requests_waiting" in doc["spec"]["triggers"][0]["metadata"]["query"]
            continue
        kubernetes_validate.validate(doc, KUBE, strict=True)
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert {container[p]["httpGet"]["path"] for p in ("startupProbe", "readinessProbe", "livenessProbe")} == {"/health"}
    assert pod["terminationGracePeriodSeconds"] > int(next(a for a in container["args"] if a.startswith("--shutdown-grace=")).split("=")[1])
    assert ("replicas" in deployment["spec"]) != autoscaled  # the autoscaler owns the count when on


def test_the_container_arguments_are_real_serve_flags():
    docs = render(T4)
    args = next(d for d in docs if d["kind"] == "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    usage = subprocess.run([sys.executable, "-m", "quantserve", "serve", "--help"], capture_output=True,
                           text=True, env={"COLUMNS": "200", "PATH": "/usr/bin:/bin"}).stdout
    known = set(re.findall(r"--[a-z][a-z-]+", usage))
    flags = [a.split("=")[0] for a in args if a.startswith("--")]
    assert flags and all(f in known for f in flags), sorted(set(flags) - known)


@pytest.mark.parametrize("broken", [
    {"server": {"engine": "vllm"}},
    {"server": {"weightQuant": "int3"}},
    {"server": {"maxBatch": 0}},
    {"autoscaling": {"enabled": True, "maxReplicas": 0}},
    {"autoscaling": {"kind": "cron"}},
    {"model": {"path": "relative/model"}},
    {"service": {"port": 70000}},
    {"replicas": 2},  # a typo of replicaCount
])
def test_a_broken_values_file_fails(broken):
    with pytest.raises(Exception, match=r"(?i)schema|values|valid"):
        helm.Chart.load(CHART).render(broken, name="qs", namespace="llm")
    assert helm.lint(CHART, broken)["errors"] or any(m["severity"] >= 3 for m in helm.lint(CHART, broken)["messages"])
