"""Tools for the multi-turn tests: well-behaved, and each way a tool can go wrong."""

from __future__ import annotations

import time

from engine.rollout.tools import tool

NO_ARGS = {"type": "object", "properties": {}}


@tool(parameters={"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]})
def echo(text: str) -> str:
    return text[::-1]


@tool(parameters=NO_ARGS)
def boom() -> str:
    raise RuntimeError("the tool broke")


@tool(parameters=NO_ARGS)
def slow() -> str:
    time.sleep(600)
    return "never"


@tool(parameters=NO_ARGS)
def hog() -> str:
    return str(len(bytearray(4 << 30)))


@tool(parameters=NO_ARGS)
def number() -> int:  # type: ignore[return-value]
    return 42


def undeclared(text: str) -> str:
    return text


@tool(name="calculator", parameters={"type": "object", "properties": {"expression": {"type": "string"}}})
def broken_calculator(expression: str) -> str:
    raise RuntimeError("the tool broke")


@tool(parameters={"type": "object"})
def show(**values: object) -> str:
    """The Python values it was called with, as repr: what JSON's literals became."""
    return repr(sorted(values.items()))
