"""LLM-as-a-judge: a generative model scores (prompt, response) pairs (docs/rewards.md).

One interface, two kinds of judge: `replies(texts) -> list[str]` from a local causal LM
(`LocalJudge`, reward.judge=model) or from an OpenAI-compatible endpoint
(`remote.ChatJudgeClient`, reward.judge=url). `JudgeReward` renders reward.judge_template,
asks the judge and parses the first number of each reply; a reply without one gets
reward.judge_fallback_score and is counted (`parse_failures`), or with a null fallback is
a reward failure.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias

import torch

from rlhf_dist.config import PerfConfig
from rlhf_dist.data.chat import Chat, prompt_text, stop_token_ids
from rlhf_dist.data.rows import left_pad
from rlhf_dist.engine.decode import decode_responses, generate, truncate_after_eos
from rlhf_dist.engine.forward import DEFAULT_PERF
from rlhf_dist.errors import RewardFunctionError

if TYPE_CHECKING:
    from torch import nn
    from transformers import PreTrainedTokenizerBase

# A prompt as its data row gave it: a text, or a list of {"role", "content"} messages.
Prompt: TypeAlias = str | list[dict]

_NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?")


def parse_score(reply: str) -> float | None:
    """The first number in `reply` ("Score: 7/10" -> 7.0), or None if it has none."""
    found = _NUMBER.search(reply)
    return float(found.group()) if found else None


class Judge(Protocol):
    """What JudgeReward asks: one reply per judge prompt (LocalJudge, remote.ChatJudgeClient)."""

    def replies(self, texts: list[str]) -> list[str]: ...


class JudgeReward:
    """`(prompts, responses) -> list[float]`: the judge's number for each pair.

    judge: anything with `replies(list[str]) -> list[str]`. template: with {prompt} and
    {response}, and {name} for any other column of the data rows (a reference answer, a
    rubric): each placeholder is replaced by the row's value. fallback: the score of a
    reply without a number (None: raise RewardFunctionError). `parse_failures` counts
    those replies since the last `take_counts`.
    """

    def __init__(self, judge: Judge, template: str, fallback: float | None) -> None:
        self.judge, self.template, self.fallback = judge, template, fallback
        self.parse_failures = 0
        self.__name__ = "judge"

    def __call__(
        self, prompts: Sequence[Prompt], responses: Sequence[str], **columns: Sequence[Any]
    ) -> list[float]:
        """Scores of B responses; columns: name -> B values (the rows' other columns)."""
        texts = [
            self.fill(prompt_text(p), r, {name: v[i] for name, v in columns.items()})
            for i, (p, r) in enumerate(zip(prompts, responses))
        ]
        scores = []
        for reply in self.judge.replies(texts):
            score = parse_score(reply)
            if score is None:
                if self.fallback is None:
                    raise RewardFunctionError(
                        f"reward.judge: no number in the judge's reply {reply[:80]!r} "
                        "(set reward.judge_fallback_score to score such replies)"
                    )
                self.parse_failures += 1
                score = self.fallback
            scores.append(score)
        return scores

    def fill(self, prompt: str, response: str, row: dict) -> str:
        """The template with {prompt}, {response} and the row's columns filled in (a
        placeholder naming no column stays as written: templates hold other braces)."""
        text = self.template
        for name, value in row.items():
            text = text.replace("{" + name + "}", "" if value is None else str(value))
        return text.replace("{prompt}", prompt).replace("{response}", response)

    def take_counts(self) -> int:
        """Parse failures since the last call, reset to 0."""
        n, self.parse_failures = self.parse_failures, 0
        return n


class LocalJudge:
    """A frozen causal LM on this rank answering judge prompts by greedy decoding through
    the rollout's decode loop (engine.decode.generate with top_k=1).

    model: replicated on every rank (no lock-step needed); tokenizer: the judge's own. A
    tokenizer with a chat template gets each prompt as one user turn with the generation
    prompt; otherwise the prompt text is encoded as is.
    """

    def __init__(
        self,
        model: nn.Module,
        tokenizer: PreTrainedTokenizerBase,
        max_new_tokens: int,
        batch_size: int,
        device: torch.device,
        perf: PerfConfig = DEFAULT_PERF,
    ) -> None:
        self.model, self.tokenizer, self.device, self.perf = model, tokenizer, device, perf
        self.batch_size = batch_size
        self.chat = Chat(tokenizer, tokenizer.chat_template) if tokenizer.chat_template else None
        self.stop_ids = stop_token_ids(tokenizer, self.chat)
        # greedy: the single most likely token at every step
        self.gen = SimpleNamespace(
            max_new_tokens=max_new_tokens, min_new_tokens=0, temperature=1.0, top_k=1, top_p=1.0
        )

    def encode(self, text: str) -> list[int]:
        """A judge prompt's ids: one user turn with the generation prompt, or the bare text
        without a chat template."""
        if self.chat is None:
            return self.tokenizer(text)["input_ids"]
        return self.chat.prompt_ids([{"role": "user", "content": text}])

    @torch.no_grad()
    def replies(self, texts: list[str]) -> list[str]:
        """The judge's greedy reply to each text, batch_size prompts per generate call."""
        tok, eos, out = self.tokenizer, self.stop_ids, []
        for i in range(0, len(texts), self.batch_size):
            ids, mask = left_pad(
                [self.encode(t) for t in texts[i : i + self.batch_size]], tok.pad_token_id
            )
            ids, mask = ids.to(self.device), mask.to(self.device)
            response = generate(self.model, ids, mask, self.gen, tok, None, eos, self.perf)
            response, response_mask, _ = truncate_after_eos(response, eos, tok.pad_token_id)
            out += decode_responses(tok, response, response_mask, eos)
        return out
