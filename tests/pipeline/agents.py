"""Agents for the tests (rollout.agent=tests/pipeline/agents.py:NAME), written against the openai client
only: one that works and reports what it was sent, and one for each way an agent can go wrong. Imports
nothing of rlflow's (each episode's sandbox child imports this file)."""

from __future__ import annotations

import time

import openai


def chatter(client: openai.OpenAI, row: dict) -> float:
    """Three calls, each after a user message; returns the sum of the log-probs it was sent, so that the
    row's behaviour log-probs can be compared with what the agent saw."""
    messages = [{"role": "user", "content": f"hello {row['ground_truth']}"}]
    total = 0.0
    for k in range(3):
        try:
            answer = client.chat.completions.create(model="policy", messages=messages, logprobs=True, max_tokens=8)
        except openai.BadRequestError:
            break  # no room left
        choice = answer.choices[0]
        ids = choice.model_extra["token_ids"]
        assert [t.logprob for t in choice.logprobs.content] and len(ids) == len(choice.logprobs.content)
        total += sum(t.logprob for t in choice.logprobs.content)
        messages += [{"role": "assistant", "content": choice.message.content}, {"role": "user", "content": f"again {k}"}]
    return total


class _Bad:
    pass


def goes_wrong(client: openai.OpenAI, row: dict) -> float:
    """One good call, then on the row whose ground truth names a fault, that fault; 0.5 on the others."""
    fault = row["ground_truth"]
    if fault == "silent":
        return 1.0
    messages = [{"role": "user", "content": "hi"}]
    answer = client.chat.completions.create(model="policy", messages=messages)
    text = answer.choices[0].message.content
    if fault == "hang":
        time.sleep(600)
    if fault == "raise":
        raise ValueError("no such move")
    if fault == "text":
        return "good"  # type: ignore[return-value]
    if fault == "rewrite":
        client.chat.completions.create(model="policy", messages=messages + [
            {"role": "assistant", "content": text + "!"}, {"role": "user", "content": "and?"}])
    if fault == "temperature":
        client.chat.completions.create(model="policy", temperature=0.3, messages=messages + [
            {"role": "assistant", "content": text}, {"role": "user", "content": "and?"}])
    return 0.5


def silent(client: openai.OpenAI, row: dict) -> float:
    """Never calls the endpoint."""
    return 1.0


def one_argument(client: openai.OpenAI) -> float:
    return 0.0


not_a_function = _Bad()


from engine.rollout.builtin_agents import _NUMBER, guess_number  # noqa: E402  (no torch: tests/test_layers.py)


class _Counting:
    """An openai client as guess_number uses it (client.chat.completions.create), counting the answers, and
    hanging on receipt of an answer after one that held a number when `hangs`."""

    def __init__(self, client: openai.OpenAI, hangs: bool) -> None:
        self.client, self.hangs, self.answers, self.numbers = client, hangs, 0, 0
        self.chat = self.completions = self

    def create(self, **request: object) -> object:
        answer = self.client.chat.completions.create(**request)  # type: ignore[call-overload]
        if self.hangs and self.numbers >= 1:
            time.sleep(3600)
        self.answers += 1
        self.numbers += _NUMBER.search(answer.choices[0].message.content or "") is not None
        return answer


def guess_or_hang(client: openai.OpenAI, row: dict) -> float:
    """tests/pipeline/envs.py:GuessOrHang written as an agent: guess_number less 0.125 an answer, and the
    episodes whose seed is divisible by 4 hang where that environment's do (the step after the first
    guess): the same episodes, the same errors, the same total rewards."""
    counting = _Counting(client, row["seed"] % 4 == 0)
    return guess_number(counting, row) - 0.125 * counting.answers
