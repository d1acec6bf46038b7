"""Rollout against plain transformers: what PPO samples and the numbers it attaches to them.

PPO's importance ratios and KL penalty are only right if (a) responses are sampled from the
same distribution whose log-probs it computes, and (b) log-probs, values and scores computed
on left-padded batches equal those of each sequence on its own, as a user would compute them.
"""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from rlhf_dist.config import config_from_dict
from rlhf_dist.engine.decode import generate
from rlhf_dist.models import load_causal_lm
from rlhf_dist.trainers.ppo import recipe as ppo
from rlhf_dist.trainers.ppo import rollout as ppo_rollout


def test_sampling_with_top_k_0_draws_from_the_full_distribution(task_env):
    tok = task_env.tokenizer
    # The random-init policy is close to uniform over the whole vocabulary (~100 words),
    # so a top-50 truncation removes about half of the tokens it should sample.
    policy = load_causal_lm(str(task_env.policy), "model.policy")
    gen = config_from_dict({"generation": {"temperature": 1.0, "max_new_tokens": 1}}).generation
    assert gen.top_k == 0 and gen.top_p == 1.0  # the defaults: no truncation asked for
    n = 2000
    prompt = torch.tensor([tok("review of the hotel :")["input_ids"]])
    with torch.no_grad():
        probs = torch.softmax(policy(input_ids=prompt).logits[0, -1].float(), -1)
    torch.manual_seed(0)
    first = generate(policy, prompt.repeat(n, 1), torch.ones(n, prompt.shape[1]), gen, tok)[:, 0]
    counts = torch.bincount(first, minlength=probs.numel())
    # A token expected >= 10 times in n draws is absent with probability < e^-10.
    common = probs * n >= 10
    assert int(common.sum()) > 60, "precondition: the policy spreads over many tokens"
    never_drawn = (common & (counts == 0)).nonzero().flatten().tolist()
    assert never_drawn == [], f"{len(never_drawn)} likely tokens never sampled"


