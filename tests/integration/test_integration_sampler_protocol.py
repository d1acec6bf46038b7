"""Any object with the Sampler protocol's methods samples PPO's rollouts
(rlhf_dist/generation/base.py): a fake one, written here without subclassing any of the
package's samplers, is passed to train_ppo; its tokens are what the iteration scores and
trains on, and the policy's weights move."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from rlhf_dist.config import GenerationConfig, config_from_dict
from rlhf_dist.distributed import Runtime
from rlhf_dist.generation import Prompts, Sampler, Samples
from rlhf_dist.trainers import ppo

T = 6  # tokens of every fake response, the last one a stop token


class FakeSampler:
    """Fixed-length responses of random ordinary tokens ending in the first stop id,
    drawn from its own generator; it records every call."""

    from_actor = False  # it does not decode with the actor
    in_step = False
    version = 0

    def __init__(self, vocab: int, special: set[int]) -> None:
        self.ordinary = torch.tensor([i for i in range(vocab) if i not in special])
        self.generator = torch.Generator().manual_seed(7)
        self.calls: list[str] = []
        self.prompts: list[torch.Tensor] = []
        self.returned: list[torch.Tensor] = []

    def sync(
        self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, gen: GenerationConfig,
        stop_ids: Any, tokenizer: Any,
    ) -> None:  # fmt: skip
        self.calls.append("sync")

    def sample(
        self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, gen: GenerationConfig,
        stop_ids: Any, pad_id: int, rows_per_pass: int | None = None,
    ) -> Samples:  # fmt: skip
        self.calls.append("sample")
        B = prompt_ids.shape[0]
        pick = torch.randint(0, len(self.ordinary), (B, T), generator=self.generator)
        ids = self.ordinary[pick]
        ids[:, -1] = int(list(stop_ids)[0])
        self.prompts.append(prompt_ids.clone())
        self.returned.append(ids.clone())
        return Samples(ids, torch.full((B, T), -1.0), torch.zeros(B, dtype=torch.long))

    def sleep(self) -> None:
        self.calls.append("sleep")

    def expect_next(self, iteration: int, upcoming: Prompts | None) -> None:
        self.calls.append(f"expect {iteration}")

    def stats(self, runtime: Runtime) -> dict[str, float]:
        return {"rollout/fake_sampler": 1.0}

    def servers(self) -> None:
        return None

    def episodes(self, prompts: Prompts, play: Callable[[Any], Callable[[], list]]) -> list:
        raise NotImplementedError

    def close(self) -> None:
        self.calls.append("close")


def test_a_fake_sampler_samples_what_ppo_trains(
    task_env, runtime, tmp_path, data_cfg, saved_state_dict, changed_tensors, read_jsonl
):
    tokenizer = task_env.tokenizer
    fake = FakeSampler(len(tokenizer), set(tokenizer.all_special_ids))
    sampler: Sampler = fake  # the protocol, structurally
    out = tmp_path / "ppo"
    tree = {
        "run": {
            "output_dir": str(out),
            "seed": 0,
            "log_every": 1,
            "samples_every": 1,
            "num_samples": 8,
        },
        "model": {"policy": str(task_env.policy)},
        "data": data_cfg(train=str(task_env.files.prompts)),
        "generation": {"max_new_tokens": T, "temperature": 1.0},
        "reward": {"function": "rlhf_dist.demo.task:positive_word_reward"},
        "ppo": {
            "iterations": 1,
            "rollout_batch_size": 8,
            "rollout_micro_batch_size": 4,
            "ppo_epochs": 1,
            "minibatch_size": 8,
            "micro_batch_size": 8,
            "optim": {"lr": 1e-3},
            "critic_optim": {"lr": 1e-3},
            "critic_init": "policy",
        },
    }
    summary = ppo.train_ppo(config_from_dict(tree), runtime, sampler=sampler)
    assert summary["iterations"] == 1

    # one rollout: synced, sampled (the whole shard at once) and put to sleep, in that order
    assert fake.calls == ["expect 1", "sync", "sample", "sleep"]
    (returned,) = fake.returned
    assert returned.shape == (8, T)
    # what the iteration logged and trained on are the fake's tokens (the stop token is
    # each response's last; nothing was cut)
    samples = [r for r in read_jsonl(out / "samples.jsonl") if r["step"] == 1]
    texts = [tokenizer.decode(row[:-1].tolist(), skip_special_tokens=True) for row in returned]
    assert [r["response"] for r in samples] == texts
    metrics = [r for r in read_jsonl(out / "metrics.jsonl") if r.get("step") == 1]
    assert metrics and metrics[-1]["rollout/fake_sampler"] == 1.0
    assert metrics[-1]["rollout/length"] == T

    before, after = saved_state_dict(task_env.policy), saved_state_dict(out / "final")
    assert changed_tensors(before, after), "the update changed no weight of the policy"
