"""Routing replay of a mixture-of-experts actor (rlhf_dist/models/routing.py, ppo.routing_replay,
docs/moe.md "Routing replay") on a tiny Qwen3-MoE built from its config:

- replaying a recorded routing gives the recorded forward's logits bit for bit, and forcing
  other experts changes them; the replayed weights are the router's own for its own top-k;
- the metrics' hand cases (expert load, flip rate, router entropy);
- GRPO with r2 and r3 (the decode loop) trains the experts and the routers, logs the router
  metrics, and r3's flip rate is 0 where the trainer replays its own sampler's routing;
- a dense policy with r2 is one line naming the key;
- an r3 run killed half-way through an iteration resumes to the same metrics, bit for bit.
"""

from __future__ import annotations

import pytest
import torch
from faults import Killed, kill_at, untimed

from rlhf_dist.config import config_from_dict
from rlhf_dist.distributed import seed_everything
from rlhf_dist.errors import ConfigError
from rlhf_dist.models import routing
from rlhf_dist.trainers import ppo
from rlhf_dist.trainers.ppo import update as ppo_update

POSITIVE_REWARD = "rlhf_dist.demo.task:positive_word_reward"
E, K, LAYERS = 8, 2, 2


def tiny_moe(vocab: int, tokenizer=None):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
        num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        num_experts=E, num_experts_per_tok=K, max_position_embeddings=128,
        tie_word_embeddings=True,
        **({} if tokenizer is None else {
            "pad_token_id": tokenizer.pad_token_id, "eos_token_id": tokenizer.eos_token_id,
            "bos_token_id": tokenizer.bos_token_id,
        }),
    )  # fmt: skip
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(config).eval()
    with torch.no_grad():  # routers drawn wide enough that tokens spread over the experts
        for r in routing.routers(model):
            r.weight.normal_(0, 1.0)
    return model


@pytest.fixture(scope="module")
def moe_policy(task_env, tmp_path_factory):
    path = tmp_path_factory.mktemp("moe") / "policy"
    model = tiny_moe(len(task_env.tokenizer), task_env.tokenizer)
    model.save_pretrained(str(path), safe_serialization=True)
    task_env.tokenizer.save_pretrained(str(path))
    return path


def test_replay_of_a_recording_is_bitwise_and_other_experts_change_the_logits():
    model = tiny_moe(64)
    ids = torch.randint(0, 64, (3, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), routing.recording().on(model) as rec:
        recorded_logits = model(ids).logits
    used = rec.recorded(3)
    assert used.shape == (3, 7, LAYERS, K) and used.min() >= 0 and used.max() < E
    with torch.no_grad(), routing.replaying([used]).on(model) as rep:
        assert torch.equal(model(ids).logits, recorded_logits)
    assert torch.equal(rep.router_choice(3), used)  # nothing flipped
    other = (used + 1) % E  # every token's experts moved by one: a different top-k set
    with torch.no_grad(), routing.replaying([other]).on(model):
        moved = model(ids).logits
    assert (moved - recorded_logits).abs().max() > 1e-4
    partial = used.clone()
    partial[:, -1] = -1  # unrecorded: the router's own choice, so the same logits
    with torch.no_grad(), routing.replaying([partial]).on(model):
        assert torch.equal(model(ids).logits, recorded_logits)


def other_family(family: str):
    """A tiny Mixtral, OLMoE or gpt-oss (routers hooked as Qwen3-MoE's are)."""
    import transformers

    shape = dict(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, num_experts_per_tok=K,
                 max_position_embeddings=64)  # fmt: skip
    if family == "mixtral":
        config = transformers.MixtralConfig(num_local_experts=E, **shape)
        cls = transformers.MixtralForCausalLM
    elif family == "gpt_oss":  # softmax over the top-k logits alone (WeightRule.over_topk)
        config = transformers.GptOssConfig(num_local_experts=E, head_dim=8, **shape)
        cls = transformers.GptOssForCausalLM
    else:
        config = transformers.OlmoeConfig(num_experts=E, **shape)
        cls = transformers.OlmoeForCausalLM
    torch.manual_seed(0)
    model = cls(config).eval()
    with torch.no_grad():
        for r in routing.routers(model):
            r.weight.normal_(0, 1.0)
    return model


@pytest.mark.parametrize("family", ["mixtral", "olmoe", "gpt_oss"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_other_families_replay_bitwise_through_the_same_hooks(family, dtype):
    """In bf16 too: each family's weights come back in its own dtype (WeightRule.cast)."""
    model = other_family(family).to(dtype)
    assert routing.routing_shape(model) == (2, K) and routing.experts_of(model) == E
    ids = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(2))
    with torch.no_grad(), routing.recording().on(model) as rec:
        logits = model(ids).logits
    used = rec.recorded(2)
    with torch.no_grad(), routing.replaying([used]).on(model):
        assert torch.equal(model(ids).logits, logits)
    with torch.no_grad(), routing.replaying([(used + 1) % E]).on(model):
        assert not torch.equal(model(ids).logits, logits)


def test_forced_weights_hand_case_and_own_topk_is_the_routers_output():
    router = routing.routers(tiny_moe(64))[0]
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0, 0.0, 0.0, 0.0, 0.0]])
    probs = torch.softmax(logits, -1)[0]
    w = routing.forced_weights(router, logits, torch.tensor([[1, 3]]))
    # norm_topk_prob (Qwen3-MoE default False): the softmax probabilities themselves
    expected = torch.stack([probs[1], probs[3]])
    if router.norm_topk_prob:
        expected = expected / expected.sum()
    assert torch.allclose(w[0], expected)
    hidden = torch.randn(5, 32)
    own_logits, own_weights, own_index = router(hidden)
    assert torch.equal(routing.forced_weights(router, own_logits, own_index), own_weights)


