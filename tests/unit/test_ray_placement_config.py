"""The Ray launcher's pure parts (no Ray started): per-role resource flags, which nodes can
host a role, the node-local fs store refusal, and the --cluster flags' errors."""
from __future__ import annotations

import argparse
import socket

import pytest

from deepinfer.cluster.cluster_args import add_cluster_args
from deepinfer.clients.factory import client_from_args
from deepinfer.cluster.launcher import LocalLauncher, launcher_from_args
from deepinfer.cluster.ray_launcher import (RoleResources, check_store_locality,
                                            is_node_local_store, nodes_that_fit)


def node(ip: str, alive: bool = True, **resources) -> dict:
    return {"NodeID": ip, "NodeManagerAddress": ip, "Alive": alive,
            "Resources": {"CPU": 8.0, "memory": 1e10, **resources}}


def test_role_resources_map_to_actor_options_and_node_requests():
    r = RoleResources.parse('{"num_cpus": 4, "num_gpus": 1, "prefill_node": 1}', "--x")
    assert r.actor_options(cluster_has_gpus=False) == {
        "num_cpus": 4.0, "num_gpus": 1.0, "resources": {"prefill_node": 1}}
    assert r.request(False) == {"CPU": 4.0, "GPU": 1.0, "prefill_node": 1}
    default = RoleResources.parse(None, "--x")  # a GPU each only where the cluster has GPUs
    assert default.request(cluster_has_gpus=True) == {"CPU": 1.0, "GPU": 1.0}
    assert default.request(cluster_has_gpus=False) == {"CPU": 1.0}
    mem = RoleResources.parse('{"memory": 1000}', "--x")
    assert mem.actor_options(False)["memory"] == 1000.0


@pytest.mark.parametrize("text, message", [
    ("{", "not JSON"), ("[1]", "expected a JSON object"), ('{"num_cpus": -1}', "non-negative"),
    ('{"num_gpus": "one"}', "non-negative numbers"), ('{"GPU": 1}', "write 'GPU' as 'num_gpus'"),
    ('{"prefill_node": true}', "non-negative numbers"),
])
def test_bad_resource_flags_name_the_flag(text, message):
    with pytest.raises(ValueError, match=message) as info:
        RoleResources.parse(text, "--decode-resources")
    assert str(info.value).startswith("--decode-resources")


def test_nodes_that_fit_reads_totals_of_alive_nodes():
    nodes = [node("10.0.0.1", prefill_node=1.0), node("10.0.0.2", GPU=8.0),
             node("10.0.0.3", alive=False, prefill_node=1.0)]
    assert [n["NodeID"] for n in nodes_that_fit({"CPU": 1.0, "prefill_node": 1}, nodes)] == \
        ["10.0.0.1"]
    assert [n["NodeID"] for n in nodes_that_fit({"GPU": 2.0}, nodes)] == ["10.0.0.2"]
    assert nodes_that_fit({"CPU": 16.0}, nodes) == []


def test_a_node_local_store_is_refused_only_when_prefill_can_span_nodes():
    assert is_node_local_store("fs") and is_node_local_store("fs:///data?capacity_bytes=9")
    assert is_node_local_store("/data") and is_node_local_store("~/kv")
    assert not is_node_local_store("redis://h:6379/0") and not is_node_local_store("none")
    two = [node("10.0.0.1"), node("10.0.0.2")]
    with pytest.raises(ValueError, match=r"2 Ray nodes \(10.0.0.1, 10.0.0.2\).*--kv-store-shared"):
        check_store_locality("fs:///data", shared=False, prefill_nodes=two)
    check_store_locality("fs:///data", shared=True, prefill_nodes=two)
    check_store_locality("redis://h:6379/0", shared=False, prefill_nodes=two)
    check_store_locality("fs", shared=False, prefill_nodes=two[:1])


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_cluster_args(parser)
    return parser.parse_args(list(argv))


@pytest.mark.parametrize("argv, message", [
    (("--cluster", "ray"), "give --prefill-workers and --decode-workers"),
    (("--prefill-workers", "1", "--decode-workers", "1", "--kv-store", "none",
      "--cluster", "k8s"), "unknown --cluster 'k8s'"),
    (("--prefill-workers", "1", "--decode-workers", "1", "--kv-store", "none",
      "--prefill-resources", '{"num_gpus": 1}'), "--prefill-resources needs --cluster ray"),
    (("--prefill-workers", "1", "--decode-workers", "1", "--kv-store", "none",
      "--cluster", "ray", "--decode-resources", "{"), "--decode-resources: not JSON"),
])
def test_bad_cluster_flags_are_value_errors_before_ray_starts(argv, message):
    with pytest.raises(ValueError, match=message):
        client_from_args(parse(*argv), engine_config=None)


def test_local_is_the_default_launcher():
    args = parse("--prefill-workers", "1", "--decode-workers", "1")
    assert args.cluster == "local" and isinstance(launcher_from_args(args), LocalLauncher)


