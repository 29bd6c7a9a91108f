"""Inputs the policy workers share: a random rollout batch and the learning-rate scheduler stand-in that
``ActorPolicy`` steps (torch and nemo_dapo.core only, so a worker may import it before or after its CPU shims)."""
import torch

from nemo_dapo.core.types import RolloutBatch


class NoSchedule:
    """A scheduler whose ``step`` does nothing: the tests fix the learning rate."""

    def step(self):
        pass


def random_rollout(n=4, prompt=3, response=5, vocab=40, seed=0) -> RolloutBatch:
    """``n`` rows (n <= 4) of random ids in [3, vocab): full prompts and responses, one group, fixed advantages."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (n, prompt + response), generator=g)
    adv = torch.tensor([1.0, -0.5, 0.25, 0.75])[:n]
    return RolloutBatch(prompt_ids=ids[:, :prompt], prompt_mask=torch.ones(n, prompt, dtype=torch.long),
                        response_ids=ids[:, prompt:], response_mask=torch.ones(n, response),
                        group_ids=torch.zeros(n, dtype=torch.long), truncated=torch.zeros(n, dtype=torch.bool),
                        advantages=adv)
