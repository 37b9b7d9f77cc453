"""The field's clients against an OpenAI/Anthropic-compatible server: which scenarios work.

    python -m benchmarks.client_scenarios --base-url http://127.0.0.1:8080

Thirteen scenarios, each the way an app would write it (the real client libraries of the test
extra), each judged by its result, not only its status: a tool call must be valid for its
schema, structured output must parse, and so on. Run it against `slotwise serve --http-port`
and, side by side, against llama-server on the same model.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

WEATHER_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Oslo", "Lima"]}},
    "required": ["city"],
    "additionalProperties": False,
}
ASK: Any = [{"role": "user", "content": "What is the weather in Oslo? Use the tool."}]
TOKENS = 200


class _Scenarios:
    """The scenarios against one server (``base``: its root), each a method returning "ok" or
    what was wrong with its result."""

    def __init__(self, base: str):
        import openai
        from pydantic import BaseModel

        self.base = base
        self.v1 = f"{base}/v1"
        # (typed loosely: each scenario is written the way an app writes it, not to the stubs)
        self.client: Any = openai.OpenAI(
            base_url=self.v1, api_key="unused", max_retries=0, timeout=300
        )

        class City(BaseModel):
            name: Literal["Oslo", "Lima"]
            country: Literal["Norway", "Peru"]

        self.City: Any = City

    def plain_langchain(self) -> str:
        from langchain_openai import ChatOpenAI

        llm: Any = ChatOpenAI
        llm = llm(base_url=self.v1, api_key="unused", model="gpt-4o-mini", max_tokens=16)
        return _ok(isinstance(llm.invoke("Say hi").content, str))

    def llm_cli(self) -> str:
        with tempfile.TemporaryDirectory() as d:
            Path(d, "extra-openai-models.yaml").write_text(
                f'- model_id: s\n  model_name: gpt-4o-mini\n  api_base: "{self.v1}"\n'
            )
            env = {**os.environ, "LLM_USER_PATH": d, "OPENAI_API_KEY": "unused"}
            exe = str(Path(sys.executable).parent / "llm")
            out = subprocess.run(
                [exe, "-m", "s", "Say hi", "-o", "max_tokens", "16", "--no-stream"],
                capture_output=True,
                text=True,
                env=env,
                timeout=300,
            )
        return _ok(out.returncode == 0 and bool(out.stdout.strip()), out.stderr[-200:])

    def hardcoded_name(self) -> str:
        r = self.client.chat.completions.create(model="gpt-4o-mini", messages=ASK, max_tokens=16)
        return _ok(r.choices[0].message.content is not None)

    def logprobs(self) -> str:
        r = self.client.chat.completions.create(
            model="gpt-4o-mini", messages=ASK, max_tokens=8, logprobs=True, top_logprobs=3
        )
        content = r.choices[0].logprobs.content if r.choices[0].logprobs else None
        return _ok(bool(content) and all(len(t.top_logprobs) == 3 for t in content or ()))

    def json_schema(self) -> str:
        fmt = {
            "type": "json_schema",
            "json_schema": {"name": "w", "schema": WEATHER_SCHEMA, "strict": True},
        }
        r = self.client.chat.completions.create(
            model="gpt-4o-mini", messages=ASK, max_tokens=TOKENS, response_format=fmt
        )
        return _valid(r.choices[0].message.content or "")

    def tools_required(self) -> str:
        tool = {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "The weather in a city",
                "parameters": WEATHER_SCHEMA,
            },
        }
        r = self.client.chat.completions.create(
            model="gpt-4o-mini",
            messages=ASK,
            max_tokens=TOKENS,
            tools=[tool],
            tool_choice="required",
        )
        calls = r.choices[0].message.tool_calls or []
        return _valid(calls[0].function.arguments) if calls else "no tool call"

    def n2(self) -> str:
        r = self.client.chat.completions.create(
            model="gpt-4o-mini", messages=ASK, max_tokens=8, n=2
        )
        return _ok(len(r.choices) == 2, f"{len(r.choices)} choices")

    def responses(self) -> str:
        r = self.client.responses.create(model="gpt-4o-mini", input="Say hi", max_output_tokens=16)
        return _ok(isinstance(r.output_text, str) and r.status in ("completed", "incomplete"))

    def embeddings(self) -> str:
        e = self.client.embeddings.create(model="text-embedding-3-small", input=["a", "b"])
        return _ok(len(e.data) == 2 and len(e.data[0].embedding) > 0)

    def anthropic_messages(self) -> str:
        import anthropic

        a = anthropic.Anthropic(base_url=self.base, api_key="unused", max_retries=0, timeout=300)
        m = a.messages.create(
            model="claude-sonnet-4-5",
            max_tokens=16,
            messages=[{"role": "user", "content": "Say hi"}],
        )
        return _ok(m.content and m.content[0].type == "text")

    def structured_langchain(self) -> str:
        from langchain_openai import ChatOpenAI

        llm: Any = ChatOpenAI
        llm = llm(base_url=self.v1, api_key="unused", model="gpt-4o-mini", max_tokens=TOKENS)
        return _ok(
            isinstance(llm.with_structured_output(self.City).invoke("Name a city"), self.City)
        )

    def instructor_json_schema(self) -> str:
        import instructor

        ic = instructor.from_openai(self.client, mode=instructor.Mode.JSON_SCHEMA)
        city = ic.chat.completions.create(
            model="gpt-4o-mini",
            response_model=self.City,
            max_retries=0,
            max_tokens=TOKENS,
            messages=[{"role": "user", "content": "Name a city"}],
        )
        return _ok(isinstance(city, self.City))

    def pydantic_ai_tool(self) -> str:
        from pydantic_ai import Agent
        from pydantic_ai.models.openai import OpenAIChatModel
        from pydantic_ai.providers.openai import OpenAIProvider

        calls: list[str] = []

        def get_weather(city: Literal["Oslo", "Lima"]) -> str:
            """The weather in a city."""
            calls.append(city)
            return f"sunny in {city}"

        model = OpenAIChatModel(
            "gpt-4o-mini", provider=OpenAIProvider(base_url=self.v1, api_key="unused")
        )
        agent = Agent(model, tools=[get_weather], model_settings={"max_tokens": TOKENS})
        result = asyncio.run(agent.run("What is the weather in Oslo? Use the tool."))
        return _ok(isinstance(result.output, str), f"tool called: {bool(calls)}") + (
            "" if calls else " (answered without the tool)"
        )


def scenarios(base: str) -> dict[str, Callable[[], str]]:
    s = _Scenarios(base)
    return {
        "plain chat, langchain-openai": s.plain_langchain,
        "plain chat, the llm CLI": s.llm_cli,
        "openai SDK, model name gpt-4o-mini": s.hardcoded_name,
        "logprobs=True, top_logprobs=3": s.logprobs,
        "response_format json_schema": s.json_schema,
        'tools, tool_choice="required"': s.tools_required,
        "n=2": s.n2,
        "client.responses.create": s.responses,
        "client.embeddings.create": s.embeddings,
        "anthropic messages.create": s.anthropic_messages,
        "langchain with_structured_output(Model)": s.structured_langchain,
        "instructor Mode.JSON_SCHEMA": s.instructor_json_schema,
        "pydantic-ai Agent with a tool": s.pydantic_ai_tool,
    }


def _ok(good: Any, why: str = "") -> str:
    return "ok" if good else f"wrong result {why}".strip()


def _valid(text: str) -> str:
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), WEATHER_SCHEMA)
    except (ValueError, jsonschema.ValidationError) as e:
        return f"invalid: {str(e).splitlines()[0][:60]}"
    return "ok"


def run(base: str) -> dict[str, str]:
    out = {}
    for name, scenario in scenarios(base.rstrip("/")).items():
        try:
            out[name] = scenario()
        except Exception as e:  # the failure is the figure: its status or its kind
            status = getattr(e, "status_code", None)
            out[name] = f"{status or type(e).__name__}: {str(e).splitlines()[0][:70]}"
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--base-url", required=True, help="the server's root (without /v1)")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    args = p.parse_args()
    results = run(args.base_url)
    if args.json:
        print(json.dumps(results))
    else:
        for name, result in results.items():
            print(f"| {name} | {result} |")
        print(
            f"{sum(r == 'ok' or r.startswith('ok ') for r in results.values())} of "
            f"{len(results)} work"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
