"""``LoopSettings`` for tests that drive ``core.loop.DAPOLoop`` directly (a run builds them from the YAML through
core/settings.build_loop_parts). The values below are the tests' own choices, not the product's defaults."""
from dataclasses import replace

from nemo_dapo.core.loop import LoopSettings
from nemo_dapo.core.settings import OverlongSettings, SkipHistorySettings

_TEST_VALUES = dict(ppo_epochs=1, temperature=1.0, top_p=1.0, adv_eps=1e-6, scale_by_std=True,
                    shuffle_minibatches=True, seed=0, streaming=False, on_filler_full="abort",
                    fill_order="finish")
_OVERLONG = OverlongSettings(enabled=True, l_max=None, l_cache=4, penalty_factor=1.0)
_SKIP_HISTORY = SkipHistorySettings(enabled=False, skip_prob=0.5, max_skips=3)


def loop_settings(*, group_size: int, mini_batch_size: int, max_new_tokens: int, overlong=None, skip_history=None,
                  **fields) -> LoopSettings:
    """Every field given: ``fields`` replace the test values; ``overlong`` / ``skip_history`` are dicts of the
    fields of those blocks to replace (e.g. ``overlong={"l_cache": 2}``)."""
    return LoopSettings(group_size=group_size, mini_batch_size=mini_batch_size, max_new_tokens=max_new_tokens,
                        overlong=replace(_OVERLONG, **(overlong or {})),
                        skip_history=replace(_SKIP_HISTORY, **(skip_history or {})), **{**_TEST_VALUES, **fields})
