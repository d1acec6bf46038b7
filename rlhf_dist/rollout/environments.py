"""A verifiers environment as the episode function of generation.environment_endpoint
(`generation.environment: verifiers:ENV_ID?...`; docs/agents.md, "verifiers environments").

verifiers (PyPI, its classic `Environment` API) plays one rollout with
`env.run_rollout(input, client, model, sampling_args)`: it sends the policy chat requests
through an OpenAI client, runs its own tools or game rules between turns, and scores the
finished rollout with its rubric. Here the client is an `openai.AsyncOpenAI` pointed at a
rollout server's endpoint, `model` the name that carries the episode id, and
`sampling_args` the run's generation keys, so the server records the episode token in,
token out (serving/episodes.py) and the rubric's reward is the episode's reward. The row's
columns (a `data.train: verifiers:ENV_ID` row has `answer`, `example_id` and whatever
else the environment's dataset holds: `info`, `task`) go to verifiers as its own
evaluations pass a dataset row.

verifiers ends a rollout early when the policy answers with nothing or writes a tool call
it cannot parse or run; the rubric scores it as any other ending (as in verifiers' own
evaluations). A rollout it ended for anything else (a refused or failed request, the
environment's own error) stops the run with one line. Each episode runs its own event loop
on the thread rollout/endpoint.py `play` gives it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeAlias

from rlhf_dist.config.environments import is_environment_spec
from rlhf_dist.data.environments import environment
from rlhf_dist.data.rows import Text

if TYPE_CHECKING:
    from rlhf_dist.rollout.endpoint import EndpointClient

# episode(client, prompt, **columns) -> the episode's reward (None: reward.function scores
# the final answer); rollout/endpoint.py calls it once per prompt row
EpisodeFunction: TypeAlias = Callable[..., float | None]


@dataclass(frozen=True)
class VerifiersEpisode:
    """episode(client, prompt, **columns) -> reward over a verifiers environment."""

    env: Any  # a verifiers Environment

    def __call__(self, client: EndpointClient, prompt: Text, **columns: Any) -> float:
        """One verifiers rollout of `prompt` (a text: one user message) through `client`,
        the row's other columns beside it -> the rubric's reward."""
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        # the row as verifiers' own evaluations pass a dataset row (prompt, example_id and
        # whatever else it holds: answer, info, task)
        row = {"example_id": 0, **columns, "prompt": messages}
        output = asyncio.run(self._rollout(client, row))
        if output.get("error") and not _policys_own(output["error"]["error"]):
            raise RuntimeError(f"the verifiers rollout failed: {output.get('error_chain')}")
        return float(output["reward"])

    async def _rollout(self, client: EndpointClient, row: dict[str, Any]) -> dict[str, Any]:
        import openai
        import verifiers

        # no retries: a refused request is a bug to report, and a timeout is the server's
        http = openai.AsyncOpenAI(
            base_url=client.base_url,
            api_key=client.api_key,
            timeout=client.timeout_s,
            max_retries=0,
        )
        try:
            chat = verifiers.OpenAIChatCompletionsClient(http)
            return await self.env.run_rollout(row, chat, client.model, client.openai_fields)
        finally:
            await http.close()


def _policys_own(error: str) -> bool:
    """Whether verifiers ended the rollout for what the policy wrote (an empty or invalid
    answer, a tool call it cannot parse or run), which the rubric then scores as any
    other ending, rather than for a failed request or environment."""
    from verifiers import errors

    kind = getattr(errors, error, None)
    policys = (errors.InvalidModelResponseError, errors.ToolError)
    return isinstance(kind, type) and issubclass(kind, policys)


def environment_episode(spec: str) -> EpisodeFunction | None:
    """The episode function generation.environment names: a verifiers environment's, or
    None for a `module:function` spec."""
    if not is_environment_spec(spec):
        return None
    return VerifiersEpisode(environment(spec, "generation.environment"))
