"""Unit tests of the offline-preference inputs: KTO examples (unpaired rows, or derived from
preference pairs and ranked lists; text or conversational) with their mismatched
completions, and the dpo / kto config checks. The tokenizers are the demo's word-level ones
(one token per word): the plain one, and the "chatml" one with its chat template."""

import pytest
from chat_tokenizers import build_chat_tokenizer

from rlhf_dist.config import ConfigError, DataConfig, KTOConfig, load_config, validate
from rlhf_dist.data.rows import kto_examples, preference_pairs
from rlhf_dist.demo.task import build_tokenizer

DATA = DataConfig(max_prompt_length=8, max_length=16)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("tok"))


def words(tok, ids: list[int]) -> str:
    return tok.decode(ids, skip_special_tokens=True)


def test_preference_pairs_record_the_prompt_length(tok):
    rows = [{"prompt": "review of the food :", "chosen": "great", "rejected": "awful"}]
    pair = preference_pairs(rows, tok, DATA)[0][0]
    assert pair.prompt_len == 5
    assert words(tok, pair.chosen[pair.prompt_len :]) == "great"


def test_kto_unpaired_rows_are_read_with_their_labels_and_bad_ones_counted(tok):
    rows = [
        {"prompt": "review of the food :", "completion": "great", "label": True},
        {"prompt": "review of the movie :", "completion": "awful", "label": False},
        {"prompt": "review of the movie :", "completion": "awful", "label": "yes"},  # not bool
        {"prompt": "review of the movie :", "completion": "", "label": True},  # empty
    ]
    examples, report = kto_examples(rows, tok, DATA, KTOConfig())
    assert [(words(tok, e.completion), e.desirable) for e in examples] == [
        ("great", True),
        ("awful", False),
    ]
    assert examples[0].completion[-1] == tok.eos_token_id
    assert report.kept == 2 and sum(report.skipped.values()) == 2
    assert report.skipped["'label' not true/false"] == 1


def test_kto_from_pairs_and_ranked_lists(tok):
    rows = [
        {"prompt": "review of the food :", "chosen": "great", "rejected": "awful"},
        # Ranked best first: the top one is desirable, the bottom one undesirable, the middle
        # one was preferred AND dispreferred, so it is neither.
        {"prompt": "review of the movie :", "responses": ["great", "lovely", "awful"]},
    ]
    examples, _ = kto_examples(rows, tok, DATA, KTOConfig())
    got = [(words(tok, e.prompt), words(tok, e.completion), e.desirable) for e in examples]
    assert got == [
        ("review of the food :", "great", True),
        ("review of the food :", "awful", False),
        ("review of the movie :", "great", True),
        ("review of the movie :", "awful", False),
    ]


def test_kto_mismatched_completion_comes_from_another_prompt(tok):
    rows = [
        {"prompt": f"review of the {noun} :", "chosen": "great", "rejected": f"awful {noun}"}
        for noun in ("food", "movie", "hotel")
    ]
    examples, _ = kto_examples(rows, tok, DATA, KTOConfig())
    assert len(examples) == 6
    for i, ex in enumerate(examples):
        owner = next(o for o in examples if o.completion is ex.kl_completion)
        assert owner.prompt != ex.prompt, i
    # The chosen of a row skips its own row's rejected (same prompt) for the next row's chosen.
    assert examples[0].kl_completion == examples[2].completion


@pytest.fixture(scope="module")
def chat_tok(tmp_path_factory):
    return build_chat_tokenizer(tmp_path_factory.mktemp("chat_tok"), "chatml")


def user(text):
    return {"role": "user", "content": text}


def assistant(text):
    return {"role": "assistant", "content": text}


def chatml_words(tok, ids: list[int]) -> str:
    """Ids back to their tokens, special ones included (one token per word)."""
    return " ".join(tok.convert_ids_to_tokens(ids))


CHAT_DATA = DataConfig(max_prompt_length=16, max_length=24)


def test_kto_unpaired_conversational_rows(chat_tok):
    """TRL's unpaired format with message lists: the prompt rendered with the generation
    prompt, the completion its assistant turn up to the end-of-turn token; bad rows are
    counted under the reasons the other loaders use."""
    food, movie = [user("review of the food :")], [user("review of the movie :")]
    rows = [
        {"prompt": food, "completion": [assistant("great")], "label": True},
        {"prompt": movie, "completion": [assistant("awful")], "label": False},
        {"prompt": movie, "completion": [assistant("awful")], "label": "no"},
        {"prompt": movie, "completion": [user("awful")], "label": True},
        {"prompt": [assistant("hi")], "completion": [assistant("awful")], "label": True},
        {"prompt": "review of the food :", "completion": "great", "label": True},
        {"prompt": movie, "completion": [assistant("great " * 20)], "label": True},
    ]
    examples, report = kto_examples(rows, chat_tok, CHAT_DATA, KTOConfig())
    got = [
        (chatml_words(chat_tok, e.prompt), chatml_words(chat_tok, e.completion)) for e in examples
    ]
    assert got == [
        ("<|im_start|> user review of the food : <|im_end|> <|im_start|> assistant",
         "great <|im_end|>"),
        ("<|im_start|> user review of the movie : <|im_end|> <|im_start|> assistant",
         "awful <|im_end|>"),
    ]  # fmt: skip
    assert [e.desirable for e in examples] == [True, False]
    assert examples[0].kl_completion == examples[1].completion
    assert report.kept == 2 and dict(report.skipped) == {
        "'label' not true/false": 1,
        "'completion' holds turns other than the assistant's": 1,
        "last turn of 'prompt' not from the user": 1,
        "'prompt' not a list of messages": 1,
        "longer than data.max_length": 1,
    }


