"""The consolidated training state of a one-process run reads the inner torch AdamW.

Accelerate wraps the optimizer even with one process; the checkpoint code must look
through that wrapper (tests/distributed/scripts/grad_probe.py checks ZeRO-2 and ZeRO-3).
"""

from __future__ import annotations

import torch

from rlhf_dist.distributed.training_state import innermost_optimizer


def prepared(runtime, seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return runtime.prepare(model, optimizer, 2, 1, 1.0, "float32")


def test_checkpoint_state_comes_from_the_inner_adamw_and_restores_into_it(runtime):
    model, optimizer = prepared(runtime, seed=0)
    inner = innermost_optimizer(optimizer)
    assert type(inner) is torch.optim.AdamW and inner is not optimizer
    loss = model(torch.randn(2, 4)).sum()  # [2, 1] -> scalar
    assert runtime.micro_backward(model, loss, last=True)
    assert runtime.optimizer_step(model, optimizer, [1.0]) is not None
    state = runtime.gather_training_state(model, optimizer)
    named = dict(runtime.unwrap(model).named_parameters())
    assert state["step"] == 1 and state["exp_avg"].keys() == named.keys()
    for name, p in named.items():
        assert torch.equal(state["exp_avg"][name], inner.state[p]["exp_avg"])

    fresh, fresh_optimizer = prepared(runtime, seed=1)
    runtime.restore_optimizer_state(fresh, fresh_optimizer, state)
    fresh_inner = innermost_optimizer(fresh_optimizer)
    for name, p in runtime.unwrap(fresh).named_parameters():
        assert torch.equal(fresh_inner.state[p]["exp_avg_sq"], state["exp_avg_sq"][name])
        assert int(fresh_inner.state[p]["step"]) == 1
