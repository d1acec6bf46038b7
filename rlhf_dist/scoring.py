"""Frozen rewards: a user's reward function or a reward model, and scoring token
sequences with a reward model on every rank (the rephrasing probe of docs/rm_diagnostics.md).

Shared by PPO (rollout scores), reward-model training (held-out diagnostics) and
`rlhf-dist eval`, so it lives outside the trainers.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass

import torch

from rlhf_dist import diagnostics as diag
from rlhf_dist import inputs
from rlhf_dist.chat import BadRow, Chat, is_stop, stop_token_ids
from rlhf_dist.config import ConfigError, RewardFunctionError
from rlhf_dist.data import close_with_stop, encode_response, right_pad
from rlhf_dist.models import (
    ValueModel,
    frozen_dtype,
    load_sequence_classifier,
    load_tokenizer,
    policy_stop_ids,
    sequence_scores,
    tokenizer_for,
)


class RewardFunction:
    """A user's `module:callable(prompts, responses) -> list[float]`, checked on every call.

    prompts: each prompt as its data row gave it, a text or (conversational data) a list of
    {role, content} messages; responses: the sampled texts, stop tokens removed."""

    def __init__(self, spec: str):
        self.spec, self.fn = spec, inputs.resolve_callable(spec, "reward.function")

    def __call__(self, prompts: list[str], responses: list[str]) -> torch.Tensor:
        try:
            out = list(self.fn(prompts, responses))
        except Exception as e:
            raise RewardFunctionError(
                f"reward.function {self.spec} raised {type(e).__name__}: {e}"
            ) from e
        if len(out) != len(responses):
            raise RewardFunctionError(
                f"reward.function {self.spec} returned {len(out)} scores for {len(responses)} responses"
            )
        bad = [v for v in out if not _is_finite_number(v)]
        if bad:
            raise RewardFunctionError(
                f"reward.function {self.spec} returned a non-finite or non-number: {bad[0]!r}"
            )
        return torch.tensor([float(v) for v in out], dtype=torch.float32)


def _is_finite_number(v) -> bool:
    """A real, finite number (python, numpy or 0-dim torch), never a bool or a string."""
    if isinstance(v, (bool, str, bytes)) or not isinstance(v, numbers.Real | torch.Tensor):
        return False
    try:
        return math.isfinite(float(v))
    except (TypeError, ValueError):
        return False


def same_tokenizer(a, b) -> bool:
    """Whether two tokenizers turn a conversation into the same ids: same vocabulary,
    special tokens, chat template and special tokens added on encoding."""
    specials = ("bos_token_id", "eos_token_id", "pad_token_id")
    probe = "a b"
    return (
        a.get_vocab() == b.get_vocab()
        and all(getattr(a, n) == getattr(b, n) for n in specials)
        and getattr(a, "chat_template", None) == getattr(b, "chat_template", None)
        and a(probe)["input_ids"] == b(probe)["input_ids"]
    )


@dataclass(frozen=True)
class RewardInputs:
    """The reward model's own input for (prompt, response text) when its tokenizer or
    template differs from the policy's: the text round-trip of docs/data.md.

    A text prompt becomes the RM tokenizer's encoding of it plus the response's (EOS
    appended if the response finished), as `rlhf-dist rm` encodes text pairs; a
    conversational one is rendered with the RM's template as prompt + assistant turn (the
    whole conversation if the response finished; else the prompt with its generation
    prompt, then the response text unclosed), as `rlhf-dist rm` renders conversations.
    """

    tokenizer: object  # the reward model's
    chat: Chat | None  # its chat template (None: the tokenizer has none)
    stop_ids: tuple[int, ...]  # the reward model tokenizer's (chat.stop_token_ids)
    policy_stop_ids: tuple[int, ...]  # what ended a policy response

    def sequence(self, prompt, response: str, finished: bool) -> list[int]:
        tok = self.tokenizer
        if isinstance(prompt, str):
            if finished:
                return tok(prompt)["input_ids"] + encode_response(tok, response)
            return tok(prompt)["input_ids"] + tok(response, add_special_tokens=False)["input_ids"]
        if self.chat is None:
            raise ConfigError(
                "model.reward: its tokenizer has no chat template for conversational prompts "
                "(save one with the reward model's tokenizer)"
            )
        if not finished:
            return self.chat.prompt_ids(prompt) + self.chat.encode(response)
        turns = prompt + [{"role": "assistant", "content": response}]
        try:
            ids, trained = self.chat.conversation(turns, len(prompt))
        except BadRow as e:
            raise ConfigError(f"model.reward: its chat template: {e}") from None
        return close_with_stop(ids, trained, self.stop_ids, tok.eos_token_id)[0]

    def probe_response(self, prompt, response: str) -> diag.Response | None:
        """The finished sequence of (prompt, response) split for the rephrasing probe
        (docs/rm_diagnostics.md): prompt part, the response's own encoding as the body,
        then what closes it (end-of-turn, EOS). None where the rendering does not hold
        those tokens there (a tokenizer merging across the boundary): no clean split."""
        ids = self.sequence(prompt, response, True)
        if isinstance(prompt, str):
            head = self.tokenizer(prompt)["input_ids"]
        else:
            head = self.chat.prompt_ids(prompt)
        body = self.tokenizer(response, add_special_tokens=False)["input_ids"]
        cut = len(head) + len(body)
        if ids[: len(head)] != head or ids[len(head) : cut] != body:
            return None
        return diag.Response(head, body, ids[cut:])

    def batch(self, prompts, responses, input_ids, last_index):
        """(ids, attention mask, last index) of the RM's own tokens, right-padded; a
        response finished iff its last real token in `input_ids` (B, P+T) is a stop id."""
        ends = input_ids.gather(1, last_index.long().unsqueeze(1)).squeeze(1)
        finished = is_stop(ends, self.policy_stop_ids).tolist()
        seqs = [self.sequence(p, r, f) for p, r, f in zip(prompts, responses, finished)]
        ids, mask = right_pad(seqs, self.tokenizer.pad_token_id)
        ids, mask = ids.to(input_ids.device), mask.to(input_ids.device)
        return ids, mask, mask.sum(1) - 1


@dataclass
class Scorer:
    """Scores whole sequences with a reward model or a reward function."""

    reward_model: ValueModel | None = None
    reward_fn: Callable | None = None
    inputs: RewardInputs | None = None  # set: the RM reads its own tokens, not the policy's

    @torch.no_grad()
    def __call__(self, prompts, responses, input_ids, attention_mask, last_index) -> torch.Tensor:
        """prompts: B prompts as given (texts or message lists); responses: B texts;
        input_ids/attention_mask (B, P+T) the policy's tokens; last_index (B,)."""
        if self.reward_fn is not None:
            return self.reward_fn(prompts, responses).to(input_ids.device)
        if self.inputs is not None:
            input_ids, attention_mask, last_index = self.inputs.batch(
                prompts, responses, input_ids, last_index
            )
        return sequence_scores(self.reward_model, input_ids, attention_mask, last_index).float()


