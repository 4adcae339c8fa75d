"""A verifiers (``verifiers.v1``) taskset and harness, plus the loopback model server they call.

verifiers loads tasksets and harnesses by id (an importable module exporting one subclass of
each via ``__all__``): ``TasksetConfig(id="verifiers_env")`` and
``HarnessConfig(id="verifiers_env")`` name this module (``tests/`` is on ``sys.path``).

* ``ArithmeticTaskset``: tasks with two ``@vf.reward`` functions (weighted) and a ``@vf.metric``,
  all run by verifiers' own scoring.
* ``ToolLoopHarness``: the agent program, run in-process as verifiers' ``Harness.launch``
  contract allows ("a harness may run its loop in-process ... as long as every model call goes
  through endpoint + secret"): an OpenAI client on verifiers' interception endpoint, a loop
  that executes the model's ``add`` tool calls and sends the results back. verifiers' own
  interception server records every node and model call on the ``Trace``.
* ``ScriptedModelServer``: the model, an OpenAI-compatible ``/v1/chat/completions`` on
  127.0.0.1 (a thread; no GPU, no model download): by the task's prompt it answers with text,
  an ``add`` tool call (then the tool's result), a length-truncated answer, or HTTP 500.
"""

from __future__ import annotations

import json
import threading
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import verifiers.v1 as vf
from openai import AsyncOpenAI

__all__ = ["ArithmeticTaskset", "ToolLoopHarness"]

ADD_TOOL = {"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}
PROMPTS = {
    "plain": "What is 2+2?",
    "tool": "Use the add tool: what is 3+4?",
    "long": "Write a long essay.",
    "fail": "This request fails.",
}


class ArithmeticData(vf.TaskData):
    """A task row with its expected answer."""

    answer: str = ""


class ArithmeticTask(vf.Task[ArithmeticData]):
    """One question; rewarded on the final reply, with a weighted format reward and a metric."""

    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        return 1.0 if self.data.answer and self.data.answer in trace.last_reply else 0.0

    @vf.reward(weight=0.5)
    async def short(self, trace: vf.Trace) -> float:
        return 1.0 if len(trace.last_reply) < 40 else 0.5

    @vf.metric
    async def reply_chars(self, trace: vf.Trace) -> float:
        return float(len(trace.last_reply))


class ArithmeticTaskset(vf.Taskset[ArithmeticTask]):
    """The four scripted prompts, in ``PROMPTS`` order."""

    def load(self) -> Any:
        answers = {"plain": "4", "tool": "7"}
        for kind, prompt in PROMPTS.items():
            yield ArithmeticTask(ArithmeticData(name=kind, prompt=prompt, answer=answers.get(kind, "")))


class ToolLoopHarness(vf.Harness[vf.HarnessConfig]):
    """The agent loop, in-process: chat with the ``add`` tool until the model answers."""

    NEEDS_CONTAINER = False

    async def launch(self, ctx: Any, trace: Any, runtime: Any, endpoint: str, secret: str,
                     mcp_urls: dict[str, str], data: Any) -> vf.ProgramResult:
        _, prompt = self.resolve_prompt(data)
        messages: list[dict[str, Any]] = [{"role": "user", "content": prompt}] \
            if isinstance(prompt, str) else [m.model_dump(exclude_none=True) for m in prompt]
        client = AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0)
        try:
            for _ in range(4):
                response = await client.chat.completions.create(model=ctx.model, messages=messages,
                                                                 tools=[ADD_TOOL])
                message = response.choices[0].message
                messages.append(message.model_dump(exclude_none=True))
                if not message.tool_calls:
                    break
                for call in message.tool_calls:
                    args = json.loads(call.function.arguments)
                    messages.append({"role": "tool", "tool_call_id": call.id,
                                     "content": str(int(args["a"]) + int(args["b"]))})
        finally:
            await client.close()
        return vf.ProgramResult(exit_code=0, stdout="", stderr="")


class _Handler(BaseHTTPRequestHandler):
    def log_message(self, *args: object) -> None:  # quiet
        return None

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        messages = body.get("messages") or []
        first = next((m.get("content") for m in messages if m.get("role") == "user"), "")
        tool_results = [m for m in messages if m.get("role") == "tool"]
        if first == PROMPTS["fail"]:
            self._send(500, {"error": {"message": "scripted failure", "type": "server_error"}})
            return
        message: dict[str, Any] = {"role": "assistant", "content": "The answer is 4."}
        finish = "stop"
        if first == PROMPTS["tool"] and not tool_results:
            message = {"role": "assistant", "content": None, "tool_calls": [{
                "id": "call_add_1", "type": "function",
                "function": {"name": "add", "arguments": json.dumps({"a": 3, "b": 4})}}]}
            finish = "tool_calls"
        elif first == PROMPTS["tool"]:
            message = {"role": "assistant", "content": f"The sum is {tool_results[-1]['content']}."}
        elif first == PROMPTS["long"]:
            message, finish = {"role": "assistant", "content": "Once upon a time"}, "length"
        prompt_tokens = sum(len(str(m.get("content") or "").split()) for m in messages)
        completion_tokens = len(str(message.get("content") or "").split()) or 1
        self._send(200, {
            "id": f"chatcmpl-{uuid.uuid4().hex[:12]}", "object": "chat.completion", "created": 0,
            "model": body.get("model", "policy"),
            "choices": [{"index": 0, "message": message, "finish_reason": finish}],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens},
        })

    def _send(self, status: int, payload: dict[str, Any]) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


class ScriptedModelServer:
    """The loopback model server (127.0.0.1, a free port), as a context manager."""

    def __enter__(self) -> ScriptedModelServer:
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.base_url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()
