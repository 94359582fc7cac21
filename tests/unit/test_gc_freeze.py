"""The engine freezes its startup objects unless DEEPINFER_GC_FREEZE=0 (the test suite's
setting: it builds and drops many engines)."""
import gc

from deepinfer.engine.engine_startup import freeze_startup_objects


def test_startup_objects_are_frozen_unless_switched_off(monkeypatch):
    gc.unfreeze()
    try:
        monkeypatch.setenv("DEEPINFER_GC_FREEZE", "0")
        freeze_startup_objects()
        assert gc.get_freeze_count() == 0
        monkeypatch.setenv("DEEPINFER_GC_FREEZE", "1")
        keep = [object() for _ in range(10)]
        freeze_startup_objects()
        assert gc.get_freeze_count() > len(keep)
    finally:
        gc.unfreeze()