def reward_inputs_for(cfg) -> RewardInputs | None:
    """RewardInputs when model.reward's tokenizer differs from the policy's (vocabulary,
    specials or template); None when they agree, model.tokenizer is shared by all models,
    or a reward function scores."""
    m = cfg.model
    if cfg.reward.function or not m.reward or m.tokenizer:
        return None
    policy_tok = tokenizer_for(cfg, "policy")
    rm_tok = load_tokenizer(m.reward, m.trust_remote_code, "model.reward")
    if same_tokenizer(policy_tok, rm_tok):
        return None
    chat = Chat(rm_tok, rm_tok.chat_template) if rm_tok.chat_template else None
    stops = stop_token_ids(rm_tok, chat)
    return RewardInputs(rm_tok, chat, stops, policy_stop_ids(cfg, policy_tok))


def build_scorer(
    runtime, reward_function: str, model_cfg, placement: str, inputs: RewardInputs | None = None
) -> Scorer:
    """The frozen reward: the Python function `reward_function` ("module:callable") if set,
    else model_cfg.reward loaded as a ValueModel and prepared as a frozen model with
    `placement` (distributed.frozen_models, or "replicate"), reading `inputs` (its own
    tokens, reward_inputs_for) if given."""
    if reward_function:
        return Scorer(reward_fn=RewardFunction(reward_function))
    m, dtype = model_cfg, frozen_dtype(model_cfg)
    with runtime.local_loading():
        rm = load_sequence_classifier(m.reward, "model.reward", dtype, m)
    rm = runtime.prepare_frozen(ValueModel(rm), placement, dtype, "reward model")
    return Scorer(reward_model=rm, inputs=inputs)


def lockstep_chunks(runtime, n_items: int, size: int):
    """Slices of `size` over this rank's n_items, then None until every rank is done.

    Ranks' shares differ in length, but each forward pass of a prepared model may be a
    collective (ZeRO-3 gathers every layer's weights; DDP broadcasts buffers), so every
    rank must run as many passes as the busiest one: a None asks for a throw-away pass.
    """
    mine = -(-n_items // size)
    total = int(runtime.all_max(torch.tensor(mine, dtype=torch.long)))
    for i in range(total):
        yield slice(i * size, (i + 1) * size) if i < mine else None


@torch.no_grad()
def score_sequences(runtime, value_model, seqs: list[list[int]], batch_size: int, pad_id: int):
    """Scores (len(seqs),) on CPU of whole token sequences, each read at its last token.

    Every rank must call this (lock-step passes, see lockstep_chunks), each with its own seqs.
    """
    out = []
    for s in lockstep_chunks(runtime, len(seqs), batch_size):
        ids, mask = right_pad(seqs[s] if s else [[pad_id]], pad_id)
        ids, mask = ids.to(runtime.device), mask.to(runtime.device)
        scores = sequence_scores(value_model, ids, mask, mask.sum(1) - 1)
        if s:
            out.append(scores.float().cpu())
    return torch.cat(out) if out else torch.zeros(0)


def probe_rephrasings(runtime, value_model, responses, scores, filler, batch_size, pad_id) -> dict:
    """The rephrasing probe over every rank's `responses` (diagnostics.Response, this rank's
    share) with their known `scores` (N,); `filler` is also the droppable tail. Returns
    diagnostics.rephrase_summary of all ranks together. Every rank must call this."""
    longer, shorter = diag.rephrasings(responses, filler, [filler])
    up = score_sequences(runtime, value_model, longer, batch_size, pad_id)
    down = score_sequences(runtime, value_model, [s for _, s in shorter], batch_size, pad_id)
    base = torch.as_tensor(scores, dtype=torch.float64).reshape(-1)
    part = (base.tolist(), up.tolist(), base[[i for i, _ in shorter]].tolist(), down.tolist())
    parts = runtime.gather_objects([part])
    return diag.rephrase_summary(*([x for p in parts for x in p[k]] for k in range(4)))
