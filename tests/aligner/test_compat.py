"""Version glue: the trainer state packed into a checkpoint entry survives a weights-only torch.load."""
import io

import pytest
import torch

from nemo_dapo.aligner.compat import SUPPORTED, check_versions, pack_state, unpack_state
from nemo_dapo.core.dynamic_sampling import Group


def test_pack_state_round_trip_through_weights_only_load():
    state = {"step": 3, "groups": [Group(uid=5, acc=torch.tensor([1.0, 0.0]), rewards=torch.tensor([1.0, -1.0]))]}
    packed = pack_state(state)
    buf = io.BytesIO()
    torch.save({"entry": packed}, buf)  # how a checkpoint's common state is written
    loaded = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)["entry"]  # and read back by torch >= 2.6
    out = unpack_state(loaded)
    assert out["step"] == 3 and out["groups"][0].uid == 5
    assert torch.equal(out["groups"][0].rewards, state["groups"][0].rewards)


def test_unpack_state_rejects_other_entries():
    with pytest.raises(ValueError, match="uint8"):
        unpack_state(torch.zeros(3))


def test_check_versions_reports_the_installed_stack():
    found = check_versions(strict=False)
    assert set(found) == set(SUPPORTED)


def test_stack_mismatch_names_each_difference_and_ignores_local_labels():
    from nemo_dapo.aligner.compat import stack_mismatch

    same = {d: v + "+git7d576ed" for d, v in SUPPORTED.items()}  # a source install of the same releases
    assert stack_mismatch(same) == ""
    msg = stack_mismatch({**SUPPORTED, "nemo-toolkit": "2.2.0", "megatron-core": None})
    assert "found nemo-toolkit==2.2.0, megatron-core==not installed" in msg and "nemo-aligner" not in msg.split(
        "found")[1]
    assert "NeMo-Aligner 0.7.0's own image" in msg


def test_unpack_state_rejects_a_uint8_entry_of_another_shape():
    with pytest.raises(ValueError, match="1-D uint8"):
        unpack_state(pack_state({"step": 1}).reshape(1, -1))


@pytest.mark.parametrize("field", ["uid", "rewards"])
def test_the_image_builds_round_trip_check_fails_on_a_state_that_comes_back_different(monkeypatch, field):
    from nemo_dapo.aligner import compat

    real = compat.unpack_state

    def lossy(packed):
        state = real(packed)
        group = state["groups"][0]
        if field == "uid":
            group.uid += 1
        else:
            group.rewards = group.rewards.flip(0)
        return state

    monkeypatch.setattr(compat, "unpack_state", lossy)
    with pytest.raises(RuntimeError, match="does not round-trip"):
        compat._state_round_trips()
