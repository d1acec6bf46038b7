"""Frozen rewards: a user's reward function or a reward model, and scoring token
sequences with a reward model on every rank (the rephrasing probe of docs/rm_diagnostics.md).

Shared by PPO (rollout scores), reward-model training (held-out diagnostics) and
`rlhf-dist eval`, so it lives outside the trainers.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import numbers
from collections.abc import Awaitable, Callable, Collection, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from rlhf_dist.algo.masking import last_token_index
from rlhf_dist.config import Config, ModelConfig, PerfConfig, RewardConfig
from rlhf_dist.data.chat import BadRow, Chat, is_stop, prompt_text, stop_token_ids
from rlhf_dist.data.inputs import (
    accepted_columns,
    column_lists,
    is_model_name,
    is_python,
    required_parameters,
    resolve_callable,
)
from rlhf_dist.data.rows import close_with_stop, encode_response, right_pad
from rlhf_dist.distributed import Runtime, lockstep_map
from rlhf_dist.engine.forward import DEFAULT_PERF
from rlhf_dist.errors import ConfigError, RewardFunctionError
from rlhf_dist.models import (
    ValueModel,
    frozen_dtype,
    load_causal_lm,
    load_sequence_classifier,
    load_tokenizer,
    policy_stop_ids,
    sequence_scores,
    tokenizer_for,
)
from rlhf_dist.observability import diagnostics as diag
from rlhf_dist.rewards.judge import JudgeReward, LocalJudge, Prompt
from rlhf_dist.rewards.remote import ChatJudgeClient, RemoteReward
from rlhf_dist.rewards.retry import call_with_retries
from rlhf_dist.stats import StatSums

if TYPE_CHECKING:  # transformers loads only where a model or tokenizer does
    from transformers import PreTrainedTokenizerBase


class RewardFunction:
    """A user's reward -> list[float], one score per response, checked on every call.

    fn: a `module:callable` spec (reward.function) or the callable itself (the Python API);
    messages name it by its spec, or by its `__qualname__` for a callable (a `python:`
    spec of the API included). Two calling conventions, told apart by fn's signature
    (`trl_convention`, docs/rewards.md):
    - TRL's: fn(prompts=..., completions=..., completion_ids=..., **columns), completions
      as TRL gives them: texts, or for a conversational prompt a one-message list
      [{"role": "assistant", "content": text}]; completion_ids the sampled token ids of
      each response, up to and including its stop token;
    - ours otherwise: fn(prompts, responses, **columns), responses the sampled texts.
    prompts: each prompt as its data row gave it, a text or a list of {role, content}
    messages; stop tokens are removed from the responses. columns: the rows' other columns
    (data.train's `answer`, `solution`, ...), one list per column, those fn names as
    parameters, or all with **kwargs. A parameter without default that nobody provides is
    a RewardFunctionError naming it (`missing_columns` checks it before a run), raised at
    once: a signature mismatch is a bug in the function, not a transient failure. A score
    of None means "does not apply to this row" (TRL's rule): NaN in the returned scores.

    An exception or a timeout (`timeout_s`, None: wait for ever) is retried `retries` times,
    after retry_delay_s, 2 x retry_delay_s, ... (exponential backoff): remote rewards,
    judges and sandboxes fail transiently in long runs. With a timeout the function runs in
    a worker thread and the caller stops waiting after timeout_s; a thread cannot be
    killed, so a call that hangs keeps running in the background (a daemon thread, its
    result dropped). A malformed result (wrong count, non-finite, not a number) is a bug in
    the function, not a transient failure: never retried. Whatever ends the calls is a
    RewardFunctionError (docs/architecture.md section 7 says what the run does then).
    """

    def __init__(
        self,
        fn: str | Callable[..., Any],
        retries: int = 0,
        retry_delay_s: float = 1.0,
        timeout_s: float | None = None,
        key: str = "reward.function",
    ) -> None:
        if isinstance(fn, str):
            spec, fn = fn, resolve_callable(fn, key)
            self.name = component_name(fn) if is_python(spec) else spec
        else:
            self.name = getattr(fn, "__qualname__", type(fn).__qualname__)
        if not callable(fn):
            raise ConfigError(f"{key}: {self.name!r} is not callable")
        self.fn, self.key, self.retries = fn, key, retries
        self.retry_delay_s, self.timeout_s = retry_delay_s, timeout_s
        self.trl_style = trl_convention(fn)

    @property
    def label(self) -> str:
        """What messages call it: the config key and the function's name."""
        return f"{self.key} {self.name}"

    def missing_columns(self, available: Collection[str]) -> list[str]:
        """The parameters fn requires that name none of the `available` columns."""
        given = TRL_ARGUMENTS if self.trl_style else ()
        need = required_parameters(self.fn, skip=0 if self.trl_style else 2)
        return [n for n in need if n not in given and n not in set(available)]

    def arguments(
        self,
        prompts: Sequence[Prompt],
        responses: Sequence[str],
        columns: dict[str, list],
        completion_ids: list[list[int]] | None = None,
        extras: dict[str, Any] | None = None,
    ) -> tuple[tuple, dict[str, Any]]:
        """(positional, keyword) arguments of fn's call in its convention; extras: the
        run's keywords (trainer_state, log_extra, log_metric) TRL passes every reward; a
        RewardFunctionError naming the parameter nobody provides if they do not bind."""
        if self.trl_style:
            completions = [
                [{"role": "assistant", "content": r}] if isinstance(p, list) else r
                for p, r in zip(prompts, responses)
            ]
            given: dict[str, Any] = {"prompts": prompts, "completions": completions}
            if completion_ids is not None:
                given["completion_ids"] = completion_ids
            given |= extras or {}
            extra = accepted_columns(self.fn, columns, TRL_ARGUMENTS)
            args: tuple = ()
            kwargs = accepted_columns(self.fn, given) | extra
        else:
            args = (prompts, responses)
            kwargs = accepted_columns(self.fn, columns, ("prompts", "responses"))
        self._check_binds(args, kwargs)
        return args, kwargs

    def _check_binds(self, args: tuple, kwargs: dict[str, Any]) -> None:
        """A RewardFunctionError at once when fn's signature does not take (args, kwargs):
        calling it would raise a TypeError that no retry can mend."""
        try:
            sig = inspect.signature(self.fn)
        except (TypeError, ValueError):  # no signature to read: the call will tell
            return
        try:
            sig.bind(*args, **kwargs)
        except TypeError as e:
            given = ", ".join(kwargs) if not args else "prompts, responses (positional)"
            missing = [n for n in required_parameters(self.fn, len(args)) if n not in kwargs]
            what = f"the argument {missing[0]}, which nobody provides" if missing else str(e)
            raise RewardFunctionError(
                f"{self.label} wants {what} (it is given: {given or 'nothing'}); "
                "see docs/rewards.md for what a reward receives"
            ) from None

    def __call__(
        self,
        prompts: Sequence[Prompt],
        responses: Sequence[str],
        columns: list[dict] | None = None,
        completion_ids: list[list[int]] | None = None,
        extras: dict[str, Any] | None = None,
    ) -> torch.Tensor:
        """Scores (B,) of B responses; columns: each row's other columns (None: none);
        completion_ids: each response's sampled token ids (None: not known here);
        extras: trainer_state, log_extra and log_metric for a function in TRL's convention."""
        by_name = column_lists(columns or [{} for _ in responses])
        missing = self.missing_columns(by_name)
        if missing:
            raise RewardFunctionError(
                f"{self.label} needs the column(s) {', '.join(missing)}, which "
                f"the data rows do not have (they have: {', '.join(by_name) or 'no other'})"
            )
        args, kwargs = self.arguments(prompts, responses, by_name, completion_ids, extras)
        out = call_with_retries(
            lambda: list(awaited(self.fn(*args, **kwargs))),
            self.label,
            self.retries,
            self.retry_delay_s,
            self.timeout_s,
        )
        if len(out) != len(responses):
            raise RewardFunctionError(
                f"{self.label} returned {len(out)} scores for {len(responses)} responses"
            )
        bad = [v for v in out if v is not None and not _is_finite_number(v)]
        if bad:
            raise RewardFunctionError(
                f"{self.label} returned a non-finite or non-number: {bad[0]!r}"
            )
        return torch.tensor([NOT_APPLICABLE if v is None else float(v) for v in out])


# A score of None ("this reward does not apply to this row", TRL's rule) as a RewardFunction
# returns it: NaN, which WeightedReward leaves out of the row's sum and the Scorer counts as
# a skipped row where no component applies (trainers/ppo/rollout.py masks it out).
NOT_APPLICABLE = float("nan")

# what TRL's GRPOTrainer passes every reward function by keyword besides the row's columns
TRL_ARGUMENTS = (
    "prompts",
    "completions",
    "completion_ids",
    "trainer_state",
    "log_extra",
    "log_metric",
)
# the samples table's own columns (trainers/ppo/stats.py sample_rows), which log_extra
# cannot overwrite
SAMPLE_COLUMNS = ("step", "prompt", "prompt_index", "response", "score", "kl", "length")


@dataclass(frozen=True)
class RewardTrainerState:
    """TRL's `trainer_state` as a reward reads it, for curricula: global_step, the
    optimizer steps done before this rollout; epoch, the passes over data.train's prompts
    done (a float, as TRL's); max_steps, the run's optimizer steps in all."""

    global_step: int = 0
    epoch: float = 0.0
    max_steps: int = 0


def is_async(fn: object) -> bool:
    """Whether `fn` (a RewardFunction or a callable) is an `async def` reward."""
    inner = getattr(fn, "fn", fn)  # a RewardFunction's callable
    method = type(inner).__call__ if not inspect.isroutine(inner) else None
    return inspect.iscoroutinefunction(inner) or inspect.iscoroutinefunction(method)


def trl_convention(fn: Callable[..., Any]) -> bool:
    """Whether fn is called in TRL's convention (all by keyword) rather than ours
    (prompts, responses positional): TRL's rule, so that functions written for TRL run
    unchanged. TRL's when every parameter can be passed by keyword (no positional-only
    ones, no *args) and fn names `completions` or `completion_ids`, or takes keyword-only
    parameters or **kwargs alone; ours otherwise, and when the signature cannot be read."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return False
    kinds = {p.kind for p in params}
    if kinds & {inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.VAR_POSITIONAL}:
        return False
    names = {p.name for p in params if p.kind != inspect.Parameter.VAR_KEYWORD}
    if names & {"completions", "completion_ids"}:
        return True
    return bool(kinds) and inspect.Parameter.POSITIONAL_OR_KEYWORD not in kinds


def awaited(result: Any) -> Any:
    """`result`, or what it gives when awaited (an `async def` reward's coroutine), run to
    completion on an event loop of its own: in this thread, or in a new one where this
    thread already runs a loop (a notebook's)."""
    if not inspect.isawaitable(result):
        return result
    try:
        asyncio.get_running_loop()
    except RuntimeError:  # no loop in this thread: the usual case
        return asyncio.run(_wrapped(result))
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, _wrapped(result)).result()


async def _wrapped(awaitable: Awaitable[Any]) -> Any:
    return await awaitable


def _is_finite_number(v: object) -> bool:
    """A real, finite number (python, numpy or 0-dim torch), never a bool or a string."""
    if isinstance(v, (bool, str, bytes)) or not isinstance(v, numbers.Real | torch.Tensor):
        return False
    try:
        return math.isfinite(float(v))
    except (TypeError, ValueError):
        return False


class WeightedReward:
    """Several text rewards combined: score = sum_i weight_i x f_i(prompts, responses)
    (reward.functions, reward.url, reward.judge; docs/rewards.md).

    components: (name, weight, RewardFunction) each, names unique; each has the run's
    retries and timeout, and any one's failure is the whole call's (a RewardFunctionError,
    kept by the Scorer so ranks stay in step). Per-component sums since the last
    `take_sums` are kept for objective/score_<name>; judge: the JudgeReward among them
    (its parse failures are counted), or None.
    """

    def __init__(
        self,
        components: list[tuple[str, float, Callable[..., torch.Tensor]]],
        judge: JudgeReward | None = None,
    ) -> None:
        self.components, self.judge = components, judge
        self.sums: dict[str, tuple[float, int]] = {name: (0.0, 0) for name, _, _ in components}
        self.__qualname__ = "+".join(name for name, _, _ in components)

    def __call__(
        self,
        prompts: Sequence[Prompt],
        responses: Sequence[str],
        columns: list[dict] | None = None,
        completion_ids: list[list[int]] | None = None,
        extras: dict[str, Any] | None = None,
    ) -> torch.Tensor:
        """The weighted sum of the components' scores (B,), each component's sum kept.
        A component's None (NaN) leaves it out of that row's sum, TRL's rule; a row no
        component applies to is NaN (the Scorer counts it as skipped)."""
        call = (prompts, responses, columns, completion_ids, extras)
        parts = [
            (name, weight, scores)
            for (name, weight, _), scores in zip(self.components, self._scores(call))
        ]
        applies = torch.zeros(len(responses), dtype=torch.bool)
        total_scores = torch.zeros(len(responses))
        for name, weight, scores in parts:
            given = ~torch.isnan(scores)
            total, count = self.sums[name]
            self.sums[name] = (total + float(scores[given].sum()), count + int(given.sum()))
            total_scores = total_scores + torch.where(given, weight * scores, 0.0)
            applies |= given
        return torch.where(applies, total_scores, NOT_APPLICABLE)

    def _scores(self, call: tuple) -> list[torch.Tensor]:
        """Each component's scores of `call`, in order. The `async def` components run
        concurrently, as TRL gathers them: each in a thread of its own, with its own
        event loop, retries and timeout; the others one after the other in this thread
        (a reward using signals, math-verify's timeout, needs the main thread)."""
        concurrent = [i for i, (_, _, f) in enumerate(self.components) if is_async(f)]
        out: dict[int, torch.Tensor] = {}
        with ThreadPoolExecutor(max(1, len(concurrent))) as pool:
            futures = {i: pool.submit(self.components[i][2], *call) for i in concurrent}
            for i, (_, _, fn) in enumerate(self.components):
                if i not in futures:
                    out[i] = fn(*call)
            out |= {i: f.result() for i, f in futures.items()}
        return [out[i] for i in range(len(self.components))]

    def take_sums(self) -> dict[str, tuple[float, int]]:
        """{name: (sum of its scores, count)} since the last call (then reset), plus
        "judge_parse_failures": (count, 1) when a judge is a component."""
        out = dict(self.sums)
        self.sums = {name: (0.0, 0) for name in self.sums}
        if self.judge is not None:
            out["judge_parse_failures"] = (float(self.judge.take_counts()), 1)
        return out


class ModelReward:
    """A reward model named in reward.functions (TRL's model id or path in reward_funcs), as
    one component of a WeightedReward: each (prompt, response) in the model's own tokens,
    by the text round-trip `rlhf-dist rm` trains on (RewardInputs: closed with its stop
    tokens iff the response finished, i.e. its last sampled id is a policy stop id), scored
    by its head at the last token, as model.reward scores (sequence_scores)."""

    def __init__(self, model: ValueModel, inputs: RewardInputs, device: torch.device) -> None:
        self.model, self.inputs, self.device = model, inputs, device

    @torch.no_grad()
    def __call__(
        self,
        prompts: Sequence[Prompt],
        responses: Sequence[str],
        columns: list[dict] | None = None,
        completion_ids: list[list[int]] | None = None,
        extras: dict[str, Any] | None = None,
    ) -> torch.Tensor:
        """Scores (B,) float32 on CPU; completion_ids (None: every response finished)."""
        stops = set(self.inputs.policy_stop_ids)
        finished = [True] * len(responses)
        if completion_ids is not None:
            finished = [bool(ids) and ids[-1] in stops for ids in completion_ids]
        seqs = [self.inputs.sequence(p, r, f) for p, r, f in zip(prompts, responses, finished)]
        pad = self.inputs.tokenizer.pad_token_id
        ids, mask = right_pad(seqs, pad if pad is not None else 0)
        ids, mask = ids.to(self.device), mask.to(self.device)
        return sequence_scores(self.model, ids, mask, last_token_index(mask)).float().cpu()


def model_reward(
    runtime: Runtime,
    path: str,
    model_cfg: ModelConfig,
    policy_stops: tuple[int, ...],
    perf: PerfConfig = DEFAULT_PERF,
) -> ModelReward:
    """The reward model at `path` (a reward.functions entry) loaded as model.reward is (a
    sequence classifier in model.frozen_dtype, with its own tokenizer), replicated on every
    rank: it runs inside the reward functions' call, which a failing function can cut short
    on one rank, so its forwards must not be collectives (as a local judge's)."""
    key = "reward.functions"
    tok = load_tokenizer(path, model_cfg.trust_remote_code, key)
    chat = Chat(tok, tok.chat_template) if tok.chat_template else None
    inputs = RewardInputs(tok, chat, stop_token_ids(tok, chat), policy_stops)
    dtype = frozen_dtype(model_cfg)
    with runtime.local_loading():
        rm = load_sequence_classifier(path, key, dtype, model_cfg)
    rm = runtime.prepare_frozen(ValueModel(rm, perf), "replicate", dtype, "reward model")
    return ModelReward(rm, inputs, runtime.device)


def model_name(path: str) -> str:
    """A reward model's component name: the last part of its path or hub id (TRL's)."""
    return path.rstrip("/").rsplit("/", 1)[-1] or path


def check_reward_columns(reward_cfg: RewardConfig, available: Collection[str], where: str) -> None:
    """Before any model loads: a ConfigError naming the reward key whose function requires
    a column (a parameter without default) that the rows of `where` (e.g. data.train) do
    not have; `available`: their column names besides the prompt."""
    r = reward_cfg
    specs = [("reward.function", r.function)] + [("reward.functions", s) for s in r.functions]
    for key, spec in specs:
        if not spec or (key == "reward.functions" and is_model_name(spec)):
            continue  # a reward model reads no column
        fn = RewardFunction(spec, key=key)
        missing = fn.missing_columns(available)
        if missing:
            have = ", ".join(sorted(available)) or "no column besides the prompt"
            raise ConfigError(
                f"{key}: {fn.name} needs the column(s) {', '.join(missing)}, which {where} "
                f"does not have (it has: {have})"
            )


def unique_names(names: list[str]) -> list[str]:
    """names with later duplicates suffixed _2, _3, ... ("f", "f", "g" -> "f", "f_2", "g")."""
    out: list[str] = []
    seen: dict[str, int] = {}
    for name in names:
        seen[name] = seen.get(name, 0) + 1
        candidate = name if seen[name] == 1 else f"{name}_{seen[name]}"
        while candidate in out:
            seen[name] += 1
            candidate = f"{name}_{seen[name]}"
        out.append(candidate)
    return out


def component_name(fn: object) -> str:
    """A reward callable's __name__ (an object's class name where it has none)."""
    return getattr(fn, "__name__", type(fn).__name__)


def same_tokenizer(a: PreTrainedTokenizerBase, b: PreTrainedTokenizerBase) -> bool:
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

    tokenizer: PreTrainedTokenizerBase  # the reward model's
    chat: Chat | None  # its chat template (None: the tokenizer has none)
    stop_ids: tuple[int, ...]  # the reward model tokenizer's (chat.stop_token_ids)
    policy_stop_ids: tuple[int, ...]  # what ended a policy response

    def sequence(self, prompt: Prompt, response: str, finished: bool) -> list[int]:
        """The RM's token ids of prompt + response, closed (stop, EOS) iff `finished`."""
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

    def probe_response(self, prompt: Prompt, response: str) -> diag.Response | None:
        """The finished sequence of (prompt, response) split for the rephrasing probe
        (docs/rm_diagnostics.md): prompt part, the response's own encoding as the body,
        then what closes it (end-of-turn, EOS). None where the rendering does not hold
        those tokens there (a tokenizer merging across the boundary): no clean split."""
        ids = self.sequence(prompt, response, True)
        if isinstance(prompt, str):
            head = self.tokenizer(prompt)["input_ids"]
        else:
            assert self.chat is not None  # sequence() refuses a conversation without one
            head = self.chat.prompt_ids(prompt)
        body = self.tokenizer(response, add_special_tokens=False)["input_ids"]
        cut = len(head) + len(body)
        if ids[: len(head)] != head or ids[len(head) : cut] != body:
            return None
        return diag.Response(head, body, ids[cut:])

    def batch(
        self,
        prompts: Sequence[Prompt],
        responses: Sequence[str],
        input_ids: torch.Tensor,
        last_index: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(ids, attention mask, last index) of the RM's own tokens, right-padded; a
        response finished iff its last real token in `input_ids` (B, P+T) is a stop id."""
        ends = input_ids.gather(1, last_index.long().unsqueeze(1)).squeeze(1)
        finished = is_stop(ends, self.policy_stop_ids).tolist()
        seqs = [self.sequence(p, r, f) for p, r, f in zip(prompts, responses, finished)]
        ids, mask = right_pad(seqs, self.tokenizer.pad_token_id)
        ids, mask = ids.to(input_ids.device), mask.to(input_ids.device)
        return ids, mask, last_token_index(mask)


@dataclass
class Scorer:
    """Scores whole sequences with a reward model or a reward function.

    A reward function's failure (RewardFunctionError, after its retries) does not raise
    here: it is kept in `failure` and this and every later call return NaN scores, so a
    rank whose reward failed keeps taking part in the rollout's lock-step forwards; the
    caller then asks `raise_failure`, a collective, once every rank is done scoring.
    """

    reward_model: ValueModel | None = None
    reward_fn: Callable | None = None
    inputs: RewardInputs | None = None  # set: the RM reads its own tokens, not the policy's
    failure: RewardFunctionError | None = None
    skipped: int = 0  # rows no reward function applied to (all None) since component_stats
    # what a reward in TRL's convention reads as `trainer_state` (the trainer sets it)
    trainer_state: RewardTrainerState = RewardTrainerState()
    logged: dict[str, list[float]] = field(default_factory=dict)  # log_metric's values
    # log_extra's columns of each scored row in scoring order: (prompt as the samples
    # table prints it, response, columns) each (take_extra_columns)
    extra_columns: list[tuple[str, str, dict]] = field(default_factory=list)

    def log_metric(self, name: str, value: float) -> None:
        """TRL's `log_metric`: `value` into metrics.jsonl as reward/<name>, the mean of
        every value logged under that name this iteration, over all ranks."""
        self.logged.setdefault(str(name), []).append(float(value))

    def _keep_extra(
        self, prompts: Sequence[Prompt], responses: Sequence[str], pending: dict[str, list]
    ) -> None:
        """Each row's share of the columns a reward logged through TRL's `log_extra(column,
        values)` in one call (pending: column -> values, one per response), kept for the
        samples table; a column without one value per response, or named as one of the
        table's own, is a RewardFunctionError naming it."""
        for column, values in pending.items():
            if column in SAMPLE_COLUMNS or len(values) != len(responses):
                raise RewardFunctionError(
                    f"reward: log_extra({column!r}, values) was given {len(values)} values "
                    f"for {len(responses)} responses (one per response, and not a column "
                    f"of the samples table: {', '.join(SAMPLE_COLUMNS)})"
                )
        for i, (p, r) in enumerate(zip(prompts, responses)):
            row = {column: values[i] for column, values in pending.items()}
            self.extra_columns.append((prompt_text(p), r, row))

    def take_extra_columns(self, prompts: Sequence[Prompt], responses: Sequence[str]) -> list[dict]:
        """log_extra's columns of each (prompt, response) row: the first row scored with
        the same prompt and response not yet taken, else (a multi-turn episode is scored
        with its whole conversation as the prompt) the first with the same response;
        every row with every column any of them has (None where none was logged: a
        table's rows share their columns). Then forgets every row kept, so rows scored
        and dropped (dynamic sampling's tied groups) go too."""
        kept, self.extra_columns = self.extra_columns, []
        by_pair: dict[tuple[str, str], list[int]] = {}
        by_response: dict[str, list[int]] = {}
        for i, (shown, said, _) in enumerate(kept):
            by_pair.setdefault((shown, said), []).append(i)
            by_response.setdefault(said, []).append(i)
        used: set[int] = set()
        found = []
        for prompt, response in zip(prompts, responses):
            queues = (
                by_pair.get((prompt_text(prompt), response), []),
                by_response.get(response, []),
            )
            j = next((i for q in queues for i in q if i not in used), None)
            used.add(-1 if j is None else j)
            found.append({} if j is None else kept[j][2])
        columns = list(dict.fromkeys(c for row in found for c in row))
        return [{c: row.get(c) for c in columns} for row in found]

    @torch.no_grad()
    def __call__(
        self,
        prompts: Sequence[Prompt],
        responses: Sequence[str],
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        last_index: torch.Tensor,
        columns: list[dict] | None = None,
        completion_ids: list[list[int]] | None = None,
    ) -> torch.Tensor:
        """prompts: B prompts as given (texts or message lists); responses: B texts;
        input_ids/attention_mask (B, P+T) the policy's tokens; last_index (B,); columns:
        each row's other columns and completion_ids each response's sampled ids (reward
        functions read them, a reward model does not)."""
        if self.reward_fn is not None:
            scores = self._function_scores(prompts, responses, columns, completion_ids)
            return scores.to(input_ids.device)
        if self.inputs is not None:
            input_ids, attention_mask, last_index = self.inputs.batch(
                prompts, responses, input_ids, last_index
            )
        assert self.reward_model is not None, "a Scorer holds a reward model or a function"
        return sequence_scores(self.reward_model, input_ids, attention_mask, last_index).float()

    def _function_scores(
        self,
        prompts: Sequence[Prompt],
        responses: Sequence[str],
        columns: list[dict] | None = None,
        completion_ids: list[list[int]] | None = None,
    ) -> torch.Tensor:
        assert self.reward_fn is not None, "scores of texts need a reward function"
        if self.failure is None:
            try:
                if not isinstance(self.reward_fn, RewardFunction | WeightedReward):
                    return self.reward_fn(prompts, responses, columns)  # the trainers' own
                pending: dict[str, list] = {}

                def log_extra(column: str, values: Sequence[Any]) -> None:
                    pending.setdefault(str(column), []).extend(values)

                extras = {
                    "trainer_state": self.trainer_state,
                    "log_extra": log_extra,
                    "log_metric": self.log_metric,
                }
                scores = self.reward_fn(prompts, responses, columns, completion_ids, extras)
                self._keep_extra(prompts, responses, pending)
                self.skipped += int(torch.isnan(scores).sum())  # None: does not apply
                return scores
            except RewardFunctionError as e:
                self.failure = e
        return torch.full((len(responses),), float("nan"))

    def score_texts(
        self,
        prompts: Sequence[Prompt],
        responses: Sequence[str],
        columns: list[dict] | None = None,
    ) -> torch.Tensor:
        """The reward function's scores (B,) of texts alone, NaN once it failed (no raise:
        see the class docstring); for eval's judge win rate."""
        return self._function_scores(prompts, responses, columns)

    def missing_columns(self, available: Collection[str]) -> list[str]:
        """The data columns a reward function requires that `available` lacks (a reward
        model reads none); checked when a run starts, before any rollout."""
        fns = [self.reward_fn] if isinstance(self.reward_fn, RewardFunction) else []
        if isinstance(self.reward_fn, WeightedReward):
            fns = [f for _, _, f in self.reward_fn.components if isinstance(f, RewardFunction)]
        return sorted({name for f in fns for name in f.missing_columns(available)})

    def component_stats(self, runtime: Runtime) -> dict[str, float]:
        """objective/score_<name> (mean over all ranks' sequences since the last call) of
        each reward component, and objective/judge_parse_failures (the count, summed over
        ranks); with reward functions reward/skipped_rows, the rows no function applied to
        (every one returned None; summed over ranks) and reward/<name> of each metric a
        reward logged (log_metric: the mean over ranks); {} for a reward model. Every rank
        must call this (a collective: the rewards are the same on every rank)."""
        if not isinstance(self.reward_fn, RewardFunction | WeightedReward):
            return {}
        s = StatSums()
        s.add("skipped_rows", float(self.skipped), 0.0)  # count 0: reduce sums, not averages
        self.skipped = 0
        logged = self._logged_sums(runtime)
        if isinstance(self.reward_fn, WeightedReward):
            for name, (total, count) in self.reward_fn.take_sums().items():
                s.add(name, total, count)
        for name, (total, count) in logged.items():
            s.add("logged/" + name, total, count)
        out = s.reduce(runtime)
        if "judge_parse_failures" in out:
            out["judge_parse_failures"] *= runtime.world_size  # a count: summed, not averaged
        plain = ("judge_parse_failures",)
        own = {
            "reward/" + k[len("logged/") :]: out.pop(k)
            for k in list(out)
            if k.startswith("logged/")
        }
        skipped = {"reward/skipped_rows": out.pop("skipped_rows")}
        return (
            own
            | skipped
            | {
                f"objective/{name if name in plain else 'score_' + name}": v
                for name, v in out.items()
            }
        )

    def _logged_sums(self, runtime: Runtime) -> dict[str, tuple[float, int]]:
        """{name: (sum, count)} of log_metric's values since the last call (then cleared),
        with every name any rank logged (0, 0 where this one did not): the ranks reduce
        the same statistics in the same order. A collective."""
        names = sorted(set(runtime.gather_objects(sorted(self.logged))))
        sums = {n: (sum(self.logged.get(n, [])), len(self.logged.get(n, []))) for n in names}
        self.logged = {}
        return sums

    def raise_failure(self, runtime: Runtime) -> None:
        """Raise the reward failure of any rank on every rank (the first rank's message);
        clears it. Every rank must call this."""
        if not runtime.any_rank(self.failure is not None):
            return
        messages = runtime.gather_objects([str(self.failure)] if self.failure else [])
        cause, self.failure = self.failure, None
        raise RewardFunctionError(messages[0]) from cause


def policy_stops_for(cfg: Config) -> tuple[int, ...]:
    """The ids that end a policy response where a reward model in reward.functions reads
    them (ModelReward), else () without loading the policy's tokenizer."""
    if not any(is_model_name(spec) for spec in cfg.reward.functions):
        return ()
    return policy_stop_ids(cfg, tokenizer_for(cfg, "policy"))


def reward_inputs_for(cfg: Config) -> RewardInputs | None:
    """RewardInputs when model.reward's tokenizer differs from the policy's (vocabulary,
    specials or template); None when they agree, model.tokenizer is shared by all models,
    or a reward function scores."""
    m = cfg.model
    if cfg.reward.text_rewards() or not m.reward or m.tokenizer:
        return None
    policy_tok = tokenizer_for(cfg, "policy")
    rm_tok = load_tokenizer(m.reward, m.trust_remote_code, "model.reward")
    if same_tokenizer(policy_tok, rm_tok):
        return None
    chat = Chat(rm_tok, rm_tok.chat_template) if rm_tok.chat_template else None
    stops = stop_token_ids(rm_tok, chat)
    return RewardInputs(rm_tok, chat, stops, policy_stop_ids(cfg, policy_tok))


def build_scorer(
    runtime: Runtime,
    reward_function: str | Callable[..., Any] | None,
    model_cfg: ModelConfig,
    placement: str,
    inputs: RewardInputs | None = None,
    reward_cfg: RewardConfig | None = None,
    perf: PerfConfig = DEFAULT_PERF,
    policy_stops: tuple[int, ...] = (),
) -> Scorer:
    """The frozen reward: `reward_function` if set ("module:callable" or a callable; its
    retries and timeout from `reward_cfg`, the reward section), else model_cfg.reward
    loaded as a ValueModel and prepared as a frozen model with `placement`
    (distributed.frozen_models, or "replicate"), reading `inputs` (its own tokens,
    reward_inputs_for) if given. A reward model's forward is not retried: it is local
    computation, and under ZeRO-3 a collective that one rank cannot repeat alone. perf:
    the speed paths of the reward model's and a local judge's forwards; policy_stops: the
    ids that end a policy response (policy_stops_for), for a reward model in
    reward.functions."""
    if reward_cfg is not None and (
        reward_cfg.functions or reward_cfg.url or reward_cfg.judge != "none"
    ):
        fn = weighted_reward(runtime, reward_cfg, model_cfg, reward_function, perf, policy_stops)
        return Scorer(reward_fn=fn)
    if reward_function:
        return Scorer(reward_fn=RewardFunction(reward_function, **retry_settings(reward_cfg)))
    m, dtype = model_cfg, frozen_dtype(model_cfg)
    with runtime.local_loading():
        rm = load_sequence_classifier(m.reward, "model.reward", dtype, m)
    rm = runtime.prepare_frozen(ValueModel(rm, perf), placement, dtype, "reward model")
    return Scorer(reward_model=rm, inputs=inputs)


def weighted_reward(
    runtime: Runtime,
    reward_cfg: RewardConfig,
    model_cfg: ModelConfig,
    reward_function: str | Callable[..., Any] | None = "",
    perf: PerfConfig = DEFAULT_PERF,
    policy_stops: tuple[int, ...] = (),
) -> WeightedReward:
    """The components of reward.function or reward.functions (weights reward.weights, 1
    each by default), reward.url (reward.url_weight) and reward.judge (reward.judge_weight),
    each a RewardFunction with the run's retries and timeout (an HTTP component retries
    each request itself: remote.HTTPClient), or for a reward.functions entry naming a
    reward model a ModelReward (policy_stops: the ids that end a policy response)."""
    r, retry = reward_cfg, retry_settings(reward_cfg)
    specs: list[str | Callable[..., Any]] = list(r.functions)
    specs = specs or ([reward_function] if reward_function else [])
    weights = list(r.weights) or [1.0] * len(specs)
    fns: list[Callable[..., Any]] = []
    names: list[str] = []
    for spec in specs:
        if r.functions and isinstance(spec, str) and is_model_name(spec):
            fns.append(model_reward(runtime, spec, model_cfg, policy_stops, perf))
            names.append(model_name(spec))
        else:
            fn = RewardFunction(spec, **retry)
            fns.append(fn)
            names.append(component_name(fn.fn))
    no_retry: dict[str, Any] = {"retries": 0, "timeout_s": None}
    judge = None
    if r.url:
        fns.append(RewardFunction(RemoteReward(r), key="reward.url", **no_retry))
        names, weights = names + ["remote"], weights + [r.url_weight]
    if r.judge != "none":
        judge = build_judge_reward(runtime, r, model_cfg, perf)
        retry_judge = no_retry if r.judge == "url" else retry
        fns.append(RewardFunction(judge, key="reward.judge", **retry_judge))
        names, weights = names + ["judge"], weights + [r.judge_weight]
    return WeightedReward(list(zip(unique_names(names), weights, fns)), judge)


def build_judge_reward(
    runtime: Runtime,
    reward_cfg: RewardConfig,
    model_cfg: ModelConfig,
    perf: PerfConfig = DEFAULT_PERF,
) -> JudgeReward:
    """judge.JudgeReward over a local causal LM (reward.judge=model: loaded whole and
    replicated on every rank in model.dtype, frozen) or an OpenAI-compatible endpoint."""
    r = reward_cfg
    judge: ChatJudgeClient | LocalJudge
    if r.judge == "url":
        judge = ChatJudgeClient(r)
    else:
        tok = load_tokenizer(r.judge_model, model_cfg.trust_remote_code, "reward.judge_model")
        dtype = frozen_dtype(model_cfg)
        with runtime.local_loading():
            lm = load_causal_lm(r.judge_model, "reward.judge_model", dtype, model_cfg)
        lm = runtime.prepare_frozen(lm, "replicate", dtype, "judge")
        judge = LocalJudge(
            lm, tok, r.judge_max_new_tokens, r.remote_batch_size, runtime.device, perf
        )
    return JudgeReward(judge, r.judge_template, r.judge_fallback_score)


def retry_settings(reward_cfg: RewardConfig | None) -> dict:
    """RewardFunction's retries, retry_delay_s and timeout_s from the reward section (None:
    no retries, no timeout)."""
    if reward_cfg is None:
        return {"retries": 0, "timeout_s": None}
    r = reward_cfg
    return {"retries": r.retries, "retry_delay_s": r.retry_delay_s, "timeout_s": r.timeout_s}


@torch.no_grad()
def score_sequences(
    runtime: Runtime, value_model: ValueModel, seqs: list[list[int]], batch_size: int, pad_id: int
) -> torch.Tensor:
    """Scores (len(seqs),) on CPU of whole token sequences, each read at its last token.

    Every rank must call this, each with its own seqs (lock-step passes:
    distributed/lockstep.py).
    """

    def forward(chunk: list[list[int]]) -> torch.Tensor:
        ids, mask = right_pad(chunk, pad_id)
        ids, mask = ids.to(runtime.device), mask.to(runtime.device)
        return sequence_scores(value_model, ids, mask, last_token_index(mask)).float().cpu()

    out = lockstep_map(runtime, seqs, batch_size, forward, [[pad_id]])
    return torch.cat(out) if out else torch.zeros(0)


def probe_rephrasings(
    runtime: Runtime,
    value_model: ValueModel,
    responses: Sequence[diag.Response],
    scores: diag.Numbers,
    filler: list[int],
    batch_size: int,
    pad_id: int,
) -> dict:
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