def test_metric_hand_cases():
    a = torch.tensor([[[[0, 1]], [[2, 3]], [[1, 0]]]])  # (B=1, S=3, L=1, k=2)
    b = torch.tensor([[[[1, 0]], [[2, 1]], [[-1, 0]]]])
    mask = torch.tensor([[True, True, True]])
    # token 0: same set in another order; token 1 flipped; token 2 unrecorded in b
    assert routing.flip_rate(a, b, mask).tolist() == [0.5]
    load = routing.expert_load(a, mask, 4)  # slots: 0,1,2,3,1,0 -> 2/6, 2/6, 1/6, 1/6
    assert torch.allclose(load, torch.tensor([[2, 2, 1, 1]], dtype=torch.float64) / 6)
    uniform = routing.router_entropy(torch.zeros(2, 4))
    assert torch.allclose(uniform, torch.full((2,), torch.log(torch.tensor(4.0))))


def tree_for(out, policy, data, mode: str, **run) -> dict:
    return {
        "run": {"output_dir": str(out), "seed": 0, "log_every": 1, "checkpoint_every": 1} | run,
        "model": {"policy": str(policy)},
        "data": data,
        "generation": {"max_new_tokens": 10, "temperature": 1.0},
        "reward": {"function": POSITIVE_REWARD},
        "ppo": {
            "iterations": 2, "rollout_batch_size": 4, "samples_per_prompt": 2,
            "rollout_micro_batch_size": 8, "ppo_epochs": 2, "minibatch_size": 8,
            "micro_batch_size": 4, "optim": {"lr": 1e-2}, "kl_coef": 0.0,
            "estimator": "grpo", "routing_replay": mode,
        },
    }  # fmt: skip


def run_ppo(tree: dict, runtime):
    seed_everything(tree["run"]["seed"])
    return ppo.train_ppo(config_from_dict(tree), runtime)


@pytest.fixture(scope="module")
def unbroken(moe_policy, task_env, runtime, tmp_path_factory, data_cfg):
    """mode -> (output directory, the routing each update forward was made to replay) of
    one whole GRPO run per mode, shared by the training and the resume tests."""
    runs = {}
    for mode in ("r2", "r3"):
        out, forced = tmp_path_factory.mktemp(mode), []

        def spy(routings, *args, forced=forced):
            forced.append(routings[0])
            return routing.replaying(routings, *args)

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(ppo_update, "replaying", spy)
            run_ppo(tree_for(out, moe_policy, data_cfg(train=str(task_env.files.prompts)), mode),
                    runtime)  # fmt: skip
        runs[mode] = (out, forced)
    return runs


@pytest.mark.parametrize("mode", ["r2", "r3"])
def test_grpo_with_routing_replay_trains_the_experts_and_logs_router_metrics(
    mode, unbroken, moe_policy, read_jsonl, saved_state_dict
):
    out, forced = unbroken[mode]
    # 2 iterations x 2 epochs x 2 micro-batches of 4 rows, each over its trimmed P + T
    assert len(forced) == 8
    assert all(f.shape[0] == 4 and f.shape[2:] == (LAYERS, K) for f in forced)
    assert all(((f >= 0) & (f < E)).all() for f in forced)  # every token's experts recorded
    rows = read_jsonl(out / "metrics.jsonl")
    assert len(rows) == 2
    for layer in range(LAYERS):
        row = rows[-1]
        assert 1 / E - 1e-9 <= row[f"router/load_max/layer_{layer}"] <= 1
        assert 0 <= row[f"router/load_min/layer_{layer}"] <= 1 / E + 1e-9
        assert 0 < row[f"router/entropy/layer_{layer}"] <= float(torch.log(torch.tensor(E)))
        if mode == "r3":  # the decode loop is the trainer's own forward: it routes alike
            assert row[f"router/flip_rate/layer_{layer}"] <= 0.05
    # the second epoch's routers moved (lr 1e-2) and the replay held the recorded experts
    assert 0 < rows[0]["router/update_flip_rate"] < 1
    before = saved_state_dict(moe_policy)
    after = saved_state_dict(out / "final")
    for name in ("mlp.experts.gate_up_proj", "mlp.gate.weight"):
        key = f"model.layers.0.{name}"
        assert not torch.equal(before[key], after[key]), f"{key} did not train"


