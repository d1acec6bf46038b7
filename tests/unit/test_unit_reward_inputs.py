"""A reward model with its own tokenizer (rlhf_dist.scoring.RewardInputs): what it reads
for a (prompt, response text) pair, written out by hand from its template; and the rule
that a critic cannot start from such a reward model."""

import pytest
import torch
from chat_tokenizers import build_chat_tokenizer

from rlhf_dist.config import ConfigError, config_from_dict
from rlhf_dist.data.chat import Chat, prompt_text, stop_token_ids
from rlhf_dist.demo.task import build_tokenizer
from rlhf_dist.models import generation_eos_ids
from rlhf_dist.rewards.scoring import RewardFunction, RewardInputs, Scorer, same_tokenizer
from rlhf_dist.trainers.ppo.setup import check_critic_tokenizer

PROMPT = [{"role": "user", "content": "review of the food :"}]


@pytest.fixture(scope="module")
def toks(tmp_path_factory):
    root = tmp_path_factory.mktemp("toks")
    return {
        "chatml": build_chat_tokenizer(root / "chatml", "chatml"),
        "chatml_again": build_chat_tokenizer(root / "chatml2", "chatml"),
        "llama3": build_chat_tokenizer(root / "llama3", "llama3"),
        "plain": build_tokenizer(root / "plain"),
    }


def ids(tok, words: str) -> list[int]:
    vocab = tok.get_vocab()
    return [vocab[w] for w in words.split()]


def rm_inputs(tok, policy_stops=(1,)) -> RewardInputs:
    chat = Chat(tok, tok.chat_template) if tok.chat_template else None
    return RewardInputs(tok, chat, stop_token_ids(tok, chat), policy_stops)


def test_probe_response_splits_the_reward_models_own_sequence(toks):
    """The rephrasing probe's split (prompt, body, end) in the reward model's tokens: the
    body is the response's own encoding, the end what closes it; joined, the sequence
    the reward model scores."""
    rm = rm_inputs(toks["llama3"])
    split = rm.probe_response(PROMPT, "great food")
    assert split.body == ids(rm.tokenizer, "great food")
    assert split.end == ids(rm.tokenizer, "<|eot_id|>")
    assert split.ids() == rm.sequence(PROMPT, "great food", True)
    text = rm_inputs(toks["plain"]).probe_response("review of the food :", "great food")
    plain = toks["plain"]
    assert text.prompt == plain("review of the food :")["input_ids"]
    assert text.body == ids(plain, "great food") and text.end == [plain.eos_token_id]


def test_same_tokenizer(toks, tmp_path):
    assert same_tokenizer(toks["chatml"], toks["chatml_again"])
    assert not same_tokenizer(toks["chatml"], toks["llama3"])  # vocabulary and template
    assert not same_tokenizer(toks["chatml"], toks["plain"])
    # Same vocabulary, another template: still a round-trip.
    other = build_chat_tokenizer(tmp_path / "other", "chatml")
    other.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    assert not same_tokenizer(toks["chatml"], other)


def test_conversation_in_the_reward_models_own_template(toks):
    rm = rm_inputs(toks["llama3"])
    head = (
        "<|begin_of_text|> <|start_header_id|> user <|end_header_id|> review of the food : "
        "<|eot_id|> <|start_header_id|> assistant <|end_header_id|>"
    )
    # Finished: the whole conversation, closed by the template's end-of-turn token, one BOS.
    assert rm.sequence(PROMPT, "great food", True) == ids(
        rm.tokenizer, head + " great food <|eot_id|>"
    )
    # Unfinished: the prompt and the response as far as it went, not closed.
    assert rm.sequence(PROMPT, "great food", False) == ids(rm.tokenizer, head + " great food")


def test_text_prompt_as_rlhf_dist_rm_encodes_it(toks):
    rm = rm_inputs(toks["llama3"])
    bos_eos = ids(rm.tokenizer, "<|begin_of_text|> the food great <|end_of_text|>")
    assert rm.sequence("the food", "great", True) == bos_eos
    assert rm.sequence("the food", "great", False) == bos_eos[:-1]


def test_conversation_for_a_reward_model_without_template_is_one_line(toks):
    with pytest.raises(ConfigError, match=r"^model\.reward: .*no chat template"):
        rm_inputs(toks["plain"]).sequence(PROMPT, "great", True)


def test_scorer_reads_the_reward_models_own_tokens(toks):
    """Policy tokens in (ChatML), the RM's tokens out (Llama 3); finished iff the policy's
    last real token is one of its stop ids."""
    policy, rm_tok = toks["chatml"], toks["llama3"]
    eot = policy.get_vocab()["<|im_end|>"]
    rm = rm_inputs(rm_tok, policy_stops=(policy.eos_token_id, eot))
    seen = []

    class Recorder(torch.nn.Module):
        def forward(self, input_ids, attention_mask, position_ids=None):
            seen.append((input_ids.tolist(), attention_mask.tolist()))
            return input_ids.float()  # a "score" per token: the id itself

    scorer = Scorer(reward_model=Recorder(), inputs=rm)
    words = ids(policy, "great food")
    input_ids = torch.tensor([words + [eot], words + [policy.pad_token_id]])
    scores = scorer([PROMPT, PROMPT], ["great food"] * 2, input_ids, None, torch.tensor([2, 1]))
    finished = rm.sequence(PROMPT, "great food", True)
    unfinished = rm.sequence(PROMPT, "great food", False)
    pad = rm_tok.pad_token_id
    assert seen == [
        (
            [finished, unfinished + [pad]],
            [[1] * len(finished), [1] * len(unfinished) + [0]],
        )
    ]
    # Read at each sequence's last real token: the end-of-turn token, then "food".
    assert scores.tolist() == [finished[-1], unfinished[-1]]


def test_critic_from_a_reward_model_with_another_tokenizer_is_refused(toks):
    cfg = config_from_dict({"model": {"reward": "rm"}, "ppo": {"critic_init": "reward"}})
    with pytest.raises(ConfigError, match=r"^ppo\.critic_init: .*ppo\.critic_init=policy"):
        check_critic_tokenizer(cfg, rm_inputs(toks["llama3"]))
    check_critic_tokenizer(cfg, None)  # same tokenizer: allowed
    policy_cfg = config_from_dict({"ppo": {"critic_init": "policy"}})
    check_critic_tokenizer(policy_cfg, rm_inputs(toks["llama3"]))


def test_reward_function_gets_messages_and_texts(toks):
    seen = []

    def fn(prompts, responses):
        seen.append((prompts, responses))
        return [len(r.split()) for r in responses]

    import sys
    import types

    module = types.ModuleType("chat_reward_for_tests")
    module.fn = fn
    sys.modules["chat_reward_for_tests"] = module
    try:
        scores = RewardFunction("chat_reward_for_tests:fn")([PROMPT], ["great food"])
    finally:
        del sys.modules["chat_reward_for_tests"]
    assert seen == [([PROMPT], ["great food"])] and scores.tolist() == [2.0]


def test_prompt_text_for_samples():
    assert prompt_text("the food") == "the food"
    convo = PROMPT + [{"role": "assistant", "content": "great"}]
    assert prompt_text(convo) == "user: review of the food :\nassistant: great"


def test_generation_eos_ids_int_list_or_none(tmp_path):
    from transformers import GenerationConfig

    for eos, want in ((5, (5,)), ([5, 7], (5, 7)), (None, ())):
        path = tmp_path / str(want)
        GenerationConfig(eos_token_id=eos).save_pretrained(path)
        assert generation_eos_ids(str(path)) == want
    assert generation_eos_ids(str(tmp_path / "absent")) == ()
