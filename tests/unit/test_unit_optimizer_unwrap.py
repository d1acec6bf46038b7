"""Which optimizer the runtime's checkpoint code and its step code reach through wrappers.

Accelerate wraps the torch optimizer (AcceleratedOptimizer); under DeepSpeed it wraps
DeepSpeed's ZeRO optimizer, which itself wraps the torch AdamW. The checkpoint code must
reach the AdamW (it holds the Adam moments), the step code only goes one level down.
Fake wrappers stand in for both here; tests/integration and tests/distributed check the
real ones.
"""

import torch

from rlhf_dist.distributed.guard import stepping_optimizer
from rlhf_dist.distributed.training_state import innermost_optimizer


class Wrapper:
    """Holds `.optimizer` (and `.scaler`) as Accelerate's and DeepSpeed's wrappers do."""

    def __init__(self, optimizer, scaler=None):
        self.optimizer, self.scaler = optimizer, scaler


def adamw() -> torch.optim.AdamW:
    return torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))])


def test_checkpoint_code_unwraps_every_level_down_to_the_torch_optimizer():
    inner = adamw()
    assert innermost_optimizer(Wrapper(Wrapper(inner))) is inner  # Accelerate > ZeRO > AdamW
    assert innermost_optimizer(Wrapper(inner)) is inner
    assert innermost_optimizer(inner) is inner


def test_step_code_unwraps_one_level_and_none_with_a_loss_scaler():
    inner = adamw()
    assert stepping_optimizer(Wrapper(inner)) is inner
    scaled = Wrapper(inner, scaler=object())  # the wrapper's step unscales: keep it
    assert stepping_optimizer(scaled) is scaled
