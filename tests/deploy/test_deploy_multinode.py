"""The `multinode` overlay: one replica as a LeaderWorkerSet group over two GPU nodes, validated
offline. Every built-in object, and each pod template as a Pod, validates strictly against the
Kubernetes schemas (the LeaderWorkerSet is a CRD: its own fields are checked here); the leader runs
`mmserve serve`, the workers `mmserve worker --node-rank $(LWS_WORKER_INDEX)`, and the flags and
MMSERVE_* variables they get are real ones that fit together (group size = --nnodes, GPUs per pod
= tensor-parallel size / nnodes, one rendezvous); the disruption budget takes one group at a time."""

from __future__ import annotations

import pytest
from deploy_k8s import find, schema_errors

from mmserve.cli import build_parser
from mmserve.config import EngineConfig, ServerConfig, env_names


@pytest.fixture(scope="module")
def multinode(rendered):
    return rendered["multinode"]


def templates(docs) -> dict:
    group = find(docs, "LeaderWorkerSet", "mmserve")["spec"]["leaderWorkerTemplate"]
    return {"leader": group["leaderTemplate"], "worker": group["workerTemplate"]}


def env_of(docs, template) -> dict[str, str]:
    [c] = template["spec"]["containers"]
    env = {}
    for source in c.get("envFrom", []):
        env.update(find(docs, "ConfigMap", source["configMapRef"]["name"])["data"])
    env.update({e["name"]: e["value"] for e in c.get("env", [])})
    return env


def test_the_overlay_validates_apart_from_the_crd(multinode):
    docs = [d for d in multinode if d["kind"] != "LeaderWorkerSet"]
    docs += [{"apiVersion": "v1", "kind": "Pod", "metadata": {"name": f"mmserve-{role}", **t["metadata"]},
              "spec": t["spec"]} for role, t in templates(multinode).items()]
    errors = schema_errors(docs)
    assert not errors, "\n".join(errors)


def test_one_group_is_one_replica_the_leader_serves_and_the_workers_join(multinode):
    lws = find(multinode, "LeaderWorkerSet", "mmserve")
    assert lws["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
    group = lws["spec"]["leaderWorkerTemplate"]
    assert group["restartPolicy"] == "RecreateGroupOnPodRestart"   # ranks cannot rejoin a running group
    roles = templates(multinode)
    [leader], [worker] = (roles[r]["spec"]["containers"] for r in ("leader", "worker"))
    assert build_parser(leader["args"]).parse_args(leader["args"]).command == "serve"
    assert worker["args"][-2:] == ["--node-rank", "$(LWS_WORKER_INDEX)"]
    expanded = [a.replace("$(LWS_WORKER_INDEX)", "1") for a in worker["args"]]   # as the kubelet expands it
    args = build_parser(expanded).parse_args(expanded)
    assert args.command == "worker" and args.node_rank == 1
    known = set(env_names(EngineConfig)) | set(env_names(ServerConfig)) | {"MASTER_ADDR", "MASTER_PORT", "HOME"}
    for role in roles.values():
        env = env_of(multinode, role)
        assert set(env) <= known, set(env) - known
        assert env["MASTER_ADDR"] == "$(LWS_LEADER_ADDRESS)" and env["MASTER_PORT"].isdigit()
        assert int(env["MMSERVE_NNODES"]) == group["size"]
        tp, nodes = int(env["MMSERVE_TENSOR_PARALLEL_SIZE"]), int(env["MMSERVE_NNODES"])
        [c] = role["spec"]["containers"]
        assert tp % nodes == 0 and int(c["resources"]["limits"]["nvidia.com/gpu"]) == tp // nodes
        shm = next(v for v in role["spec"]["volumes"] if v["name"] == "dshm")
        assert shm["emptyDir"]["medium"] == "Memory"
        assert any(m["mountPath"] == "/dev/shm" for m in c["volumeMounts"])
    ports = {p["containerPort"] for p in leader["ports"]}
    assert int(env_of(multinode, roles["leader"])["MASTER_PORT"]) in ports   # node 0 hosts the TCP store
    assert "readinessProbe" in leader and "readinessProbe" not in worker   # the leader's readiness is the group's


def test_evictions_take_one_group_at_a_time(multinode):
    """The PodDisruptionBudget counts every pod of the set, leaders and workers, by the label LWS puts
    on each (`leaderworkerset.sigs.k8s.io/name`, the set's name): evicting one pod ends its whole group,
    whose pods stay unavailable until it is back, so a budget of one pod is one group."""
    lws = find(multinode, "LeaderWorkerSet", "mmserve")
    pdb = find(multinode, "PodDisruptionBudget")
    assert pdb["spec"]["selector"] == {"matchLabels": {"leaderworkerset.sigs.k8s.io/name": lws["metadata"]["name"]}}
    assert pdb["spec"]["maxUnavailable"] == 1 and "minAvailable" not in pdb["spec"]
    assert lws["spec"]["leaderWorkerTemplate"]["restartPolicy"] == "RecreateGroupOnPodRestart"


def test_the_service_reaches_the_leaders_only(multinode):
    selector = find(multinode, "Service", "mmserve")["spec"]["selector"]
    roles = templates(multinode)
    labels = {r: t["metadata"]["labels"] for r, t in roles.items()}
    assert selector.items() <= labels["leader"].items()
    assert not selector.items() <= labels["worker"].items()
