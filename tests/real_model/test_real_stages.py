"""Every stage on TRL-format conversational data in the two conventions real chat
tokenizers bring, PAD == EOS (as SmolLM2 ships) and no PAD at all, without touching the
tokenizer (a distinct PAD, the third, is what every other test's tokenizer has): tiny random Llamas that carry SmolLM2's real
tokenizer (49,152-token vocabulary, ChatML template) run sft -> rm -> ppo with a critic
from the reward model, grpo with a reward function, dpo, kto and eval through the Python
API. (The real weights run in test_real_smoke.py; launch/bench/real_model.sh runs every
stage on them.)
"""

from __future__ import annotations

import json
import math

import pytest

import rlhf_dist

COMMON = {
    "run.progress": False,
    "run.log_every": 1,
    "data.max_length": 96,
    "data.max_prompt_length": 56,
    "generation.max_new_tokens": 8,
}
RL = {
    "ppo.iterations": 1,
    "ppo.rollout_batch_size": 4,
    "ppo.rollout_micro_batch_size": 4,
    "ppo.minibatch_size": 4,
    "ppo.micro_batch_size": 4,
    "ppo.ppo_epochs": 1,
}
GOLD = "rlhf_dist.demo.task:gold_reward_fn"


def _finite(summary: dict) -> bool:
    return all(math.isfinite(v) for v in summary.values() if isinstance(v, float))


@pytest.mark.slow
@pytest.mark.parametrize("convention", ["shipped", "nopad"])
def test_every_stage_runs_with_the_tokenizer_as_shipped(
    convention, tiny_real_vocab, real_tokenizers, chat_files, tmp_path
):
    from transformers import AutoTokenizer

    policy = str(tiny_real_vocab[convention]["policy"])
    f = {k: str(v) for k, v in chat_files.items()}
    batch = {"batch_size": 8, "micro_batch_size": 4}

    def keys(stage: str, **extra) -> dict:
        sizes = {f"{stage}.{k}": v for k, v in batch.items()} if stage != "ppo" else RL
        return {**COMMON, **sizes, "run.output_dir": str(tmp_path / stage), **extra}

    sft = rlhf_dist.sft(keys("sft", **{"model.policy": policy, "data.train": f["sft"]}))
    sft_final = str(tmp_path / "sft" / "final")
    rm = rlhf_dist.reward_model(
        keys("rm", **{"model.policy": sft_final, "data.train": f["prefs"], "data.eval": f["prefs"]})
    )
    rm_final = str(tmp_path / "rm" / "final")
    ppo = rlhf_dist.ppo(
        {
            **keys("ppo", **{"model.policy": sft_final, "model.reward": rm_final}),
            "data.train": f["prompts"],
            "ppo.critic_init": "reward",
        }  # fmt: skip
    )
    grpo = rlhf_dist.ppo(
        {
            **keys("ppo", **{"model.policy": sft_final, "reward.function": GOLD}),
            "run.output_dir": str(tmp_path / "grpo"),
            "data.train": f["prompts"],
            "ppo.estimator": "grpo",
            "ppo.samples_per_prompt": 2,
        }  # fmt: skip
    )
    dpo = rlhf_dist.dpo(keys("dpo", **{"model.policy": sft_final, "data.train": f["prefs"]}))
    kto = rlhf_dist.kto(keys("kto", **{"model.policy": sft_final, "data.train": f["kto"]}))
    ev = rlhf_dist.eval(
        {**COMMON, "model.policy": str(tmp_path / "grpo" / "final"), "eval.reference": sft_final,
         "reward.function": GOLD, "data.eval": f["eval"], "run.output_dir": str(tmp_path / "eval")}
    )  # fmt: skip
    for name, summary in {"sft": sft, "rm": rm, "ppo": ppo, "grpo": grpo, "dpo": dpo,
                          "kto": kto, "eval": ev}.items():  # fmt: skip
        assert summary and _finite(summary), (name, summary)
        on_disk = tmp_path / name / "summary.json"
        assert json.loads(on_disk.read_text()) == json.loads(json.dumps(summary)), name
    assert (tmp_path / "ppo" / "critic" / "model.safetensors").is_file()
    for stage in ("sft", "rm", "ppo", "grpo", "dpo", "kto"):
        exported = AutoTokenizer.from_pretrained(str(tmp_path / stage / "final"))
        assert exported.pad_token_id == real_tokenizers[convention].pad_token_id, stage
