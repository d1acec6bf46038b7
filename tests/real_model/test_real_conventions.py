"""The three tokenizer conventions users bring load unchanged, and padding is bookkeeping:
SmolLM2's real tokenizer as it ships (PAD == EOS == <|im_end|>), without a PAD (Llama-3,
Mistral) and with a distinct PAD (Qwen2.5). Masks, never PAD ids, find the end of a
response, the position a reward is read at and the tokens SFT trains on (docs/data.md,
padding). Tiny random Llamas carry the real tokenizer, so these run in seconds.
"""

from __future__ import annotations

import json

import pytest
import torch

from rlhf_dist.config import DataConfig
from rlhf_dist.data.rows import collate_sft, sft_examples
from rlhf_dist.engine.decode import decode_responses, generate, truncate_after_eos
from rlhf_dist.models import ValueModel, load_sequence_classifier, load_tokenizer

EOS = 2  # <|im_end|>: SmolLM2's EOS and its template's end-of-turn token
CONVENTIONS = ("shipped", "nopad", "distinct")


def test_every_convention_loads_and_pads_with_an_id_already_in_the_vocabulary(
    smollm2, real_tokenizers, capsys
):
    expected_pad = {"shipped": EOS, "nopad": EOS, "distinct": 0}
    for c in CONVENTIONS:
        assert real_tokenizers[c].eos_token_id == EOS
        tok = load_tokenizer(str(smollm2[c]), key="model.policy")
        assert tok.pad_token_id == expected_pad[c], c
        assert len(tok) == 49152 == len(real_tokenizers[c]), "the vocabulary never grows"
    assert real_tokenizers["nopad"].pad_token_id is None
    said = capsys.readouterr().out
    assert said.count("has no PAD token; padding with EOS") == 1, said
    load_tokenizer(str(smollm2["nopad"]), key="model.policy")
    assert "has no PAD" not in capsys.readouterr().out, "said once per tokenizer"


class _Output(dict):
    __getattr__ = dict.__getitem__


class _Scripted(torch.nn.Module):
    """Next token at decode step s is script[b][s] (one-hot logits over the real vocab)."""

    def __init__(self, script):
        super().__init__()
        self.script, self.step = script, 0

    def forward(self, input_ids, **kwargs):
        logits = torch.full((input_ids.shape[0], 1, 49152), -1e9)
        for b, row in enumerate(self.script):
            logits[b, 0, row[self.step]] = 0.0
        self.step += 1
        return _Output(logits=logits, past_key_values=None)


@pytest.mark.parametrize("convention", ["shipped", "nopad"])  # both pad with EOS
def test_eos_ended_and_truncated_responses_when_pad_is_eos(smollm2, convention):
    tok = load_tokenizer(str(smollm2[convention]))
    assert tok.pad_token_id == tok.eos_token_id == EOS
    hello, world = tok("Hello")["input_ids"][0], tok(" world")["input_ids"][0]
    # Row 0 ends with EOS after two tokens; row 1 never does (cut at max_new_tokens).
    script = [[hello, world, EOS, hello], [hello, world, hello, world]]
    gen = type("Gen", (), {"temperature": 1.0, "top_k": 0, "top_p": 1.0})()
    gen.max_new_tokens, gen.min_new_tokens = 4, 0
    prompt = torch.tensor([[hello, world]] * 2)
    out = generate(_Scripted(script), prompt, torch.ones_like(prompt), gen, tok, stop_ids=(EOS,))
    # After row 0's EOS come PAD ids, which equal EOS: only the mask tells them apart.
    assert out.tolist() == [[hello, world, EOS, EOS], script[1]]
    ids, mask, finished = truncate_after_eos(out, (EOS,), tok.pad_token_id)
    assert mask.tolist() == [[True, True, True, False], [True] * 4]
    assert finished.tolist() == [True, False]
    assert decode_responses(tok, ids, mask, (EOS,)) == ["Hello world", "Hello worldHello world"]


