"""The tool-use task: the answer is in a table only the tool sees (docs/agents.md).

A prompt asks "what is the code of KEY ?"; each KEY has a colour code drawn once from a
fixed seed and held by `lookup` alone, so a policy that answers without calling the tool
is right 1 time in len(CODES). A demonstration (the SFT data; its codes come from a
stand-in table, write_tool_task):

    system:    tools: lookup                      (what the template writes for the tools)
    user:      what is the code of old river ?
    assistant: <tool_call> {"name": "lookup", "arguments": {"key": " old river "}} </tool_call>
    tool:      blue
    assistant: the code is blue

The tokenizer is word-level (whitespace-split), so the call's JSON is spelt in a few
words and the key inside it is the same two tokens as in the question.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

    from rlhf_dist.rollout.endpoint import EndpointClient

NOUNS: tuple[str, ...] = (
    "river", "stone", "apple", "cloud", "tiger", "piano", "lemon", "candle",
    "forest", "rocket", "garden", "window", "bottle", "mirror", "pencil", "jacket",
)  # fmt: skip
ADJECTIVES: tuple[str, ...] = ("old", "new", "big", "small", "dark", "bright", "cold", "warm")
# A key is an adjective and a noun: 128 keys, too many for RL to memorise their codes
# through the reward within the demo's iterations, so calling the tool is what pays.
KEYS: tuple[str, ...] = tuple(f"{a} {n}" for a in ADJECTIVES for n in NOUNS)
CODES: tuple[str, ...] = ("red", "blue", "green", "gold", "gray", "pink")
TABLE: dict[str, str] = dict(
    zip(KEYS, (random.Random(7 + i).choice(CODES) for i in range(len(KEYS))))
)

CALL_OPEN = '<tool_call> {"name": "lookup", "arguments": {"key": "'
CALL_CLOSE = '"}} </tool_call>'
SYSTEM = "tools: lookup"
QUESTION = "what is the code of {} ?"

# ChatML with the tools named in a system turn (the word-level vocabulary cannot spell
# JSON schemas; the names are what the policy needs).
TEMPLATE = (
    "{% if tools %}<|im_start|>system\ntools:{% for t in tools %} {{ t['function']['name'] }}"
    "{% endfor %}<|im_end|>\n{% endif %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ("<pad>", "<eos>", "<unk>", "<|im_start|>", "<|im_end|>")


def lookup(key: str) -> str:
    """The code of a key in the table.

    Args:
        key: the key to look up
    """
    return TABLE[key.strip()]


def endpoint_episode(client: EndpointClient, prompt: str | list[dict], max_turns: int = 3) -> None:
    """The task as an environment that drives the policy through the rollout servers'
    chat endpoint (generation.environment_endpoint; rollout/endpoint.py): the in-process
    rollouts' ToolEnvironment with `lookup`, answering the call each reply makes (OpenAI
    `tool_calls`, or a malformed call left in the text, with its error), until a reply
    calls none or after `max_turns` turns; None: reward.function (answer_reward) scores
    the final answer."""
    from rlhf_dist.rollout.agent import ToolEnvironment, tool_schema

    env = ToolEnvironment({"lookup": lookup}, 10.0)
    messages = env.reset(prompt)
    for _ in range(max_turns):
        reply = client.chat(messages, tools=[tool_schema(lookup)])["choices"][0]
        said = reply["message"]
        messages.append(said)  # sent back as answered
        if reply["finish_reason"] == "length":
            return None
        new, done, _ = env.step(messages)
        if done:
            return None
        calls = said.get("tool_calls") or [{}]
        messages += [
            m | ({"tool_call_id": calls[0]["id"]} if "id" in calls[0] else {}) for m in new
        ]
    return None


def call_text(key: str) -> str:
    return f"{CALL_OPEN} {key} {CALL_CLOSE}"


def words() -> list[str]:
    text = " ".join(
        [CALL_OPEN, CALL_CLOSE, SYSTEM, QUESTION, "the code is", "system user assistant tool"]
    )
    return sorted({*text.split(), *NOUNS, *ADJECTIVES, *CODES})


def key_of(prompt: str | list[dict]) -> str | None:
    """The key a prompt (a text or a message list) asks about."""
    if not isinstance(prompt, str):
        prompt = " ".join(m["content"] for m in prompt if m["role"] == "user")
    found = re.search(r"code of (\w+ \w+) \?", prompt)
    return found.group(1) if found and found.group(1) in TABLE else None


def answer_reward(prompts: list, responses: list[str]) -> list[float]:
    """1.0 when the final answer is exactly "the code is CODE" with the key's code."""
    out = []
    for prompt, response in zip(prompts, responses):
        key = key_of(prompt)
        out.append(
            float(key is not None and response.split() == f"the code is {TABLE[key]}".split())
        )
    return out


