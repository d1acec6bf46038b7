"""generation.backend=vllm with a real in-process vLLM engine (CPU), one rank:

- after a weight sync the engine's greedy tokens equal the actor's own (hf backend) greedy
  tokens, for a full model and for LoRA adapters merged into the base; an engine that was
  NOT synced is caught by the same check;
- the log-prob vLLM drew each token with is the trainer's log-prob of it (fp32);
- stop ids, min_new_tokens and the response layout mean the same as in the hf backend;
- PPO (GRPO groups) runs end to end on vLLM rollouts with the sync check, the sampler-gap metrics and
  the truncated importance-sampling correction on, and resumes from its checkpoint.

Skipped where vllm is not installed (launch/setup.sh installs it on CPU machines; CI has it).
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

pytest.importorskip("vllm")

from rlhf_dist.config import config_from_dict  # noqa: E402
from rlhf_dist.engine.decode import generate, truncate_after_eos  # noqa: E402
from rlhf_dist.engine.forward import token_logprobs  # noqa: E402
from rlhf_dist.generation.vllm import SyncError, VLLMEngine  # noqa: E402
from rlhf_dist.models.lora import merged_adapters  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engine(task_env):
    cfg = config_from_dict(
        {"model": {"policy": str(task_env.policy)}, "generation": {"vllm_kv_cache_gib": 0.25}}
    )
    return VLLMEngine(cfg, torch.device("cpu"))


@pytest.fixture
def actor(task_env):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(task_env.policy)).eval()


def _prompts(task_env, n=6):
    from rlhf_dist.data.rows import left_pad

    tok = task_env.tokenizer
    texts = ["the food was", "i think the service", "a great", "the room", "we loved it", "meh"]
    ids = [tok(t)["input_ids"] for t in texts[:n]]
    return left_pad(ids, tok.pad_token_id)


def _greedy(max_new_tokens=12, min_new_tokens=0):
    from rlhf_dist.config import GenerationConfig

    return GenerationConfig(
        max_new_tokens=max_new_tokens, min_new_tokens=min_new_tokens, temperature=1.0, top_k=1
    )


def _perturb(model, seed=1, scale=0.3):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale * p.std().clamp(min=1e-3))


def test_sync_makes_vllm_greedy_equal_the_actor_and_a_stale_engine_is_caught(
    engine, actor, task_env
):
    ids, mask = _prompts(task_env)
    tok, stops = task_env.tokenizer, (task_env.tokenizer.eos_token_id,)
    engine.load_weights(actor)
    engine.check_sync(actor, ids, mask, _greedy(), tok, stops)  # equal weights: passes
    _perturb(actor)  # the "update"; the engine still holds the old weights
    with pytest.raises(SyncError, match="greedy tokens differ"):
        engine.check_sync(actor, ids, mask, _greedy(), tok, stops)
    engine.load_weights(actor)
    engine.check_sync(actor, ids, mask, _greedy(), tok, stops)


def test_sync_of_lora_adapters_merged_into_the_base(engine, actor, task_env):
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj", "v_proj", "up_proj"])
    model = get_peft_model(actor, dataclasses.replace(lora, init_lora_weights=False))
    ids, mask = _prompts(task_env)
    tok, stops = task_env.tokenizer, (task_env.tokenizer.eos_token_id,)
    with merged_adapters(model) as merged:
        engine.load_weights(merged)
        engine.check_sync(merged, ids, mask, _greedy(), tok, stops)
    with model.disable_adapter(), pytest.raises(SyncError):  # the base alone differs
        engine.check_sync(model, ids, mask, _greedy(), tok, stops)


def test_sampler_logprobs_equal_the_trainers_logprobs(engine, actor, task_env):
    from rlhf_dist.config import GenerationConfig

    engine.load_weights(actor)
    ids, mask = _prompts(task_env)
    gen = GenerationConfig(max_new_tokens=16, temperature=0.7)
    stops = (task_env.tokenizer.eos_token_id,)
    torch.manual_seed(0)
    response, sampler = engine.generate(ids, mask, gen, stops, task_env.tokenizer.pad_token_id)
    response, response_mask, _ = truncate_after_eos(
        response, stops, task_env.tokenizer.pad_token_id
    )
    full = torch.cat([ids, response], 1)
    attention = torch.cat([mask, response_mask.long()], 1)
    ours, _ = token_logprobs(actor, full, attention, response_mask, gen.temperature)
    gap = (ours - sampler)[response_mask]
    assert gap.abs().max() < 1e-4, gap.abs().max()


def test_stop_ids_and_min_new_tokens_mean_what_they_mean_in_the_hf_backend(engine, actor, task_env):
    tok = task_env.tokenizer
    engine.load_weights(actor)
    ids, mask = _prompts(task_env)
    free, _ = engine.generate(ids, mask, _greedy(), (), tok.pad_token_id)  # no stop at all
    assert free.shape[1] == 12
    # Stop on two tokens row 0 produces greedily: the response ends at the first of them.
    stops = (int(free[0, 3]), int(free[0, 6]))
    first = min(i for i in range(12) if int(free[0, i]) in stops)
    for min_new in (0, 5):
        gen = _greedy(min_new_tokens=min_new)
        vllm_ids, _ = engine.generate(ids, mask, gen, stops, tok.pad_token_id)
        hf_ids = generate(actor, ids, mask, gen, tok, None, stops)
        v, v_mask, v_done = truncate_after_eos(vllm_ids, stops, tok.pad_token_id)
        h, h_mask, h_done = truncate_after_eos(hf_ids, stops, tok.pad_token_id)
        assert torch.equal(v_mask.sum(1), h_mask.sum(1)) and torch.equal(v_done, h_done)
        assert torch.equal(v[v_mask], h[h_mask])
        if min_new == 0:
            assert int(v_mask[0].sum()) == first + 1  # the stop token is the last one kept
        assert ((v_mask.sum(1) > min_new) | ~v_done).all()  # no stop before min_new_tokens


@pytest.mark.parametrize("one_step", [False, True], ids=["separate_pass", "one_step"])
def test_ppo_on_vllm_rollouts_end_to_end(task_env, runtime, tmp_path, one_step):
    # one_step: one optimizer step per rollout with the KL in the loss, so the old
    # log-probs that the rollout correction and the sampler gap compare with vLLM's come from the update's
    # forward (config/sizes.py::old_logprobs_from_update), not from a scoring pass.
    from rlhf_dist.trainers.ppo import train_ppo

    out = tmp_path / "ppo_vllm"
    tree = {
        "run": {"output_dir": str(out), "seed": 0, "log_every": 1},
        "model": {"policy": str(task_env.policy)},
        "data": {"train": str(task_env.files.prompts), "max_prompt_length": 16},
        "generation": {"max_new_tokens": 12, "backend": "vllm", "vllm_kv_cache_gib": 0.25},
        "reward": {"function": "rlhf_dist.demo.task:positive_word_reward"},
        "debug": {"check_vllm_sync": True},
        "ppo": {
            "iterations": 2,
            "estimator": "grpo",  # groups: the n copies of a prompt need distinct samples
            "rollout_batch_size": 4,
            "samples_per_prompt": 4,
            "rollout_micro_batch_size": 16,
            "ppo_epochs": 2,
            "minibatch_size": 8,
            "micro_batch_size": 8,
            "optim": {"lr": 1e-3},
            "tis_cap": 2.0,
        },
    }
    if one_step:
        tree["ppo"] |= {"ppo_epochs": 1, "minibatch_size": 16, "kl_placement": "loss"}
    tree["run"]["checkpoint_every"] = 1
    train_ppo(config_from_dict(tree), runtime)
    rows = _metrics(out)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["rollout/sampler_logprob_absdiff"] < 1e-4  # fp32: the same distribution
        assert abs(r["rollout/sampler_kl"]) < 1e-6
        assert r["rollout/corrected_frac"] == 0.0
        assert r["objective/score_std"] > 0  # the 4 samples of a prompt are not one sample
    assert (out / "final" / "model.safetensors").exists()
    # Resume (a new engine, synced from the checkpoint's weights) and continue.
    tree["run"]["resume"] = "auto"
    tree["ppo"]["iterations"] = 3
    train_ppo(config_from_dict(tree), runtime)
    rows = _metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[2]["rollout/sampler_logprob_absdiff"] < 1e-4


def _metrics(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_a_model_vllm_cannot_serve_is_a_one_line_config_error(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    from rlhf_dist.config import ConfigError

    cfg = LlamaConfig(
        vocab_size=64, hidden_size=64, num_attention_heads=4, num_key_value_heads=4,
        intermediate_size=128, num_hidden_layers=1, max_position_embeddings=64,
    )  # fmt: skip
    LlamaForCausalLM(cfg).save_pretrained(tmp_path / "m16")  # heads of 16: CPU vLLM's are >= 32
    run = config_from_dict({"model": {"policy": str(tmp_path / "m16")}})
    with pytest.raises(ConfigError) as err:
        VLLMEngine(run, torch.device("cpu"))
    message = str(err.value)
    assert message.startswith("generation.backend=vllm: vLLM cannot serve model.policy=")
    assert "\n" not in message and "16" in message
