"""No pickle (or torch.load / numpy allow_pickle) in the code that touches sockets, or in
anything it decodes with: data from another process is only ever msgpack into typed
structs (wire/) or raw tensor bytes."""
from __future__ import annotations

import ast
import pathlib

import deepinfer

ROOT = pathlib.Path(deepinfer.__file__).parent
FORBIDDEN_MODULES = {"pickle", "cPickle", "dill", "cloudpickle", "marshal", "shelve", "joblib"}
FORBIDDEN_CALLS = {("torch", "load"), ("np", "load"), ("numpy", "load"),
                   ("pickle", "loads"), ("pickle", "load")}
SOCKET_MARKERS = ("import zmq", "from zmq", "import socket", "redis", "recv(",
                  "recv_multipart(", "from deepinfer.wire", "import ray")


def _socket_modules() -> list[pathlib.Path]:
    paths = [p for p in ROOT.rglob("*.py")
             if any(marker in p.read_text() for marker in SOCKET_MARKERS)]
    # Everything that decodes what those modules receive.
    paths += list((ROOT / "wire").glob("*.py")) + list((ROOT / "kvstore").glob("*.py"))
    paths += list((ROOT / "clients").glob("*.py"))  # the front side of every channel
    return sorted(set(paths))


def _violations(path: pathlib.Path, root: pathlib.Path = ROOT) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [f"import {a.name}" for a in node.names
                      if a.name.split(".")[0] in FORBIDDEN_MODULES]
        elif isinstance(node, ast.ImportFrom) and node.module and \
                node.module.split(".")[0] in FORBIDDEN_MODULES:
            found.append(f"from {node.module} import")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                isinstance(node.func.value, ast.Name):
            if (node.func.value.id, node.func.attr) in FORBIDDEN_CALLS:
                found.append(f"{node.func.value.id}.{node.func.attr}()")
        if isinstance(node, ast.keyword) and node.arg == "allow_pickle" and \
                not (isinstance(node.value, ast.Constant) and node.value.value is False):
            found.append("allow_pickle")
    return [f"{path.relative_to(root.parent)}: {v}" for v in found]


def test_the_scan_covers_every_socket_module():
    names = {p.relative_to(ROOT).as_posix() for p in _socket_modules()}
    for expected in ("clients/colocated.py", "cluster/engine_proc.py",
                     "cluster/kv_transport.py", "clients/disagg.py", "clients/disagg_inbox.py",
                     "cluster/worker_proc.py", "clients/data_parallel.py", "ep/rank_proc.py",
                     "kvstore/redis_store.py", "wire/tokenizer_files.py",
                     "wire/engine_messages.py", "wire/worker_messages.py", "wire/ep_messages.py"):
        assert expected in names


def test_no_pickle_where_data_crosses_a_process_boundary():
    assert [v for p in _socket_modules() for v in _violations(p)] == []


def test_the_scanner_finds_what_it_looks_for(tmp_path):
    bad = tmp_path / "pkg" / "bad.py"
    bad.parent.mkdir()
    bad.write_text("import pickle\nfrom dill import loads\nimport torch\n"
                   "x = torch.load('f')\nimport numpy as np\nnp.load('f', allow_pickle=True)\n")
    found = [v.split(": ", 1)[1] for v in _violations(bad, bad.parent)]
    assert found == ["import pickle", "from dill import", "torch.load()", "np.load()",
                     "allow_pickle"]
