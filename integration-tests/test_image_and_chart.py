"""The chart's defaults agree with the image the Dockerfile builds (the image itself cannot be
built here: no base image can be pulled): the command it runs, the user it runs as, the port
it listens on and the path its health check asks."""

from __future__ import annotations

import re

from helm_chart import CHART, only, quiver_container, render
from stack import REPO_ROOT


def final_stage() -> str:
    """The Dockerfile's last stage, the image that is run."""
    text = (REPO_ROOT / "Dockerfile").read_text()
    return re.split(r"^FROM ", text, flags=re.M)[-1]


def test_chart_runs_the_image_entrypoint_as_its_user_on_its_port():
    stage = final_stage()
    manifests = render([])
    container = quiver_container(manifests)
    pod = only(manifests, "Deployment")["spec"]["template"]["spec"]

    entrypoint = re.search(r"^ENTRYPOINT (\[.*\])$", stage, flags=re.M)
    assert entrypoint and entrypoint.group(1) == '["quiver-launcher"]'
    assert container["command"] == ["quiver-launcher"]

    user = re.search(r"^USER (\d+):(\d+)$", stage, flags=re.M)
    assert user, "the image runs as a numeric non-root user"
    assert int(user.group(1)) != 0
    assert (pod["securityContext"]["runAsUser"], pod["securityContext"]["runAsGroup"]) == (
        int(user.group(1)), int(user.group(2)))

    expose = re.search(r"^EXPOSE (\d+)$", stage, flags=re.M)
    assert expose and [p["containerPort"] for p in container["ports"]] == [int(expose.group(1))]
    assert "QUIVER_PORT=" + expose.group(1) in stage

    healthcheck = re.search(r"^HEALTHCHECK .*?CMD (.*)$", stage, flags=re.M | re.S)
    assert healthcheck and "/health" in healthcheck.group(1)
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"


def test_chart_image_tag_defaults_to_the_version_the_workspace_builds():
    chart = (CHART / "Chart.yaml").read_text()
    cargo = (REPO_ROOT / "Cargo.toml").read_text()
    app_version = re.search(r'^appVersion: "(.+)"$', chart, flags=re.M)
    workspace_version = re.search(r'^version = "(.+)"$', cargo, flags=re.M)
    assert app_version and workspace_version
    assert app_version.group(1) == workspace_version.group(1)
    image = quiver_container(render([]))["image"]
    assert image == f"quiver:{app_version.group(1)}"
