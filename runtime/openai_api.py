"""OpenAI's HTTP API, as data: request checks and response shapes (no I/O).

Requests are checked the way OpenAI checks them: a parameter kvferry does not
support is a 400 naming it, never silently ignored. Errors are OpenAI's error
object. Pure Python: the HTTP front (kvferry.http_front) does the serving.
"""

from __future__ import annotations

import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

# Accepted only at their no-op value: anything else is a 400 naming the parameter.
NEUTRAL = {"n": 1, "presence_penalty": 0, "frequency_penalty": 0, "logprobs": False, "parallel_tool_calls": None,
           "echo": False, "best_of": 1, "suffix": None, "store": False}
UNSUPPORTED = ("logit_bias", "tools", "tool_choice", "functions", "function_call", "top_logprobs",
               "response_format", "audio", "modalities", "prediction", "web_search_options", "reasoning_effort",
               "service_tier", "metadata")
COMMON = {"model", "stream", "stream_options", "temperature", "top_p", "max_tokens", "seed", "stop", "top_k",
          "guest", "ignore_eos", "user", *NEUTRAL, *UNSUPPORTED}  # top_k, guest, ignore_eos: kvferry's (and vLLM's)
CHAT_KEYS = COMMON | {"messages", "max_completion_tokens"}
COMPLETION_KEYS = COMMON | {"prompt"}
ROLES = ("system", "user", "assistant", "developer")
GUEST_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


class HttpError(Exception):
    """An OpenAI error object with its HTTP status."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None, code: str | None = None) -> HttpError:
    return HttpError(400, message, param=param, code=code)


@dataclass
class Request:
    """A checked /v1/chat/completions or /v1/completions request."""
    model: str  # "" where the request names none: the host's one model, as vLLM and llama.cpp take it
    messages: list[dict] = field(default_factory=list)  # chat
    prompt: str = ""  # completions
    stream: bool = False
    include_usage: bool = False
    sampling: dict = field(default_factory=dict)  # kvferry SamplingParams fields
    guest: str | None = None


def _number(body: dict, name: str, lo: float, hi: float, integer: bool = False) -> Any:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (integer and not isinstance(v, int)):
        raise bad(f"'{name}' must be {'an integer' if integer else 'a number'}, not {v!r}", name)
    if not lo <= v <= hi:
        raise bad(f"'{name}' must be between {lo:g} and {hi:g}, not {v}", name)
    return v


def _text(content: Any, where: str) -> str:
    """A message's content: a string, or a list of text parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for p in content:
            if not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str):
                raise bad(f"{where}: only text content parts are supported", where)
            parts.append(p["text"])
        return "".join(parts)
    raise bad(f"{where} must be a string or a list of text parts", where)


def parse(body: Any, chat: bool, max_tokens_limit: int) -> Request:
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    unknown = sorted(set(body) - (CHAT_KEYS if chat else COMPLETION_KEYS))
    if unknown:
        raise bad(f"unrecognized request argument supplied: {', '.join(unknown)}", unknown[0])
    for name in UNSUPPORTED:
        if body.get(name) not in (None, [], {}):
            raise bad(f"'{name}' is not supported by kvferry", name, "unsupported_parameter")
    for name, neutral in NEUTRAL.items():
        if name in body and body[name] not in (neutral, None):
            raise bad(f"'{name}' = {body[name]!r} is not supported by kvferry (only {neutral!r})", name,
                      "unsupported_parameter")
    model = body.get("model")
    if model is not None and (not isinstance(model, str) or not model):
        raise bad("'model' must be a model's name (GET /v1/models lists it)", "model")
    req = Request(model=model or "", stream=bool(body.get("stream", False)))
    if not isinstance(body.get("stream", False), bool):
        raise bad("'stream' must be true or false", "stream")
    opts = body.get("stream_options")
    if opts is not None:
        if not isinstance(opts, dict) or set(opts) - {"include_usage"}:
            raise bad("'stream_options' takes only include_usage", "stream_options")
        req.include_usage = bool(opts.get("include_usage"))
    if chat:
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise bad("'messages' must be a non-empty list", "messages")
        for i, m in enumerate(msgs):
            if not isinstance(m, dict) or m.get("role") not in ROLES:
                raise bad(f"messages[{i}].role must be one of {', '.join(ROLES)}", f"messages[{i}].role")
            role = "system" if m["role"] == "developer" else m["role"]
            req.messages.append({"role": role, "content": _text(m.get("content"), f"messages[{i}].content")})
        if req.messages[-1]["role"] == "assistant":
            raise bad("the last message must be from the user or the system (kvferry does not continue "
                      "an assistant message)", f"messages[{len(msgs) - 1}].role")
    else:
        p = body.get("prompt")
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], str):
            p = p[0]
        if not isinstance(p, str) or not p:
            raise bad("'prompt' must be a non-empty string (one prompt per request)", "prompt")
        req.prompt = p
    s = req.sampling
    if (t := _number(body, "temperature", 0, 2)) is not None:
        s["temperature"] = float(t)
    if (p := _number(body, "top_p", 0, 1)) is not None:
        if p == 0:
            raise bad("'top_p' must be greater than 0", "top_p")
        s["top_p"] = float(p)
    if (k := _number(body, "top_k", 0, 1 << 20, integer=True)) is not None:
        s["top_k"] = k
    if (seed := _number(body, "seed", -(1 << 63), (1 << 64) - 1, integer=True)) is not None:
        s["seed"] = seed % (1 << 64)
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    if (n := _number(body, name, 1, max_tokens_limit, integer=True)) is not None:
        s["max_tokens"] = n
    stop = body.get("stop")
    if stop is not None:
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or not all(isinstance(x, str) and x for x in stops) or len(stops) > 4:
            raise bad("'stop' must be a non-empty string or a list of up to 4 of them", "stop")
        s["stop"] = tuple(stops)
    if "ignore_eos" in body:
        if not isinstance(body["ignore_eos"], bool):
            raise bad("'ignore_eos' must be true or false", "ignore_eos")
        s["ignore_eos"] = body["ignore_eos"]
    guest = body.get("guest")
    if guest is not None:
        if not isinstance(guest, str) or not GUEST_NAME.match(guest):
            raise bad("'guest' must be the name of a guest installed on this host", "guest")
        req.guest = guest
    return req


# -- responses ----------------------------------------------------------------------
def new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]


def usage(prompt: int, completion: int, cached: int = 0) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def chunk(rid: str, created: int, model: str, chat: bool, text: str | None, finish: str | None,
          first: bool = False) -> dict:
    if chat:
        delta: dict = {}
        if first:
            delta["role"] = "assistant"
        if text:
            delta["content"] = text
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                "choices": [choice]}
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}]}


def usage_chunk(rid: str, created: int, model: str, chat: bool, u: dict) -> dict:
    return {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
            "model": model, "choices": [], "usage": u}


def completion(rid: str, model: str, chat: bool, text: str, finish: str, u: dict) -> dict:
    created = int(time.time())
    if chat:
        return {"id": rid, "object": "chat.completion", "created": created, "model": model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                             "logprobs": None, "finish_reason": finish}], "usage": u}
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}], "usage": u}
