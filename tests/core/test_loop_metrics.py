"""The rollout step's metrics (core/loop_metrics.py) against slow references."""
import math

import pytest
import torch

from nemo_dapo.core.loop_metrics import mismatch_by_lag
from nemo_dapo.core.types import LocalReducer, RolloutBatch


def batch_with(engine, old, versions, mask):
    b = len(engine)
    return RolloutBatch(prompt_ids=torch.zeros(b, 1, dtype=torch.long), prompt_mask=torch.ones(b, 1),
                        response_ids=torch.zeros_like(versions), response_mask=mask.float(),
                        group_ids=torch.zeros(b, dtype=torch.long), truncated=torch.zeros(b, dtype=torch.bool),
                        engine_logp=engine, old_logp=old, token_version=versions)


def reference(batch, rows, version):
    """Token by token: mean |exp(engine - trainer) - 1| over the valid tokens of each lag class."""
    sums = {"fresh": [], "stale": []}
    for i in rows:
        for t in range(batch.response_ids.shape[1]):
            if batch.response_mask[i, t]:
                kind = "fresh" if int(batch.token_version[i, t]) == version else "stale"
                sums[kind].append(abs(math.exp(float(batch.engine_logp[i, t] - batch.old_logp[i, t])) - 1.0))
    return {f"partial/logp_mismatch_{k}": sum(v) / len(v) for k, v in sums.items() if v}


def test_mismatch_by_lag_matches_a_token_loop():
    g = torch.Generator().manual_seed(0)
    engine, old = -torch.rand(5, 7, generator=g) * 3, -torch.rand(5, 7, generator=g) * 3
    versions = torch.randint(2, 5, (5, 7), generator=g)
    mask = torch.rand(5, 7, generator=g) > 0.3
    batch = batch_with(engine, old, versions, mask)
    for rows in ([0, 1, 2, 3, 4], [1, 3]):
        got = mismatch_by_lag(batch, rows, 4, LocalReducer())
        want = reference(batch, rows, 4)
        assert set(got) == set(want) == {"partial/logp_mismatch_fresh", "partial/logp_mismatch_stale"}
        for key in want:
            assert got[key] == pytest.approx(want[key], rel=1e-6)


def test_mismatch_by_lag_names_only_the_classes_present():
    versions = torch.full((2, 3), 7)
    engine = torch.log(torch.tensor([[0.5, 0.25, 0.1], [0.2, 0.9, 0.3]]))
    batch = batch_with(engine, engine.clone(), versions, torch.ones(2, 3, dtype=torch.bool))
    assert mismatch_by_lag(batch, [0, 1], 7, LocalReducer()) == {"partial/logp_mismatch_fresh": 0.0}
    assert mismatch_by_lag(batch, [0, 1], 8, LocalReducer()) == {"partial/logp_mismatch_stale": 0.0}
    batch.old_logp = engine - math.log(2.0)  # the engine's probability twice the trainer's: |2 - 1| per token
    assert mismatch_by_lag(batch, [0, 1], 7, LocalReducer())["partial/logp_mismatch_fresh"] == pytest.approx(1.0)
    batch.engine_logp = None
    assert mismatch_by_lag(batch, [0, 1], 7, LocalReducer()) == {}
