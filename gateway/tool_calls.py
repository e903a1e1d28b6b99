"""Tool calls: what a chat request's `tools` and `tool_choice` ask of the prompt and the output, and reading the
calls back out of the answer.

The prompt: the model's chat template gets `tools` (as transformers passes them) when it renders them; a template
that never mentions tools (the built-in SmolLM2's) gets a system message instead that lists the functions and the
format to call them in: a JSON list of `{"name", "arguments"}` objects. The output:

- `none`: text; the functions are not offered at all when the template cannot render them.
- `auto`: free text. An answer that is a tool call (a JSON object with `name` and `arguments` (or `parameters`),
  a list of them, or either inside `<tool_call>` tags, the Hermes / Qwen / Llama 3 styles) naming a function the
  request offered comes back as `tool_calls`; any other answer comes back as content.
- `required`: constrained to a JSON list of one or more calls (exactly one without `parallel_tool_calls`), each to
  a function offered, its arguments valid under that function's `parameters` schema.
- a named function: constrained to that function's arguments (its `parameters` schema).

Answers that are calls finish with `finish_reason: "tool_calls"`; one cut short by max_tokens stays text, with
`length`.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pdserve.engine.grammar import Constraint
from pdserve.gateway.request import invalid

MAX_TOOLS = 128
_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
_TAGGED = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])

    def as_openai(self, index: int | None = None) -> dict:
        body: dict[str, Any] = {"id": self.id, "type": "function"}
        body["function"] = {"name": self.name, "arguments": self.arguments}
        return body if index is None else {"index": index, **body}


@dataclass
class ToolPlan:
    """A chat request's tools: `functions` by name (each OpenAI's `function` object), and what `tool_choice` asks:
    "none", "auto", "required", or "function" with `named` set."""

    functions: dict[str, dict]
    choice: str
    named: str | None = None
    parallel: bool = True

    @property
    def constrained(self) -> bool:
        """The output is a tool call by construction (required or named): nothing of it is content."""
        return self.choice in ("required", "function")

    def template_tools(self) -> list[dict]:
        """`tools` as a chat template receives them (transformers' convention: OpenAI's tool objects)."""
        return [{"type": "function", "function": f} for f in self.functions.values()]

    def constraint(self) -> Constraint | None:
        if self.choice == "function":
            assert self.named is not None
            return Constraint("json_schema", json.dumps(_parameters(self.functions[self.named])))
        if self.choice != "required":
            return None
        calls = [
            {
                "type": "object",
                "properties": {"name": {"const": name}, "arguments": _parameters(f)},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for name, f in self.functions.items()
        ]
        schema: dict[str, Any] = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
        if not self.parallel:
            schema["maxItems"] = 1
        return Constraint("json_schema", json.dumps(schema))

    def instructions(self) -> str:
        """The system text that offers the functions to a model whose template cannot."""
        listing = "\n".join(json.dumps(f, ensure_ascii=False) for f in self.functions.values())
        if self.choice == "function":
            return (
                f"You can call these functions:\n{listing}\nCall the function {self.named}: reply with only a JSON "
                "object of its arguments."
            )
        how = 'reply with only a JSON list of calls: [{"name": <function name>, "arguments": {<argument>: <value>}}]'
        if self.choice == "required":
            return f"You can call these functions:\n{listing}\nCall one or more of them: {how}."
        return f"You can call these functions:\n{listing}\nTo call functions, {how}. Otherwise reply normally."

    def calls(self, text: str) -> list[ToolCall] | None:
        """The answer's tool calls, or None when it is not a call (auto) or does not parse (cut short)."""
        if self.choice == "function":
            assert self.named is not None
            try:
                json.loads(text)
            except ValueError:
                return None
            return [ToolCall(self.named, text.strip())]
        if self.choice == "none":
            return None
        return _read_calls(text, self.functions)


def _parameters(function: dict) -> dict:
    parameters = function.get("parameters")
    return parameters if isinstance(parameters, dict) else {"type": "object", "properties": {}}


def _read_calls(text: str, functions: dict[str, dict]) -> list[ToolCall] | None:
    stripped = text.strip()
    tagged = _TAGGED.findall(stripped) if stripped.startswith("<tool_call>") else []
    pieces = tagged or [stripped]
    found: list[ToolCall] = []
    for piece in pieces:
        try:
            value = json.loads(piece)
        except ValueError:
            return None
        for item in value if isinstance(value, list) else [value]:
            call = _call(item, functions)
            if call is None:
                return None
            found.append(call)
    return found or None


def _call(item: object, functions: dict[str, dict]) -> ToolCall | None:
    if not isinstance(item, dict) or item.get("name") not in functions:
        return None
    arguments = item.get("arguments", item.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(str(item["name"]), json.dumps(arguments, ensure_ascii=False))


def plan(tools: Sequence[dict] | None, tool_choice: object, parallel: bool | None) -> ToolPlan | None:
    """The request's ToolPlan (None without tools); RequestError naming `tools` or `tool_choice` when wrong."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise invalid("tool_choice", "tool_choice needs tools")
        return None
    if len(tools) > MAX_TOOLS:
        raise invalid("tools", f"tools takes at most {MAX_TOOLS} functions")
    functions: dict[str, dict] = {}
    for n, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict):
            raise invalid("tools", f'tools[{n}] must be {{"type": "function", "function": {{...}}}}')
        name = function.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise invalid("tools", f"tools[{n}].function.name must be 1-64 letters, digits, '_' or '-'")
        if name in functions:
            raise invalid("tools", f"tools[{n}]: the function {name!r} is given twice")
        if "parameters" in function and not isinstance(function["parameters"], dict):
            raise invalid("tools", f"tools[{n}].function.parameters must be a JSON schema object")
        functions[name] = function
    choice, named = _choice(tool_choice, functions)
    return ToolPlan(functions, choice, named, True if parallel is None else parallel)


def _choice(tool_choice: object, functions: dict[str, dict]) -> tuple[str, str | None]:
    if tool_choice is None:
        return "auto", None
    if tool_choice in ("none", "auto", "required"):
        return str(tool_choice), None
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        function = tool_choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if name not in functions:
            raise invalid("tool_choice", f"tool_choice names the function {name!r}, which tools does not offer")
        return "function", str(name)
    raise invalid("tool_choice", 'tool_choice must be "none", "auto", "required" or {"type": "function", ...}')


def chat_messages(messages: list[dict], tools: ToolPlan | None, template_renders_tools: bool) -> list[dict]:
    """The messages a chat template gets. With tools and a template that cannot render them, a system message
    offers the functions (`none` offers nothing), and earlier turns' calls and results become text in the format
    that message asks for."""
    if template_renders_tools:
        return messages
    out = []
    for m in messages:
        if m.get("tool_calls"):
            calls = [
                {"name": c["function"]["name"], "arguments": _as_json(c["function"].get("arguments", "{}"))}
                for c in m["tool_calls"]
            ]
            text = json.dumps(calls, ensure_ascii=False)
            out.append({"role": m["role"], "content": (m.get("content") or "") + text})
        else:
            out.append({"role": m["role"], "content": m.get("content") or ""})
    if tools is None or tools.choice == "none":
        return out
    if out and out[0]["role"] == "system":
        return [{"role": "system", "content": out[0]["content"] + "\n\n" + tools.instructions()}, *out[1:]]
    return [{"role": "system", "content": tools.instructions()}, *out]


def _as_json(arguments: object) -> object:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments
