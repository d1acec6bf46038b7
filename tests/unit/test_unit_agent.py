"""Multi-turn rollouts (rlhf_dist/rollout/agent.py, docs/agents.md "Multi-turn rollouts and tools").

A scripted policy (its next token a function of the context it was given) drives whole
episodes deterministically through `engine.decode.generate`, over a character-level BPE
tokenizer with one merge ("name" is one token), so a turn sampled character by character
is NOT the tokenizer's encoding of its own text: re-tokenising it would change the ids.
"""

from __future__ import annotations

import copy
import json
import string
import time

import pytest
import torch

from rlhf_dist.config import ConfigError, GenerationConfig, config_from_dict, validate
from rlhf_dist.data.chat import CHATML_TOOLS_TEMPLATE
from rlhf_dist.engine.decode import generate
from rlhf_dist.errors import ServerError
from rlhf_dist.generation.server import ServerEngine
from rlhf_dist.generation.vllm import sampling_seeds
from rlhf_dist.rollout import RolloutBatch
from rlhf_dist.rollout import agent as agent_mod
from rlhf_dist.rollout.agent import (
    Agent,
    Renderer,
    ToolEnvironment,
    episode_batch,
    parse_tool_call,
    request_episodes,
    run_episodes,
    run_tool,
    tool_schema,
)

SPECIALS = ["<pad>", "<eos>", "<|im_start|>", "<|im_end|>"]


@pytest.fixture(scope="module")
def tok():
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    chars = sorted(set(string.printable))
    vocab = {t: i for i, t in enumerate([*SPECIALS, *chars, "na", "nam", "name"])}
    merges = [("n", "a"), ("na", "m"), ("nam", "e")]
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    backend.add_special_tokens(SPECIALS)
    backend.decoder = decoders.Fuse()
    t = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>")
    t.chat_template = CHATML_TOOLS_TEMPLATE
    return t


def chars(tok, text: str) -> list[int]:
    """`text` spelt one character per token (not the canonical encoding of "name")."""
    return [tok.convert_tokens_to_ids(c) for c in text]


def lookup(key: str) -> str:
    """Look a key up in the table.

    Args:
        key: the key to look up
    """
    return {"b": "value-b"}[key]


def explode(key: str) -> str:
    """A tool that always fails.

    Args:
        key: ignored
    """
    raise ValueError(f"no {key}")


def sleepy(key: str) -> str:
    """A tool that never answers in time.

    Args:
        key: ignored
    """
    time.sleep(30)
    return "late"


class _Output(dict):
    __getattr__ = dict.__getitem__


class Scripted(torch.nn.Module):
    """A 'model' whose next token is policy(context) (one-hot logits): it records the
    context each generate call starts from (its prefill) and follows the fed tokens."""

    def __init__(self, policy, vocab: int):
        super().__init__()
        self.policy, self.vocab, self.prefills = policy, vocab, []
        self.anchor = torch.nn.Parameter(torch.zeros(1))

    def forward(self, input_ids, attention_mask, past_key_values=None, **kwargs):
        if past_key_values is None:  # prefill: the turn's whole prompt
            self.rows = [r[m.bool()].tolist() for r, m in zip(input_ids, attention_mask)]
            self.prefills.append([list(r) for r in self.rows])
        else:
            for row, t in zip(self.rows, input_ids[:, 0].tolist()):
                row.append(t)
        logits = torch.full((input_ids.shape[0], 1, self.vocab), -1e9)
        for b, row in enumerate(self.rows):
            logits[b, 0, self.policy(row)] = 0.0
        return _Output(logits=logits, past_key_values="cache")


def turn_policy(tok, turns: list[list[int]]):
    """The scripted policy: the k-th assistant turn (k = tool messages seen so far) is
    turns[min(k, last)], then <|im_end|> forever."""
    im_start, im_end = tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    header, tool = chars(tok, "assistant\n"), [im_start, *chars(tok, "tool")]

    def policy(ctx: list[int]) -> int:
        if im_start not in ctx:  # a throw-away row
            return im_end
        start = max(i for i, t in enumerate(ctx) if t == im_start) + 1 + len(header)
        seen = sum(ctx[i : i + len(tool)] == tool for i in range(len(ctx)))
        script = turns[min(seen, len(turns) - 1)]
        so_far = len(ctx) - start
        return script[so_far] if so_far < len(script) else im_end

    return policy


def make_agent(tok, tools, max_turns=4, budget=400, timeout_s=5.0) -> Agent:
    schemas = tuple(tool_schema(fn) for fn in tools.values())
    renderer = Renderer(tok, CHATML_TOOLS_TEMPLATE, schemas)
    return Agent(lambda: ToolEnvironment(tools, timeout_s), renderer, max_turns, budget)


def gen_cfg(max_new_tokens=120):
    return GenerationConfig(max_new_tokens=max_new_tokens, temperature=0.7)


def stops(tok):
    return (tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>"))


CALL = '<tool_call>{"name": "lookup", "arguments": {"key": "b"}}</tool_call>'


def call_turn(tok, tool="lookup") -> list[int]:
    return chars(tok, CALL.replace("lookup", tool)) + [tok.convert_tokens_to_ids("<|im_end|>")]


def answer_turn(tok) -> list[int]:
    return chars(tok, "It is value-b.") + [tok.convert_tokens_to_ids("<|im_end|>")]


def play(tok, agent, turns, prompts=("What is b?",), **kwargs):
    model = Scripted(turn_policy(tok, turns), len(tok))
    episodes = run_episodes(agent, model, None, list(prompts), gen_cfg(), tok, stops(tok), **kwargs)
    return model, episodes


# ---------------------------------------------------------------- token-in / token-out


def test_turns_keep_the_exact_sampled_ids_and_append_only_the_new_messages(tok):
    agent = make_agent(tok, {"lookup": lookup})
    turn1, turn2 = call_turn(tok), answer_turn(tok)
    model, [e] = play(tok, agent, [turn1, turn2])
    # The sampled turn is not the canonical encoding of its text: re-tokenising changes it.
    text1 = tok.decode(turn1, skip_special_tokens=True)
    assert tok(text1, add_special_tokens=False)["input_ids"] != turn1[:-1]
    tool_msg = {"role": "tool", "content": "value-b"}
    messages = [{"role": "user", "content": "What is b?"}, {"role": "assistant", "content": text1}]
    tool_ids = agent.renderer.continuation_ids(messages, [tool_msg])
    first, second = model.prefills[0][0], model.prefills[1][0]
    assert first == agent.renderer.prompt_ids(messages[:1])
    assert second == first + turn1 + tool_ids  # exact ids, earlier turns never re-encoded
    assert e.tokens == turn1 + tool_ids + turn2
    assert e.sampled == [True] * len(turn1) + [False] * len(tool_ids) + [True] * len(turn2)
    assert e.messages[2] == tool_msg and e.answer == "It is value-b."
    assert (e.turns, e.tool_calls, e.finished, e.env.tool_errors) == (2, 1, True, 0)


def test_new_messages_carry_the_separator_after_the_end_of_turn_token(tok):
    """verl#6921: the newline the template writes after <|im_end|> belongs to the tool
    message's tokens (the sampled turn ends at <|im_end|>)."""
    renderer = Renderer(tok, CHATML_TOOLS_TEMPLATE)
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    ids = renderer.continuation_ids(messages, [{"role": "tool", "content": "r"}])
    assert tok.decode(ids) == "\n<|im_start|>tool\nr<|im_end|>\n<|im_start|>assistant\n"


def test_the_tool_schema_is_rendered_into_the_prompt(tok):
    agent = make_agent(tok, {"lookup": lookup})
    text = agent.renderer.render([{"role": "user", "content": "q"}], generation_prompt=True)
    assert '"name": "lookup"' in text and "the key to look up" in text


# --------------------------------------------------------------------------- masks


def test_episode_batch_masks_tool_tokens_out_of_the_loss_but_not_out_of_attention(tok):
    agent = make_agent(tok, {"lookup": lookup})
    _, episodes = play(tok, agent, [call_turn(tok), answer_turn(tok)], prompts=("q", "What?"))
    out = episode_batch(episodes, tok.pad_token_id, "cpu")
    for b, e in enumerate(episodes):
        n = len(e.tokens)
        assert out["response_ids"][b, :n].tolist() == e.tokens
        assert out["response_mask"][b, :n].tolist() == e.sampled
        width = out["response_attention"].shape[1]
        assert out["response_attention"][b].tolist() == [1] * n + [0] * (width - n)
        assert not out["response_mask"][b, n:].any()
    tool_positions = ~out["response_mask"] & out["response_attention"].bool()
    assert tool_positions.any()  # the tool message is context
    assert out["turns"].tolist() == [2, 2] and out["tool_calls"].tolist() == [1, 1]
    assert torch.isnan(out["env_scores"]).all()


def test_rollout_batch_attends_to_tool_tokens_and_single_turn_is_unchanged():
    prompt_ids, prompt_mask = torch.tensor([[0, 5, 6]]), torch.tensor([[0, 1, 1]])
    response_mask = torch.tensor([[True, False, False, True, False]])
    attention = torch.tensor([[1, 1, 1, 1, 0]])
    common = dict(
        prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=torch.tensor([[7, 8, 9, 3, 0]]),
        response_mask=response_mask, old_logprobs=None, ref_logprobs=torch.zeros(1, 5),
        old_values=None, scores=torch.zeros(1), raw_scores=torch.zeros(1),
        finished=torch.tensor([True]), entropy=None,
    )  # fmt: skip
    multi = RolloutBatch(**common, response_attention=attention)
    assert multi.attention_mask.tolist() == [[0, 1, 1, 1, 1, 1, 1, 0]]
    cut, keep = multi.trimmed()
    assert keep == 4 and cut.response_attention.tolist() == [[1, 1, 1, 1]]
    assert cut.prompt_ids.tolist() == [[5, 6]]
    single = RolloutBatch(**common)  # no response_attention: response_mask, as before
    assert torch.equal(single.attention_mask, torch.cat([prompt_mask, response_mask.long()], 1))
    assert single.trimmed()[1] == 4


# ----------------------------------------------------------------------- tool errors


@pytest.mark.parametrize(
    "tools, tool, expected",
    [
        ({"explode": explode}, "explode", "error: ValueError: no b"),
        ({"sleepy": sleepy}, "sleepy", "error: the tool timed out after 0.2 s"),
        ({"lookup": lookup}, "nope", "error: unknown tool 'nope' (tools: lookup)"),
    ],
)
def test_a_failing_tool_call_becomes_an_error_message_to_the_model(tok, tools, tool, expected):
    agent = make_agent(tok, tools, timeout_s=0.2)
    _, [e] = play(tok, agent, [call_turn(tok, tool), answer_turn(tok)])
    assert e.messages[2] == {"role": "tool", "content": expected}
    assert (e.turns, e.tool_calls, e.env.tool_errors, e.finished) == (2, 1, 1, True)


def test_a_malformed_call_is_an_error_message_and_the_episode_goes_on(tok):
    agent = make_agent(tok, {"lookup": lookup})
    broken = chars(tok, '<tool_call>{"name": "lookup", "arguments": {"key": }</tool_call>')
    _, [e] = play(
        tok, agent, [broken + [tok.convert_tokens_to_ids("<|im_end|>")], answer_turn(tok)]
    )
    assert e.messages[2]["role"] == "tool"
    assert e.messages[2]["content"].startswith("error: the tool call is not valid JSON")
    assert (e.turns, e.tool_calls, e.env.tool_errors, e.finished) == (2, 1, 1, True)


def test_parse_tool_call():
    assert parse_tool_call("no call here") is None
    assert parse_tool_call('x <tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>') == (
        "f",
        {"a": 1},
    )
    assert parse_tool_call('<tool_call>{"name": "f"}</tool_call>') == ("f", {})
    for bad in ("<tool_call>{nope</tool_call>", '<tool_call>{"arguments": {}}</tool_call>',
                '<tool_call>{"name": "f", "arguments": [1]}</tool_call>'):  # fmt: skip
        with pytest.raises(agent_mod.ToolCallError):
            parse_tool_call(bad)


def test_run_tool_turns_results_into_text():
    assert run_tool(lambda: {"a": [1, 2]}, {}, 1.0) == ('{"a": [1, 2]}', False)
    assert run_tool(lambda x: x, {"y": 1}, 1.0)[1] is True  # wrong arguments: an error text


# ------------------------------------------------------------------------ truncation


def test_tool_content_keeps_images_as_parts_and_everything_else_as_text():
    from PIL import Image

    from rlhf_dist.rollout.agent import tool_content

    image = Image.new("RGB", (2, 2))
    parts = [{"type": "text", "text": "a"}, {"type": "image", "image": image}]
    assert tool_content(image) == ([{"type": "image", "image": image}], False)
    assert tool_content(parts) == (parts, False)
    assert tool_content({"role": "tool", "content": parts}) == (parts, False)
    text_parts = [{"type": "text", "text": "a"}]  # no image: JSON, as before
    assert tool_content(text_parts) == (json.dumps(text_parts), False)
    content, failed = tool_content({1, 2})  # nothing JSON can hold: an error text
    assert failed and content.startswith("error: the tool's result is not JSON")


def test_max_turns_truncates_an_episode_that_keeps_calling_tools(tok):
    agent = make_agent(tok, {"lookup": lookup}, max_turns=3)
    _, [e] = play(tok, agent, [call_turn(tok)])  # always calls the tool
    assert (e.turns, e.finished, e.done) == (3, False, True)
    assert e.sampled[-1] is True  # ends on the policy's turn, no tool tokens after it
    assert e.messages[-1]["role"] == "assistant"  # the tool's last result is not kept
    out = episode_batch([e], tok.pad_token_id, "cpu")
    assert out["finished"].tolist() == [False] and out["tool_calls"].tolist() == [3]


def test_the_token_budget_truncates_an_episode(tok):
    turn1 = call_turn(tok)
    agent = make_agent(tok, {"lookup": lookup}, budget=len(turn1) + 10)
    _, [e] = play(tok, agent, [turn1, answer_turn(tok)])
    # No room for the tool message and a next turn: the episode stops after turn 1.
    assert e.tokens == turn1 and not e.finished and e.turns == 1
    agent = make_agent(tok, {"lookup": lookup}, budget=20)  # cut inside the first turn
    _, [e] = play(tok, agent, [turn1])
    assert e.tokens == turn1[:20] and not e.finished and all(e.sampled)


# -------------------------------------------------------------- environments, lock-step


class CountdownEnv:
    """Ends after `self.steps` turns with reward = number of turns taken."""

    def __init__(self, steps):
        self.steps, self.seen = steps, 0

    def reset(self, prompt):
        return [{"role": "user", "content": prompt}]

    def step(self, messages):
        self.seen += 1
        if self.seen >= self.steps:
            return [], True, float(self.seen)
        return [{"role": "user", "content": "again"}], False, None


def test_an_environment_ends_episodes_with_its_reward(tok):
    envs = iter([CountdownEnv(1), CountdownEnv(3)])
    agent = Agent(lambda: next(envs), Renderer(tok, CHATML_TOOLS_TEMPLATE), 4, 400)
    _, episodes = play(tok, agent, [answer_turn(tok)], prompts=("a", "b"))
    assert [e.turns for e in episodes] == [1, 3]
    assert [e.reward for e in episodes] == [1.0, 3.0]
    assert episode_batch(episodes, tok.pad_token_id, "cpu")["env_scores"].tolist() == [1.0, 3.0]


def test_reward_function_reads_the_whole_conversation_and_the_final_answer(tok):
    agent = make_agent(tok, {"lookup": lookup})
    _, [e] = play(tok, agent, [call_turn(tok), answer_turn(tok)])
    [conversation], [answer] = agent_mod.scoring_inputs([e])
    assert conversation == [
        {"role": "user", "content": "What is b?"},
        {"role": "assistant", "content": CALL},
        {"role": "tool", "content": "value-b"},
    ]
    assert answer == "It is value-b."


def test_a_rank_with_no_episode_left_runs_throw_away_turns_in_lock_step(tok):
    """The other rank (any_rank always True) needs every turn: this rank, done after one
    turn, keeps calling any_rank and runs a one-token throw-away generate per turn while
    its forwards are collectives (keep_in_step given)."""
    agent = make_agent(tok, {"lookup": lookup}, max_turns=4)
    flags, steps = [], []

    def any_rank(flag):
        flags.append(flag)
        return True

    def keep_in_step(more):
        steps.append(more)
        return more

    model = Scripted(turn_policy(tok, [answer_turn(tok)]), len(tok))
    [e] = run_episodes(agent, model, keep_in_step, ["q"], gen_cfg(), tok, stops(tok), any_rank)
    assert e.turns == 1 and e.finished
    assert flags == [True, False, False, False]  # one collective per turn on every rank
    assert len(model.prefills) == 4  # 1 real turn + 3 throw-away generate calls
    assert model.prefills[1] == [[tok.pad_token_id]]


def test_an_engine_samples_the_turns_and_its_log_probs_sit_on_the_sampled_tokens(tok):
    """generation.backend=vllm: a sampler (ids, mask, gen, stop_ids) -> (ids, log-probs)
    stands for the engine; its log-probs land on the sampled tokens, 0 on the tool's."""
    from rlhf_dist.engine.decode import generate

    agent = make_agent(tok, {"lookup": lookup})
    model = Scripted(turn_policy(tok, [call_turn(tok), answer_turn(tok)]), len(tok))
    calls = []

    def sampler(ids, mask, gen, stop_ids):
        calls.append(ids.shape[0])
        out = generate(model, ids, mask, gen, tok, None, stop_ids)
        return out, -0.25 * torch.ones(out.shape)

    [e] = run_episodes(agent, None, None, ["q"], gen_cfg(), tok, stops(tok), sampler=sampler)
    assert calls == [1, 1] and e.turns == 2 and e.finished
    out = episode_batch([e], tok.pad_token_id, "cpu")
    lp, mask = out["sampler_logprobs"][0], out["response_mask"][0]
    assert (lp[mask] == -0.25).all() and (lp[~mask] == 0).all()
    assert "sampler_logprobs" not in episode_batch(
        play(tok, agent, [answer_turn(tok)])[1], 0, "cpu"
    )


def test_a_rank_with_no_episode_left_asks_the_servers_in_lock_step(tok):
    """generation.backend=server: every call's answers are awaited on all ranks together,
    so this rank, done after one turn while the other still plays, sends a one-row,
    one-token throw-away request per turn (sampler_in_step); the vLLM engine (no
    collective in its calls) sends none."""
    from rlhf_dist.engine.decode import generate

    agent = make_agent(tok, {"lookup": lookup}, max_turns=4)
    model = Scripted(turn_policy(tok, [answer_turn(tok)]), len(tok))
    for in_step, throw_aways in ((True, 3), (False, 0)):
        calls = []

        def sampler(ids, mask, gen, stop_ids, calls=calls):
            calls.append((ids.shape[0], gen.max_new_tokens))
            return generate(model, ids, mask, gen, tok, None, stop_ids), None

        [e] = run_episodes(agent, None, None, ["q"], gen_cfg(), tok, stops(tok), lambda f: True,
                           sampler=sampler, sampler_in_step=in_step)  # fmt: skip
        assert e.turns == 1 and e.finished
        assert len(calls) == 1 + throw_aways and calls[1:] == [(1, 1)] * throw_aways


def test_an_episode_played_through_the_endpoint_keeps_the_sampled_ids(tok):
    """serving/episodes.py: a chat request naming an episode continues its record. The
    sampled turn's ids stay as sampled ("name" spelt by character, which the tokenizer
    would merge), the new messages' ids are Renderer.continuation_ids, a request that
    rewrites an earlier message is refused, and collecting hands the record over once."""
    from rlhf_dist.data.chat import Chat
    from rlhf_dist.serving.episodes import EpisodeLog, episode_of, turn_seed
    from rlhf_dist.serving.policy import BadRequest

    log, render = EpisodeLog(Chat(tok, CHATML_TOOLS_TEMPLATE)), Renderer(tok, CHATML_TOOLS_TEMPLATE)
    user = [{"role": "user", "content": "What is b?"}]
    ids, turn, _ = log.context("e1", user, ())
    assert (ids, turn) == (render.prompt_ids(user), 0)
    sampled = call_turn(tok)  # '... "name" ...' one token per character
    text = tok.decode(sampled[:-1])
    said = [*user, {"role": "assistant", "content": text}]
    log.answered("e1", sampled, [-0.5] * len(sampled), text, 3, said[-1])
    tool = [{"role": "tool", "content": "value-b"}]
    ids, turn, _ = log.context("e1", said + tool, ())
    more = render.continuation_ids(said, tool)
    assert turn == 1 and ids == render.prompt_ids(user) + sampled + more
    assert tok(text, add_special_tokens=False)["input_ids"] != sampled[:-1]  # re-tokenised differs
    with pytest.raises(BadRequest, match="must repeat its 3 messages"):
        log.context("e1", [{"role": "user", "content": "What is c?"}, *said[1:], *tool], ())
    [record, missing] = log.collect(["e1", "e2"])
    assert missing is None and log.collect(["e1"]) == [None]
    assert record["token_ids"] == sampled + more and record["versions"] == [3]
    assert record["sampled"] == [True] * len(sampled) + [False] * len(more)
    assert record["logprobs"] == [-0.5] * len(sampled) + [0.0] * len(more)
    assert episode_of("policy#r0-7-2") == "r0-7-2" and episode_of("policy") is None
    assert turn_seed(0, "e1", 1) == turn_seed(0, "e1", 1) != turn_seed(0, "e1", 2)


def test_a_tool_call_comes_back_as_openai_tool_calls_and_its_echo_continues_the_episode(tok):
    """serving/openai_api.py: to a request with tools, a sampled `<tool_call>` block is
    answered as OpenAI `tool_calls` (content None) and finish reason "tool_calls"; the
    client sends that turn back with its own call id, JSON-string arguments and extra
    fields, then a tool message: the episode continues with the ids of the text as sampled,
    as for the plain echo. Other arguments are refused; a malformed block stays text."""
    from rlhf_dist.data.chat import Chat
    from rlhf_dist.serving.episodes import EpisodeLog
    from rlhf_dist.serving.openai_api import Message, _with_tool_calls
    from rlhf_dist.serving.policy import BadRequest

    log, render = EpisodeLog(Chat(tok, CHATML_TOOLS_TEMPLATE)), Renderer(tok, CHATML_TOOLS_TEMPLATE)
    user = [{"role": "user", "content": "What is b?"}]
    log.context("e1", user, ())
    sampled = call_turn(tok)
    text = tok.decode(sampled[:-1])
    reply = _with_tool_calls(text)
    [call] = reply["tool_calls"]
    assert reply["content"] is None and call["function"]["name"] == "lookup"
    assert json.loads(call["function"]["arguments"]) == {"key": "b"}
    log.answered("e1", sampled, [-0.5] * len(sampled), text, 3, reply)
    echo = {"role": "assistant", "content": None, "refusal": None, "tool_calls": [
        {"id": "call_9", "type": "function",
         "function": {"name": "lookup", "arguments": '{ "key":"b" }'}}]}  # fmt: skip
    tool = {
        "role": "tool",
        "tool_call_id": "call_9",
        "content": [{"type": "text", "text": "value-b"}],
    }
    sent = [Message(**m).as_dict() for m in (*user, echo, tool)]
    ids, turn, _ = log.context("e1", sent, ())
    said = [*user, {"role": "assistant", "content": text}]
    more = render.continuation_ids(said, [{"role": "tool", "content": "value-b"}])
    assert turn == 1 and ids == render.prompt_ids(user) + sampled + more
    log.context("e2", user, ())
    log.answered("e2", sampled, [-0.5] * len(sampled), text, 3, reply)
    echo["tool_calls"][0]["function"]["arguments"] = '{"key": "c"}'
    with pytest.raises(BadRequest, match="must repeat its 2 messages"):
        log.context("e2", [Message(**m).as_dict() for m in (*user, echo, tool)], ())
    broken = text.replace('"name"', "name")
    assert _with_tool_calls(broken) == {"role": "assistant", "content": broken}
    assert _with_tool_calls("It is b.") == {"role": "assistant", "content": "It is b."}


def test_serve_tool_call_parser_none_leaves_the_call_in_the_text(tok):
    """chat_completion over a stand-in policy that samples a tool call: with tools and
    the parser (serve.tool_call_parser=hermes) OpenAI tool_calls and "tool_calls"; with
    `none`, or without tools, the text as content and "stop"."""
    from types import SimpleNamespace

    from rlhf_dist.data.chat import Chat
    from rlhf_dist.serving.episodes import EpisodeLog
    from rlhf_dist.serving.openai_api import ChatBody, chat_completion
    from rlhf_dist.serving.policy import BadRequest

    sampled = call_turn(tok)
    policy = SimpleNamespace(
        chat=Chat(tok, CHATML_TOOLS_TEMPLATE), tokenizer=tok, name="p", vision=None,
        generate=lambda prompts, s, media=None: {"responses": [sampled], "finished": [True],
                                     "logprobs": [[-0.5] * len(sampled)], "version": 1},
    )  # fmt: skip
    tools = [tool_schema(lookup)]
    body = ChatBody(messages=[{"role": "user", "content": "What is b?"}], tools=tools)
    for parse, with_tools, finish in ((True, True, "tool_calls"), (False, True, "stop"),
                                      (True, False, "stop")):  # fmt: skip
        asked = body if with_tools else body.model_copy(update={"tools": None})
        log = EpisodeLog(policy.chat)
        [choice] = chat_completion(policy, asked, 16, log, tool_calls=parse)["choices"]
        assert choice["finish_reason"] == finish
        assert choice["token_ids"] == sampled
        message = choice["message"]
        if finish == "tool_calls":
            assert message["content"] is None and len(message["tool_calls"]) == 1
        else:
            assert message == {"role": "assistant", "content": tok.decode(sampled[:-1])}
    hidden = SimpleNamespace(**{**vars(policy), "chat": Chat(tok, IGNORES_TOOLS)})
    with pytest.raises(BadRequest, match=r"^tools: .*does not show tools.*chatml_tools"):
        chat_completion(hidden, body, 16, EpisodeLog(hidden.chat))
    no_tools = body.model_copy(update={"tools": None})  # a plain chat is served as before
    assert chat_completion(hidden, no_tools, 16, EpisodeLog(hidden.chat))["choices"]


def test_endpoint_episodes_are_collected_in_order_and_failures_are_one_line():
    """rollout/endpoint.py over a stand-in server: the records come back in prompt order
    with the environment's rewards; an environment that raises, one that never asks the
    model, and a record sampled by another policy version each stop the rollout."""
    from types import SimpleNamespace

    from rlhf_dist.errors import ServerError, UserError
    from rlhf_dist.rollout.endpoint import EndpointAgent, play

    def record(i, version=2):
        return {"messages": [{"role": "user", "content": f"q{i}"},
                             {"role": "assistant", "content": f"a{i}"}],
                "prompt_ids": [1, i], "token_ids": [7, i], "sampled": [True, True],
                "logprobs": [-0.1, -0.2], "versions": [version]}  # fmt: skip

    def server(records):
        asked = []

        def call(url, path, body):
            asked.append(body["episodes"])
            return {"episodes": [records(int(e.rsplit("-", 1)[1])) for e in body["episodes"]]}

        return SimpleNamespace(
            urls=["http://a"], token="t", version=2, timeout_s=60, call=call, http=None
        ), asked

    def env(client, prompt, answer):
        assert client.model.startswith("policy#") and client.sampling["temperature"] == 0.7
        return float(answer)

    gen, stops = gen_cfg(), (1,)
    fake, asked = server(record)
    episodes = play(EndpointAgent(env, 2), fake, ["q0", "q1", "q2"],
                    [{"answer": 0}, {"answer": 1}, {"answer": 2}], gen, stops)  # fmt: skip
    assert [e.reward for e in episodes] == [0.0, 1.0, 2.0] and len(asked) == 1
    assert [e.tokens for e in episodes] == [[7, 0], [7, 1], [7, 2]]
    assert [e.answer for e in episodes] == ["a0", "a1", "a2"] and episodes[0].turns == 1

    def broken(client, prompt):
        raise ValueError("no tool")

    with pytest.raises(UserError, match=r"^generation.environment: episode 0 raised ValueError: no tool$"):  # fmt: skip
        play(EndpointAgent(broken, 2), fake, ["q0"], [{}], gen, stops)
    silent, _ = server(lambda i: None)
    with pytest.raises(UserError, match="made no chat request"):
        play(EndpointAgent(env, 2), silent, ["q0"], [{"answer": 0}], gen, stops)
    stale, _ = server(lambda i: record(i, version=1))
    with pytest.raises(ServerError, match="sampled with policy versions"):
        play(EndpointAgent(env, 2), stale, ["q0"], [{"answer": 0}], gen, stops)


# ---------------------------------------------------------------------------- config


def test_multi_turn_config_errors():
    base = {"model": {"policy": "p"}, "reward": {"function": "m:f"}, "data": {"train": "x"}}

    def check(generation, ppo=None):
        tree = {
            **base,
            "generation": generation,
            "ppo": {"samples_per_prompt": 2, **(ppo or {"estimator": "grpo"})},
        }
        validate(config_from_dict(tree), "ppo")

    check({"tools": ["m:f"]})  # fine
    check({"tools": ["m:f"], "backend": "vllm"})  # the engine samples each turn
    check({"tools": ["m:f"]}, {"estimator": "gae"})  # across tool tokens (docs/agents.md)
    with pytest.raises(ConfigError, match="not together"):
        check({"tools": ["m:f"], "environment": "m:g"})
    with pytest.raises(ConfigError, match="max_turns"):
        check({"environment": "m:g", "max_turns": 0})


IGNORES_TOOLS = (  # SmolLM2's template as it ships, in short: no `tools` anywhere
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_tools_with_a_template_that_hides_them_are_an_error_naming_the_key(tok):
    """generation.tools when the chat template ignores `tools` (the policy would never see
    what it may call): a ConfigError naming data.chat_template and the template that
    shows them; data.chat_template: chatml_tools builds the agent."""
    from rlhf_dist.rollout.agent import build_agent

    tree = {"generation": {"tools": ["test_unit_agent:lookup"]}}
    hidden = copy.deepcopy(tok)
    hidden.chat_template = IGNORES_TOOLS
    with pytest.raises(
        ConfigError, match=r"^data\.chat_template: .*does not show the tools.*chatml_tools"
    ):
        build_agent(config_from_dict(tree), hidden)
    named = config_from_dict({**tree, "data": {"chat_template": "chatml_tools"}})
    agent = build_agent(named, hidden)
    assert agent is not None and agent.renderer.template == CHATML_TOOLS_TEMPLATE
    assert "lookup" in agent.renderer.render([{"role": "user", "content": "b?"}], True)


def test_a_requested_call_is_read_from_openai_tool_calls_or_the_text():
    """agent.requested_call (ToolEnvironment.step, the endpoint demo's episodes): an OpenAI
    tool_calls entry (JSON-string arguments), else a <tool_call> block of the text; a
    malformed one of either form is a ToolCallError for the model to read."""
    from rlhf_dist.rollout.agent import ToolCallError, requested_call

    openai_form = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": '{"key": "b"}'}}]}  # fmt: skip
    assert requested_call(openai_form) == ("lookup", {"key": "b"})
    assert requested_call({"role": "assistant", "content": CALL}) == ("lookup", {"key": "b"})
    assert requested_call({"role": "assistant", "content": "It is b."}) is None
    openai_form["tool_calls"][0]["function"]["arguments"] = "{key"
    with pytest.raises(ToolCallError, match="not valid JSON"):
        requested_call(openai_form)


def test_a_tool_calls_json_arguments_reach_the_template_as_a_dict(tok):
    """OpenAI clients send a call's arguments as JSON text; templates that write them with
    `tojson` (Qwen's, Hermes', Llama 3.1's) would quote that text, so the server hands the
    template a dict (text that is not JSON stays as it came)."""
    from rlhf_dist.data.chat import Chat
    from rlhf_dist.serving.openai_api import Message

    def said(arguments):
        call = {"id": "c1", "type": "function",
                "function": {"name": "lookup", "arguments": arguments}}  # fmt: skip
        return Message(role="assistant", content=None, tool_calls=[call]).as_dict()

    message = said('{"key": "b"}')
    assert message["tool_calls"][0]["function"]["arguments"] == {"key": "b"}
    assert message["content"] == ""
    assert said("{key")["tool_calls"][0]["function"]["arguments"] == "{key"
    qwen_like = (
        "{% for m in messages %}{% for c in m.get('tool_calls') or [] %}"
        '{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}'
        "{% endfor %}{% endfor %}"
    )
    text = Chat(tok, qwen_like).render([message], generation_prompt=False)
    assert text == '{"name": "lookup", "arguments": {"key": "b"}}'


class ScriptedServers:
    """ServerEngine's `request` and `responses` (the real one) over a scripted policy: each
    turn's seed recorded, answered under `version` (`bump`: a sync landing after the first
    turn, which moves it)."""

    partial, responses = False, ServerEngine.responses

    def __init__(self, tok, bump: bool = False):
        self.tok, self.bump, self.version, self.seeds = tok, bump, 3, []
        self.model = Scripted(turn_policy(tok, [call_turn(tok), answer_turn(tok)]), len(tok))

    def request(self, ids, mask, gen, stop_ids, media=None, generator=None):
        seed = int(sampling_seeds(1, generator=generator)[0])

        def ask():
            self.seeds.append(seed)
            out = generate(self.model, ids, mask, gen, self.tok, None, stop_ids).tolist()
            answer = {
                "version": self.version,
                "responses": out,
                "logprobs": [[0.0] * len(r) for r in out],
            }
            self.version += self.bump
            return [("http://s", answer)]

        return ask


def test_episodes_played_through_the_servers_seed_their_turns_when_named(tok):
    """agent.request_episodes (generation.backend=server; with ppo.max_staleness on the
    prefetch worker): the turns' seeds come from a generator seeded when the episodes are
    named, so what the main thread draws before they play changes nothing; every turn's
    answers must carry the servers' version when the work starts, so a sync landing
    mid-episode is a ServerError, not a rollout of two versions."""
    agent, servers = make_agent(tok, {"lookup": lookup}), ScriptedServers(tok)

    def played(draw_between: bool):
        torch.manual_seed(0)
        work = request_episodes(agent, servers, ["What is b?"], [{}], gen_cfg(), tok, stops(tok))
        if draw_between:  # the main thread trains meanwhile
            torch.rand(100)
        servers.seeds = []
        return work(), servers.seeds

    [e], seeds = played(draw_between=False)
    assert (e.turns, e.tool_calls, e.answer) == (2, 1, "It is value-b.")
    assert len(set(seeds)) == 2 and played(draw_between=True)[1] == seeds
    torch.manual_seed(0)
    moving = ScriptedServers(tok, bump=True)
    work = request_episodes(agent, moving, ["What is b?"], [{}], gen_cfg(), tok, stops(tok))
    with pytest.raises(
        ServerError, match="sampled with policy version 4, the trainer synced version 3"
    ):
        work()
