"""Every client implementation states the front's `EngineClient` interface (same members, call
signatures the front's calls fit), and `make_client` picks the implementation from the configs.
The clients are constructed, never started: no process, no model."""
from __future__ import annotations

import asyncio
import inspect
import shutil

import pytest

from deepinfer.clients.colocated import ColocatedClient
from deepinfer.clients.data_parallel import DataParallelClient
from deepinfer.clients.disagg import DisaggClient
from deepinfer.clients.ep_disagg import EPDisaggClient
from deepinfer.clients.factory import make_client
from deepinfer.clients.protocol import EngineClient, ScalableClient
from deepinfer.clients.ray_data_parallel import RayDataParallelClient
from deepinfer.cluster.cluster_config import ClusterConfig
from deepinfer.engine.engine_config import EngineConfig
from deepinfer.ep.ep_config import EPConfig

IMPLEMENTATIONS = (ColocatedClient, DataParallelClient, RayDataParallelClient, DisaggClient,
                   EPDisaggClient)
EP = EPConfig(data_parallel_size=2, enable_expert_parallel=True)


def _members(protocol) -> tuple[dict, dict, set]:
    """(methods, properties, data attributes) that `protocol` declares (its bases included)."""
    methods, properties, data = {}, {}, set()
    for klass in reversed([k for k in protocol.__mro__ if k not in (object,)
                           and getattr(k, "_is_protocol", False)]):
        for name, value in vars(klass).items():
            if name.startswith("_"):
                continue
            if isinstance(value, property):
                properties[name] = value
            elif inspect.isfunction(value):
                methods[name] = value
        data |= {n for n in getattr(klass, "__annotations__", {}) if not n.startswith("_")}
    return methods, properties, data


def _check_signature(name: str, declared, implemented) -> None:
    """Every call the protocol allows is a valid call of the implementation: each declared
    parameter exists with the same kind and default, and any extra one has a default."""
    want = inspect.signature(declared).parameters
    have = inspect.signature(implemented).parameters
    for pname, param in want.items():
        assert pname in have, f"{name}: no parameter {pname!r}"
        got = have[pname]
        assert got.kind == param.kind, f"{name}({pname}): {got.kind} != {param.kind}"
        assert got.default == param.default, f"{name}({pname}): default {got.default!r}"
    assert list(have)[:len(want)] == list(want), f"{name}: positional order differs"
    for pname, got in have.items():
        if pname not in want:
            assert got.default is not inspect.Parameter.empty or \
                got.kind in (got.VAR_POSITIONAL, got.VAR_KEYWORD), \
                f"{name}: extra parameter {pname!r} without a default"
    if inspect.iscoroutinefunction(declared):
        assert inspect.iscoroutinefunction(implemented), f"{name} must be async"
    if name == "generate":  # an async generator: the front iterates it
        assert inspect.isasyncgenfunction(implemented), "generate must be an async generator"


@pytest.mark.parametrize("cls", IMPLEMENTATIONS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("protocol", [EngineClient, ScalableClient], ids=lambda p: p.__name__)
def test_each_implementation_has_the_protocol_members(cls, protocol):
    if protocol is ScalableClient and not hasattr(cls, "scale"):
        pytest.skip("not scalable (the admin API answers 501 for it)")
    methods, properties, data = _members(protocol)
    assert methods and properties and data  # the protocol was read
    for name, declared in methods.items():
        implemented = getattr(cls, name, None)
        assert callable(implemented), f"{cls.__name__} has no method {name}"
        _check_signature(name, declared, implemented)
    for name in properties:
        assert isinstance(inspect.getattr_static(cls, name, None), property), \
            f"{cls.__name__}.{name} is not a property"
    # data attributes are set by __init__: checked on constructed clients below

def test_only_disaggregated_clients_scale():
    assert [c for c in IMPLEMENTATIONS if hasattr(c, "scale")] == [DisaggClient, EPDisaggClient]


def test_a_signature_mismatch_is_caught():
    class Wrong:
        async def generate(self, request_id, prompt_token_ids, params):  # no mm_inputs
            yield None
    with pytest.raises(AssertionError, match="arrival_time"):
        _check_signature("generate", EngineClient.generate, Wrong.generate)


# --- the factory ------------------------------------------------------------------------------
def _dispose(client) -> None:
    """Release what a never-started client holds (its context, its sockets, its temp dir)."""
    if isinstance(client, DisaggClient):
        asyncio.run(client.shutdown())  # no workers: closes the bound output socket
        return
    client._ctx.term()
    shutil.rmtree(client._ipc_dir, ignore_errors=True)


def _cluster(**overrides) -> ClusterConfig:
    return ClusterConfig(**{"num_prefill_workers": 1, "num_decode_workers": 2,
                            "kv_store_url": "none", **overrides})


class FakePlacement:
    """Stands in for a Ray placement (nothing is reserved before `start`)."""


@pytest.mark.parametrize("kwargs, expected", [
    ({}, ColocatedClient),
    ({"ep_config": EP}, DataParallelClient),
    ({"ep_config": EP, "rank_placement": FakePlacement()}, RayDataParallelClient),
    ({"cluster": _cluster()}, DisaggClient),
    ({"cluster": _cluster(), "decode_ep": EP}, EPDisaggClient),
], ids=["colocated", "data-parallel", "data-parallel-ray", "p-d", "ep-p-d"])
def test_make_client_picks_the_implementation(kwargs, expected):
    client = make_client(EngineConfig(block_size=16), **kwargs)
    try:
        assert type(client) is expected
        assert isinstance(client, EngineClient)
        assert isinstance(client, ScalableClient) == (expected in (DisaggClient, EPDisaggClient))
        _, _, data = _members(EngineClient)
        assert {name for name in data if not hasattr(client, name)} == set()
        if expected is EPDisaggClient:  # each decode worker is a group of 2 ranks
            assert client.num_decode_groups == 2 and client.cluster.num_decode_workers == 4
            assert type(client.health).__name__ == "EPGroupHealth"
        if expected is RayDataParallelClient:
            assert client.placement is kwargs["rank_placement"]
    finally:
        _dispose(client)


def test_make_client_passes_options_to_the_colocated_client():
    client = make_client(EngineConfig(), ready_timeout_s=7.0, loop_stall_timeout_s=None)
    try:
        assert (client.ready_timeout_s, client.loop_stall_timeout_s) == (7.0, None)
    finally:
        _dispose(client)


@pytest.mark.parametrize("kwargs, error", [
    ({"cluster": _cluster(), "ep_config": EP}, ValueError),
    ({"decode_ep": EP}, ValueError),
    ({"rank_placement": FakePlacement()}, ValueError),
    ({"cluster": _cluster(), "ready_timeout_s": 5.0}, TypeError),
])
def test_make_client_refuses_configs_that_do_not_go_together(kwargs, error):
    with pytest.raises(error):
        make_client(EngineConfig(), **kwargs)