def test_a_dense_policy_with_routing_replay_is_one_line_naming_the_key(
    task_env, runtime, tmp_path, data_cfg
):
    tree = tree_for(tmp_path, task_env.policy, data_cfg(train=str(task_env.files.prompts)), "r2")
    with pytest.raises(ConfigError, match=r"^ppo.routing_replay=r2: needs a mixture-of-experts"):
        run_ppo(tree, runtime)


@pytest.mark.parametrize("mode", ["r2", "r3"])
def test_killed_mid_update_resumes_to_the_same_metrics(
    mode, unbroken, moe_policy, task_env, runtime, tmp_path, data_cfg, read_jsonl, monkeypatch
):
    """Checkpoints fall between iterations, and a rollout (its routing with it) never
    outlives one: the resumed run samples, records and replays iteration 2 again."""
    data = data_cfg(train=str(task_env.files.prompts))
    expected = untimed(read_jsonl(unbroken[mode][0] / "metrics.jsonl"))
    out = tmp_path / "killed"
    with monkeypatch.context() as mp:
        kill_at(mp, ppo_update, "update", 2)  # iteration 1 checkpointed, 2 lost mid-update
        with pytest.raises(Killed):
            run_ppo(tree_for(out, moe_policy, data, mode), runtime)
    run_ppo(tree_for(out, moe_policy, data, mode, resume="auto"), runtime)
    assert untimed(read_jsonl(out / "metrics.jsonl")) == expected


TOKEN, ENV = "routing-token-51", "RLHF_DIST_TEST_ROUTING_TOKEN"


def test_r3_through_a_rollout_server_replays_the_served_routing_in_the_trainers_layout(
    moe_policy, task_env, runtime, tmp_path, data_cfg, read_jsonl, monkeypatch
):
    """The server returns each row's routing of its real prompt tokens and response; the
    client lays it out left-padded as the trainer's forward sees the tokens. Served in fp32
    by the same decode loop, the trainer's own top-k agrees with the served one almost
    everywhere and the replayed log-probs equal the served ones to rounding: a layout off
    by one token would flip most tokens' experts."""
    from serve_process import served

    tree = {"model": {"policy": str(moe_policy)}, "perf": {"num_threads": 1},
            "distributed": {"timeout_s": 60}}  # fmt: skip
    with served(tree, ENV, TOKEN) as url:
        monkeypatch.setenv(ENV, TOKEN)
        run = tree_for(tmp_path, moe_policy, data_cfg(train=str(task_env.files.prompts)), "r3")
        run["generation"] |= {"backend": "server", "server_urls": [url], "server_token_env": ENV}
        run["ppo"]["iterations"] = 1
        run_ppo(run, runtime)
    (row,) = read_jsonl(tmp_path / "metrics.jsonl")
    assert row["router/flip_rate"] <= 0.02
    assert row["router/logprob_gap_replayed"] < 1e-4
    assert row["router/logprob_gap_unreplayed"] < 1e-3


def test_metric_properties_on_random_routings():
    gen = torch.Generator().manual_seed(3)
    router = routing.routers(tiny_moe(64))[0]
    for _ in range(20):
        B, S, L, k = 3, 5, 2, 2
        a = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(B * S * L)])
        a = a.reshape(B, S, L, k)
        mask = torch.rand(B, S, generator=gen) > 0.3
        swapped = a.flip(-1)  # the same expert sets in another order
        assert routing.flip_rate(a, swapped, mask).eq(0).all()
        assert torch.equal(
            routing.flip_rate(a, (a + 1) % E, mask), routing.flip_rate((a + 1) % E, a, mask)
        )
        load = routing.expert_load(a, mask, E)
        assert torch.equal(load, routing.expert_load(swapped, mask, E))
        if mask.any():
            assert torch.allclose(load.sum(1), torch.ones(L, dtype=torch.float64))
        logits = torch.randn(7, E, generator=gen) * 3
        h = routing.router_entropy(logits)
        assert (h >= 0).all() and (h <= torch.log(torch.tensor(float(E))) + 1e-6).all()
        idx = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(7)])
        w = routing.forced_weights(router, logits, idx)
        probs = torch.softmax(logits, -1).gather(-1, idx)
        expected = probs / probs.sum(-1, keepdim=True) if router.norm_topk_prob else probs
        assert torch.allclose(w, expected) and (w > 0).all()