def test_reward_score_is_read_at_the_last_real_token_when_pad_is_eos(tiny_real_vocab, smollm2):
    from rlhf_dist.rewards.scoring import score_sequences

    tok = load_tokenizer(str(smollm2["shipped"]))
    rm = ValueModel(
        load_sequence_classifier(str(tiny_real_vocab["shipped"]["reward"]), "m", new_head=True)
    )
    seqs = [tok("a long answer that ends")["input_ids"] + [EOS], tok("short")["input_ids"] + [EOS]]
    runtime = type("OneRank", (), {"rank": 0, "world_size": 1, "device": torch.device("cpu")})()
    runtime.all_max = lambda x: x
    together = score_sequences(runtime, rm, seqs, batch_size=2, pad_id=tok.pad_token_id)
    # The short row is padded with EOS ids; its score must be the one at its own EOS.
    alone = torch.cat([score_sequences(runtime, rm, [s], 1, tok.pad_token_id) for s in seqs])
    assert torch.allclose(together, alone, atol=1e-5)
    with torch.no_grad():
        per_token = rm(torch.tensor([seqs[1]]), torch.ones(1, len(seqs[1]), dtype=torch.long))
    assert torch.allclose(together[1], per_token[0, -1], atol=1e-5)


@pytest.mark.parametrize("convention", CONVENTIONS)
def test_sft_trains_the_end_of_turn_token_of_every_assistant_turn(smollm2, convention):
    tok = load_tokenizer(str(smollm2[convention]))
    rows = [
        {"messages": [
            {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"},
            {"role": "user", "content": "more"}, {"role": "assistant", "content": "ok"},
        ]},
        {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]},
    ]  # fmt: skip
    examples, report = sft_examples(rows, tok, DataConfig(max_length=128))
    assert len(examples) == 2, report.summary("sft")
    batch = collate_sft(examples, tok.pad_token_id)
    targets = batch["input_ids"][:, 1:]
    for b, ex in enumerate(examples):
        ids, trained = ex.ids, ex.targets()
        text = tok.decode([i for i, t in zip(ids, trained, strict=True) if t])
        assert text.count("<|im_end|>") == (2 if b == 0 else 1), text
        assert ("hello there" in text and "ok" in text) if b == 0 else "y" in text
        assert "hi" not in text and "user" not in text and "system" not in text
        # Padding (EOS ids when PAD == EOS) is never a target: the mask ends at the row.
        n_targets = int(batch["loss_mask"][b].sum())
        assert n_targets == sum(trained[1:])
        assert not batch["loss_mask"][b, len(ids) - 1 :].any()
    # The shorter row's padding holds the PAD id, which is EOS in the shipped convention.
    short = examples[1]
    assert (targets[1, len(short.ids) - 1 :] == tok.pad_token_id).all()


def test_generation_config_eos_lists_stop_generation(tmp_path, smollm2):
    from rlhf_dist.config import config_from_dict
    from rlhf_dist.models import policy_stop_ids

    model_dir = tmp_path / "llama3_style"
    model_dir.mkdir()
    for f in smollm2["nopad"].iterdir():
        if f.suffix in (".json", ".jinja"):
            (model_dir / f.name).write_text(f.read_text())
    # Llama-3 instruct lists several ids; 0 (<|endoftext|>) stands in for <|eot_id|>.
    gen = json.loads((model_dir / "generation_config.json").read_text())
    gen["eos_token_id"] = [EOS, 0]
    (model_dir / "generation_config.json").write_text(json.dumps(gen))
    tok = load_tokenizer(str(model_dir))
    cfg = config_from_dict({"model": {"policy": str(model_dir)}})
    assert policy_stop_ids(cfg, tok) == (0, EOS)
    ids = torch.tensor([[5, 0, 7, 7], [5, 6, EOS, 7], [5, 6, 7, 8]])
    _, mask, finished = truncate_after_eos(ids, policy_stop_ids(cfg, tok), tok.pad_token_id)
    assert mask.sum(1).tolist() == [2, 3, 4] and finished.tolist() == [True, True, False]


def test_exports_keep_the_tokenizer_as_shipped(smollm2, tmp_path):
    from transformers import AutoTokenizer

    from rlhf_dist.data.chat import export_tokenizer

    for c in CONVENTIONS:
        tok = load_tokenizer(str(smollm2[c]))
        export_tokenizer(tok, DataConfig()).save_pretrained(tmp_path / c)
        again = AutoTokenizer.from_pretrained(tmp_path / c)
        shipped = AutoTokenizer.from_pretrained(str(smollm2[c]))
        assert again.pad_token_id == shipped.pad_token_id, c
        assert tok.pad_token_id is not None, "the run's own tokenizer keeps its padding id"
