"""The pure packages (core, routing, sampling_params, moe/eplb) import with torch, zmq,
fastapi, ray and redis blocked, and load nothing outside the standard library and numpy.

Modules are discovered from the file system, so files added later are covered automatically.
The imports run in a fresh subprocess: this test process may already have torch loaded.
"""
from __future__ import annotations

import json
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# A listed name that does not exist fails.
PURE_PACKAGES = ("deepinfer.core", "deepinfer.routing", "deepinfer.sim")
PURE_SINGLE_MODULES = ("deepinfer.sampling_params", "deepinfer.invalid_parameter", "deepinfer.moe.eplb", "deepinfer.moe.eplb_config",
                       "deepinfer.moe.moe_config", "deepinfer.models.mla_config",
                       "deepinfer.moe.expert_moves", "deepinfer.moe.load_recorder",
                       "deepinfer.spec.spec_config", "deepinfer.spec.drafter",
                       "deepinfer.spec.ngram", "deepinfer.spec.draft_backoff")
BLOCKED = ("torch", "zmq", "fastapi", "ray", "redis")

# Runs in the child: install the blocker, import everything, report as JSON on stdout.
CHILD = r"""
import importlib, importlib.abc, json, sys, traceback

BLOCKED = set(%(blocked)r)
attempts = []

class Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".")[0] in BLOCKED:
            attempts.append(fullname)
            raise ImportError(f"{fullname} is blocked in pure modules")
        return None

sys.meta_path.insert(0, Blocker())
for name in list(sys.modules):
    if name.split(".")[0] in BLOCKED:
        del sys.modules[name]
before = set(sys.modules)

errors = {}
for module in %(modules)r:
    try:
        importlib.import_module(module)
    except BaseException:
        errors[module] = traceback.format_exc(limit=4)

loaded = sorted({m.split(".")[0] for m in set(sys.modules) - before})
print(json.dumps({"errors": errors, "attempts": attempts, "loaded": loaded,
                  "stdlib": sorted(sys.stdlib_module_names)}))
"""


def discover_pure_modules() -> list[str]:
    """Every module and subpackage under the pure packages, found without importing them."""
    modules: list[str] = []
    for package in PURE_PACKAGES:
        path = ROOT.joinpath(*package.split("."))
        modules.append(package)
        for info in pkgutil.walk_packages([str(path)], prefix=package + "."):
            modules.append(info.name)
    modules.extend(PURE_SINGLE_MODULES)
    return modules


def run_child(modules: list[str]) -> dict:
    code = CHILD % {"blocked": BLOCKED, "modules": modules}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def child_report() -> dict:
    return run_child(discover_pure_modules())


def test_discovery_finds_the_core_modules():
    modules = discover_pure_modules()
    for expected in ("block_pool", "kv_cache_manager", "prefix_hash", "request", "scheduler",
                     "scheduler_output", "step_budget"):
        assert f"deepinfer.core.{expected}" in modules
    assert "deepinfer.sampling_params" in modules


def test_every_listed_pure_package_exists():
    # A name listed here but absent would otherwise be "checked" by importing nothing.
    for package in PURE_PACKAGES:
        assert ROOT.joinpath(*package.split("."), "__init__.py").is_file(), package
    for module in PURE_SINGLE_MODULES:
        assert ROOT.joinpath(*module.split(".")).with_suffix(".py").is_file(), module


def test_pure_modules_import_with_heavy_deps_blocked(child_report):
    assert child_report["errors"] == {}, "\n".join(child_report["errors"].values())


def test_no_blocked_module_was_even_attempted(child_report):
    # An import guarded by try/except would still pull torch in on a normal install.
    assert child_report["attempts"] == []


def test_only_stdlib_numpy_and_deepinfer_are_loaded(child_report):
    allowed = set(child_report["stdlib"]) | {"numpy", "deepinfer"}
    extra = [m for m in child_report["loaded"] if m not in allowed]
    assert extra == [], f"pure modules loaded third-party packages: {extra}"


def test_the_blocker_really_blocks():
    # Guards against a vacuous pass: a module that imports torch must fail in the child.
    report = run_child(["json", "torch"])
    assert "torch" in report["errors"]
    assert "torch" in report["attempts"]