def gold_eval(prompts: list, responses: list[str], finished: list[bool]) -> list[float]:
    """eval.gold_function: the exact-answer rate (finished or not)."""
    del finished
    return answer_reward(prompts, responses)


def demonstration(key: str, code: str, with_tool: bool) -> dict:
    """One SFT row: the tool call, its result `code` and the answer; or (with_tool=False)
    a direct answer `code`, a guess."""
    answer = {"role": "assistant", "content": f"the code is {code}"}
    opening = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": QUESTION.format(key)},
    ]
    if not with_tool:
        return {"messages": [*opening, answer]}
    call = [{"role": "assistant", "content": call_text(key)}, {"role": "tool", "content": code}]
    return {"messages": [*opening, *call, answer]}


def write_tool_task(
    root: str | Path, train_keys: int = 96, tool_share: float = 0.5, seed: int = 0
) -> dict[str, Path]:
    """Under `root`: sft.jsonl (one demonstration per RL key, a share `tool_share` of them
    calling the tool, the others guessing), prompts.jsonl (the RL prompts: `train_keys`
    keys) and eval_prompts.jsonl (the other keys' questions, twice each, held out from RL).

    The demonstrations' codes are drawn at random, not read from TABLE (the tool's results
    in them are a stand-in table), so SFT cannot teach the answers: only calling the tool
    finds them. An SFT policy that calls it `tool_share` of the time is right about
    tool_share + (1 - tool_share) / len(CODES) of the time; RL can learn to always call.
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    train, held_out = split_keys(rng, train_keys)
    rows = {
        "sft": [demonstration(k, rng.choice(CODES), rng.random() < tool_share) for k in train],
        "prompts": [{"prompt": QUESTION.format(k)} for k in train],
        "eval_prompts": [{"prompt": QUESTION.format(k)} for k in held_out for _ in range(2)],
    }
    paths = {}
    for name, items in rows.items():
        paths[name] = root / f"{name}.jsonl"
        paths[name].write_text("".join(json.dumps(r) + "\n" for r in items), encoding="utf-8")
    return paths


def split_keys(rng: random.Random, train_keys: int = 96) -> tuple[list[str], list[str]]:
    """(RL keys, held-out keys): KEYS shuffled by `rng` (write_tool_task's first draw)."""
    keys = list(KEYS)
    rng.shuffle(keys)
    return keys[:train_keys], keys[train_keys:]


def build_tool_tokenizer(save_dir: str | Path) -> PreTrainedTokenizerFast:
    """The task's word-level tokenizer with TEMPLATE as its chat template, saved to save_dir."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate((*SPECIALS, *words()))}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.add_special_tokens(list(SPECIALS))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        eos_token="<eos>",
        unk_token="<unk>",
        clean_up_tokenization_spaces=False,
        model_max_length=128,
    )
    tokenizer.chat_template = TEMPLATE
    Path(save_dir).mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(save_dir))
    return tokenizer
