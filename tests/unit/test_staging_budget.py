"""`StagingBudget`: prompts are admitted only while their staged KV fits the cap."""
from __future__ import annotations

import pytest

from deepinfer.cluster.staging_budget import StagingBudget


def test_admission_keeps_staged_plus_promised_under_the_cap():
    budget = StagingBudget(capacity_bytes=1000, bytes_per_block=100, block_size=16)
    assert budget.need(1) == 100 and budget.need(16) == 100 and budget.need(17) == 200
    assert budget.can_admit(budget.need(60), staged_bytes=0)  # 400 bytes
    budget.promise("a", 400)
    assert budget.can_admit(600, staged_bytes=0) and not budget.can_admit(600, staged_bytes=1)
    budget.promise("b", 500)
    assert budget.used_bytes(staged_bytes=100) == 1000
    assert not budget.can_admit(100, staged_bytes=100)
    budget.release("a")  # staged now: its bytes move to staged_bytes
    assert budget.can_admit(100, staged_bytes=400) and not budget.can_admit(101, staged_bytes=400)
    assert budget.promised_bytes == 500


def test_a_prompt_larger_than_the_cap_runs_alone():
    budget = StagingBudget(capacity_bytes=1000, bytes_per_block=100, block_size=16)
    assert budget.can_admit(5000, staged_bytes=0)
    assert not budget.can_admit(5000, staged_bytes=1)
    with pytest.raises(ValueError, match="capacity"):
        StagingBudget(0, 100, 16)