def test_rollout_logprobs_values_and_scores_match_each_sequence_alone(
    sft_run, rm_run, task_env, runtime, tmp_path, monkeypatch, data_cfg
):
    rollouts = []
    collect = ppo_rollout.collect_rollout

    def keep_batch(*args, **kwargs):
        batch, texts = collect(*args, **kwargs)
        rollouts.append(batch)
        return batch, texts

    monkeypatch.setattr(ppo_rollout, "collect_rollout", keep_batch)
    policy, reward = sft_run.out / "final", rm_run.out / "final"
    tree = {
        "run": {"output_dir": str(tmp_path / "ppo"), "seed": 0},
        "model": {"policy": str(policy), "reward": str(reward)},
        "data": data_cfg(train=str(task_env.files.prompts)),
        "generation": {"max_new_tokens": 24, "temperature": 0.7},
        "ppo": {
            "iterations": 1,
            "rollout_batch_size": 16,
            "rollout_micro_batch_size": 16,
            "ppo_epochs": 1,
            "minibatch_size": 16,
            "micro_batch_size": 16,
        },
    }
    ppo.train_ppo(config_from_dict(tree), runtime)
    (batch,) = rollouts  # iteration 1: actor = reference = SFT policy, critic = RM

    # The batch exercises left padding (prompts of different lengths) and ragged responses.
    assert (batch.prompt_mask == 0).any() and len(set(batch.response_mask.sum(1).tolist())) > 2
    lm = AutoModelForCausalLM.from_pretrained(policy).eval()
    rm = AutoModelForSequenceClassification.from_pretrained(reward, num_labels=1).eval()
    for b in range(batch.prompt_ids.shape[0]):
        prompt = batch.prompt_ids[b][batch.prompt_mask[b].bool()]
        response = batch.response_ids[b][batch.response_mask[b]]
        seq = torch.cat([prompt, response]).unsqueeze(0)
        P, T = prompt.numel(), response.numel()
        with torch.no_grad():
            logp = torch.log_softmax(lm(input_ids=seq).logits[0].float() / 0.7, -1)
            per_token = rm.score(rm.model(input_ids=seq).last_hidden_state)[0, :, 0]
            score = rm(input_ids=seq).logits[0, 0]
        # Position P-1+t predicts response token t and holds the value of its prefix.
        expected_lp = logp[P - 1 : P - 1 + T].gather(1, response.unsqueeze(1)).squeeze(1)
        close = dict(atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(batch.old_logprobs[b, :T], expected_lp, **close)
        torch.testing.assert_close(batch.ref_logprobs[b, :T], expected_lp, **close)
        torch.testing.assert_close(batch.old_values[b, :T], per_token[P - 1 : P - 1 + T], **close)
        # The reward model's score is read at the last real token (EOS when finished).
        torch.testing.assert_close(batch.raw_scores[b], score, **close)


# -------------------------------------------------------------- the KV-cache decode loop


def _left_padded_prompts(tok, texts):
    rows = [tok(t)["input_ids"] for t in texts]
    width = max(len(r) for r in rows)
    ids = torch.tensor([[tok.pad_token_id] * (width - len(r)) + r for r in rows])
    return ids, (ids != tok.pad_token_id).long()


PROMPTS = ["review of the hotel :", "the food :", "review of the film was :", "staff :"]


def test_greedy_decode_loop_matches_transformers_generate_on_left_padded_prompts(sft_run, task_env):
    # top_k=1 samples the argmax: the loop must then give transformers' greedy tokens,
    # which holds only if its KV cache, positions and padding mask are all right.
    from transformers import GenerationConfig

    tok = task_env.tokenizer
    policy = load_causal_lm(str(sft_run.out / "final"), "model.policy").eval()
    ids, mask = _left_padded_prompts(tok, PROMPTS)
    assert (mask == 0).any(), "precondition: prompts of different lengths"
    gen = config_from_dict({"generation": {"max_new_tokens": 20, "top_k": 1}}).generation
    ours = generate(policy, ids, mask, gen, tok)
    greedy = GenerationConfig(
        do_sample=False,
        max_new_tokens=20,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
    )
    with torch.no_grad():
        theirs = policy.generate(input_ids=ids, attention_mask=mask, generation_config=greedy)
    theirs = theirs[:, ids.shape[1] :]
    assert torch.equal(ours, theirs)
    # Some rows end with EOS before the limit: PAD follows it, as truncate_after_eos expects.
    finished = (ours == tok.eos_token_id).any(1)
    assert finished.any()
    for row in ours[finished]:
        first = int((row == tok.eos_token_id).nonzero()[0])
        assert (row[first + 1 :] == tok.pad_token_id).all()


def test_decode_loop_lengths_min_new_tokens_and_ranks_in_step(sft_run, task_env):
    tok = task_env.tokenizer
    policy = load_causal_lm(str(sft_run.out / "final"), "model.policy").eval()
    ids, mask = _left_padded_prompts(tok, PROMPTS * 4)

    def run(keep_in_step=None, **generation):
        gen = config_from_dict({"generation": {"top_k": 1} | generation}).generation
        return generate(policy, ids, mask, gen, tok, keep_in_step)

    early = run(max_new_tokens=48)
    assert early.shape[1] < 48, "precondition: every row of the SFT policy ends early"
    assert (early[:, -1] == tok.eos_token_id).any()  # it stops at the last row's EOS
    # In step with other ranks (ZeRO-3 without gathered weights): a finished rank keeps
    # running forwards while another rank says it needs them, and only then returns.
    asked = []

    def other_rank_runs_10_more(mine: bool) -> bool:
        asked.append(mine)
        return mine or len(asked) <= early.shape[1] + 10

    in_step = run(other_rank_runs_10_more, max_new_tokens=48)
    assert torch.equal(in_step, early)  # the throw-away forwards change nothing
    assert asked == [True] * (early.shape[1] - 1) + [False] * 12
    # min_new_tokens holds EOS back: exactly max_new_tokens tokens and no EOS at all.
    held = run(max_new_tokens=12, min_new_tokens=12)
    assert held.shape == (ids.shape[0], 12) and not (held == tok.eos_token_id).any()
    # EOS allowed from token 3 on: none before it.
    some = run(max_new_tokens=48, min_new_tokens=3)
    assert not (some[:, :3] == tok.eos_token_id).any()


class _LogitsRecorder(torch.nn.Module):
    """Calls the policy and keeps the last-position logits of every forward (B, V)."""

    def __init__(self, policy):
        super().__init__()
        self.policy, self.steps = policy, []

    def forward(self, **kwargs):
        out = self.policy(**kwargs)
        self.steps.append(out.logits[:, -1].float())
        return out


def test_decode_loop_logits_equal_each_sequence_alone(sft_run, task_env):
    # Every step's logits from the cached, left-padded batch must be those of a plain
    # forward over that row's own prompt + response so far: the distribution sampled from
    # is the one PPO's log-probs describe.
    tok = task_env.tokenizer
    policy = load_causal_lm(str(sft_run.out / "final"), "model.policy").eval()
    ids, mask = _left_padded_prompts(tok, PROMPTS)
    recorder = _LogitsRecorder(policy)
    gen = config_from_dict({"generation": {"max_new_tokens": 16, "temperature": 1.0}}).generation
    torch.manual_seed(0)
    response = generate(recorder, ids, mask, gen, tok)
    steps = torch.stack(recorder.steps[: response.shape[1]], dim=1)  # (B, T, V)
    for b in range(ids.shape[0]):
        prompt = ids[b][mask[b].bool()]
        alive = response.shape[1]
        if (response[b] == tok.eos_token_id).any():
            alive = int((response[b] == tok.eos_token_id).nonzero()[0]) + 1
        seq = torch.cat([prompt, response[b, :alive]]).unsqueeze(0)
        with torch.no_grad():
            alone = policy(input_ids=seq).logits[0].float()
        P = prompt.numel()
        torch.testing.assert_close(
            steps[b, :alive], alone[P - 1 : P - 1 + alive], atol=1e-4, rtol=1e-4
        )


def test_attn_implementation_reaches_every_loaded_model(task_env):
    from rlhf_dist.models import load_sequence_classifier

    for attn in ("eager", "sdpa"):
        source = config_from_dict({"model": {"attn_implementation": attn}}).model
        policy = load_causal_lm(str(task_env.policy), "model.policy", source=source)
        reward = load_sequence_classifier(str(task_env.reward), "model.reward", source=source)
        assert policy.config._attn_implementation == attn
        assert reward.config._attn_implementation == attn
