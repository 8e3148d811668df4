"""Every rendered object validates offline against the Kubernetes schemas, 1.30 to the newest shipped."""

from __future__ import annotations

import copy

import kubernetes_validate
import pytest
from deploy_k8s import OVERLAYS, VERSIONS, find, schema_errors


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_validates_strictly(rendered, overlay):
    errors = schema_errors(rendered[overlay])
    assert not errors, "\n".join(errors)


def test_validator_rejects_a_named_grpc_probe_port(rendered):
    """The check above has teeth: native gRPC probes take numbers only, and the schema knows it."""
    deployment = copy.deepcopy(find(rendered["cpu"], "Deployment", "mmserve"))
    deployment["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["grpc"]["port"] = "grpc"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, VERSIONS[0], strict=True)