def test_placement_flags_reach_the_cluster_config():
    import asyncio
    client = client_from_args(
        parse("--prefill-workers", "1", "--decode-workers", "1", "--kv-store", "none",
              "--drain-timeout", "30", "--kv-store-shared"), engine_config=None)
    try:
        assert client.cluster.drain_timeout_s == 30.0 and client.cluster.kv_store_shared
        assert isinstance(client.launcher, LocalLauncher)
    finally:
        asyncio.run(client.shutdown())


def test_cluster_host_sets_the_local_bind_address():
    """--cluster-host with the local launcher: sockets bind a non-loopback address (netns
    tests put an attacker on another host of that network); default stays loopback."""
    from deepinfer.cluster.launcher import placement_config
    for argv, host in ((("--cluster-host", "10.9.0.1"), "10.9.0.1"), ((), "127.0.0.1")):
        args = parse("--prefill-workers", "1", "--decode-workers", "1", *argv)
        launcher = launcher_from_args(args)
        assert isinstance(launcher, LocalLauncher)
        assert placement_config(args, launcher)["host"] == host
    with pytest.raises(ValueError, match="drain_timeout_s must be positive"):
        client_from_args(parse("--prefill-workers", "1", "--decode-workers", "1",
                                       "--kv-store", "none", "--drain-timeout", "0"), None)


def test_serve_exits_2_with_one_line_on_bad_ray_flags(capsys):
    from deepinfer.cli.main import main
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = main(["serve", "--port", str(port), "--prefill-workers", "1", "--decode-workers",
                 "1", "--kv-store", "none", "--cluster", "ray", "--prefill-resources", "[2]"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "expected a JSON object" in err and len(err.splitlines()) == 1, err


# --- EP groups on Ray: placement-group sizing and the flags (no Ray started) -----------------

def test_group_room_follows_the_placement_strategy():
    from deepinfer.ep.ray_rank_group import bundles_that_fit, group_room
    nodes = [node("10.0.0.1", GPU=8.0, decode_node=8.0), node("10.0.0.2", GPU=4.0, decode_node=4.0),
             node("10.0.0.3", alive=False, GPU=8.0, decode_node=8.0), node("10.0.0.4", GPU=8.0)]
    rank = {"CPU": 1.0, "GPU": 1.0, "decode_node": 1.0}
    assert bundles_that_fit(rank, nodes[0]["Resources"]) == 8
    assert bundles_that_fit(rank, nodes[3]["Resources"]) == 0  # no decode_node
    assert group_room(rank, nodes, "STRICT_PACK") == 8  # the largest one node
    assert group_room(rank, nodes, "PACK") == group_room(rank, nodes, "SPREAD") == 12
    assert group_room(rank, nodes, "STRICT_SPREAD") == 2  # one rank per node, 2 nodes fit
    assert group_room({"CPU": 3.0}, nodes, "STRICT_PACK") == 2  # 8 CPUs hold 2 x 3


def ep_args(**overrides) -> argparse.Namespace:
    values = dict(cluster="local", ep_rank_resources=None, ep_placement_strategy=None,
                  cluster_host=None)
    return argparse.Namespace(**{**values, **overrides})


@pytest.mark.parametrize("overrides, message", [
    ({"ep_rank_resources": '{"num_gpus": 1}'}, "--ep-rank-resources needs --cluster ray"),
    ({"ep_placement_strategy": "PACK"}, "--ep-placement-strategy needs --cluster ray"),
    ({"cluster": "ray", "ep_placement_strategy": "TIGHT"},
     "--ep-placement-strategy must be one of STRICT_PACK, PACK, SPREAD, STRICT_SPREAD"),
    ({"cluster": "ray", "ep_rank_resources": "{"}, "--ep-rank-resources: not JSON"),
    ({"cluster": "slurm"}, "unknown --cluster 'slurm'"),
])
def test_ep_placement_flags_are_checked_before_anything_starts(overrides, message):
    from deepinfer.ep.ep_config import EPConfig
    with pytest.raises(ValueError, match=message):
        client_from_args(ep_args(**overrides), None,
                         ep_config=EPConfig(data_parallel_size=2, enable_expert_parallel=True))


def test_ep_groups_stay_local_by_default():
    from deepinfer.clients.data_parallel import DataParallelClient
    from deepinfer.clients.ray_data_parallel import RayDataParallelClient
    from deepinfer.engine.engine_config import EngineConfig
    from deepinfer.ep.ep_config import EPConfig
    client = client_from_args(ep_args(), EngineConfig(),
                              ep_config=EPConfig(data_parallel_size=2, enable_expert_parallel=True))
    try:
        assert type(client) is DataParallelClient and not isinstance(client, RayDataParallelClient)
    finally:
        import shutil
        client._ctx.term()
        shutil.rmtree(client._ipc_dir, ignore_errors=True)