def test_kto_from_conversational_pairs_matches_the_pair_loader(chat_tok):
    """Implicit-prompt chosen/rejected message lists: chosen desirable, rejected
    undesirable, each exactly the sequence the reward model / DPO loader builds."""
    turn = [user("review of the food :")]
    rows = [
        {"chosen": turn + [assistant("great")], "rejected": turn + [assistant("awful")]},
        {"chosen": turn + [assistant("great")], "rejected": [user("x"), assistant("awful")]},
    ]
    examples, report = kto_examples(rows, chat_tok, CHAT_DATA, KTOConfig())
    pairs, _ = preference_pairs(rows, chat_tok, CHAT_DATA)
    assert [e.desirable for e in examples] == [True, False] and len(pairs) == 1
    assert examples[0].prompt + examples[0].completion == pairs[0].chosen
    assert examples[1].prompt + examples[1].completion == pairs[0].rejected
    assert len(examples[0].prompt) == pairs[0].prompt_len
    assert dict(report.skipped) == {"chosen and rejected have different prompts": 1}


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (["dpo.label_smoothing=0.5"], "dpo.label_smoothing"),
        (["dpo.loss_type=ipo", "dpo.label_smoothing=0.1"], "dpo.label_smoothing"),
        (["dpo.beta=0"], "dpo.beta"),
        (["dpo.loss_type=hinge"], "dpo.loss_type"),
        (["dpo.loss_type=orpo", "dpo.label_smoothing=0.1"], "dpo.label_smoothing"),
        (["dpo.simpo_gamma=1.0"], "dpo.simpo_gamma"),
        (["dpo.loss_type=orpo", "dpo.simpo_gamma=0"], "dpo.simpo_gamma"),
        (["dpo.loss_type=simpo", "dpo.simpo_gamma=-0.5"], "dpo.simpo_gamma"),
        (["dpo.loss_type=simpo", "dpo.orpo_prompt_nll=false"], "dpo.orpo_prompt_nll"),
        (["dpo.loss_type=orpo", "dpo.reference_logprobs=online"], "dpo.reference_logprobs"),
        (["dpo.reference_logprobs=never"], "dpo.reference_logprobs"),
        (["kto.desirable_weight=-1"], "kto.desirable_weight"),
        (["kto.beta=-0.1"], "kto.beta"),
    ],
)
def test_bad_dpo_and_kto_settings_name_the_key(overrides, needle):
    stage = needle.split(".")[0]
    with pytest.raises(ConfigError) as info:
        validate(
            load_config(overrides=["model.policy=/p", "data.train=/d.jsonl", *overrides]), stage
        )
    assert needle in str(info.value) and "\n" not in str(info.value)


def test_dpo_and_kto_need_a_policy_and_accept_their_defaults():
    for stage in ("dpo", "kto"):
        validate(load_config(overrides=["model.policy=/p", "data.train=/d.jsonl"]), stage)
        with pytest.raises(ConfigError, match="model.policy"):
            validate(load_config(overrides=["data.train=/d.jsonl"]), stage)
    cfg = load_config(
        overrides=[
            "model.policy=/p",
            "data.train=/d.jsonl",
            "dpo.batch_size=24",
            "dpo.micro_batch_size=32",
        ]
    )
    with pytest.raises(ConfigError, match="dpo.batch_size"):
        validate(cfg, "dpo", world_size=1)  # 24 is not a multiple of micro 32 x 1
    cfg = load_config(overrides=["model.policy=/p", "data.train=/d.jsonl", "dpo.batch_size=24"])
    validate(cfg, "dpo", world_size=8)  # micro-batches of the auto size: 3 pairs per rank
    with pytest.raises(ConfigError, match="world size=16 must divide dpo.batch_size=24"):
        validate(cfg, "dpo", world_size=16)


def test_the_example_dpo_config_validates_on_eight_ranks():
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "launch" / "configs" / "dpo_zero3.yaml"
    cfg = load_config(path)
    validate(cfg, "dpo", world_size=8)  # 64 pairs = 2 per rank x 8 ranks x 4 accumulations
    assert cfg.dpo.reference_logprobs == "precompute" and cfg.model.dtype == "bfloat16"


@pytest.mark.parametrize(
    "overrides",
    [
        ["dpo.loss_type=simpo", "dpo.beta=2.5", "dpo.simpo_gamma=1.4", "dpo.label_smoothing=0.1"],
        ["dpo.loss_type=orpo", "dpo.orpo_prompt_nll=false", "dpo.beta=0.2"],
        ["dpo.loss_type=simpo", "dpo.orpo_prompt_nll=true", "dpo.simpo_gamma=0.5"],  # defaults
    ],
)
def test_reference_free_losses_accept_their_own_keys(overrides):
    base = ["model.policy=/p", "data.train=/d.jsonl"]
    validate(load_config(overrides=base + overrides), "dpo")
