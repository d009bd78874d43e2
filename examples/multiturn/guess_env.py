"""A custom environment with per-turn rewards, and a custom tool: number guessing.

The policy guesses a number between 1 and 100 (the row's ``ground_truth``); the environment
answers "higher" or "lower" (a user message) with a reward of -0.1 per wrong guess, on that turn's
last token, and ends the episode with 1.0 on a right guess. It may also call ``hint``, a plain
function tool registered here, to learn whether the number is even.

    rollout:
      multi_turn:
        enable: true
        environment: examples/multiturn/guess_env.py:GuessEnv
        tools: [examples/multiturn/guess_env.py:hint]
        env_kwargs: {wrong_guess_reward: -0.1}
"""

from __future__ import annotations

import re
from typing import Any

from ppoflow.infra.envs import Environment, EnvSettings, Reset, StepOutcome, parse_tool_calls

_NUMBER = re.compile(r"-?\d+")


def hint(number: str) -> str:
    """Says whether the secret number is even (pass the secret number's row index as 'number')."""
    return "even" if int(number) % 2 == 0 else "odd"


class GuessEnv(Environment):
    def __init__(self, settings: EnvSettings, wrong_guess_reward: float = -0.1):
        super().__init__(settings)
        self.wrong = float(wrong_guess_reward)
        self.secret = 0

    def reset(self, row: dict[str, Any]) -> Reset:
        self.secret = int(str(row["ground_truth"]))
        prompt = "Guess my number between 1 and 100. Answer with one number per turn."
        return Reset(messages=[{"role": "user", "content": prompt}], tools=list(self.settings.tools))

    def step(self, turn_text: str) -> StepOutcome:
        calls = parse_tool_calls(turn_text)
        if calls:  # the hint tool answers about the secret, whatever number was passed
            results = [t.call({"number": str(self.secret)}) for t in self.settings.tools if t.name == "hint"]
            return StepOutcome(
                messages=[{"role": "tool", "name": r.name, "content": r.output} for r in results],
                tool_results=results,
            )
        numbers = _NUMBER.findall(turn_text)
        if not numbers:
            return StepOutcome([{"role": "user", "content": "Answer with a number."}], reward=self.wrong)
        guess = int(numbers[-1])
        if guess == self.secret:
            return StepOutcome(reward=1.0, done=True)
        word = "higher" if guess < self.secret else "lower"
        return StepOutcome([{"role": "user", "content": f"{word}"}], reward=self.wrong)
