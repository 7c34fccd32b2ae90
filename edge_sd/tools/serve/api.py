"""The OpenAI API's requests and replies: a request body checked field by field into a GenerationConfig
and a way to feed the prompt, and the reply objects and stream chunks the OpenAI SDKs read.

Fields follow the OpenAI API (https://platform.openai.com/docs/api-reference/chat), plus llama.cpp's
server extras (`top_k`, `min_p`, `repeat_penalty`, `repeat_last_n`) and edge-sd's `algorithm`. A field
the server cannot honour is refused by name rather than ignored: an ignored `n: 2` or `logprobs: true`
would give the client something else than it asked for without a word.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from edge_sd.config import GenerationConfig, GenerationResult
from edge_sd.errors import UsageError
from edge_sd.generator import Generator

ROLES = ("system", "developer", "user", "assistant")
# Spoken by the server as its configuration names them (and by the errors of GenerationConfig.check).
CONFIG_NAMES = {"max_tokens": "max_new_tokens", "repeat_penalty": "repetition_penalty"}
REQUEST_NAMES = {v: k for k, v in CONFIG_NAMES.items()}
FINISH = {"eos": "stop", "stop": "stop", "max_new_tokens": "length", "context": "length"}
MAX_STOP_STRINGS = 16


class RequestError(UsageError):
    """A request the server refuses: the HTTP status, the OpenAI error code and the field at fault."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None):
        super().__init__(message, field=param)
        self.status, self.code = status, code


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


# --- checking a request ----------------------------------------------------------------------------


def _number(body: dict, name: str, integer: bool = False) -> Any:
    value = body.get(name)
    if value is None:
        return None
    ok = isinstance(value, int) if integer else isinstance(value, (int, float))
    if isinstance(value, bool) or not ok:
        raise RequestError(f"{name} must be {'an integer' if integer else 'a number'}, got {value!r}", name)
    return value


def _absent_or(body: dict, name: str, allowed: tuple, why: str) -> None:
    if name in body and body[name] not in allowed:
        raise RequestError(f"{name} is not supported: {why}", name)


def _stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise RequestError("stop must be a non-empty string or a list of them", "stop")
    if len(stops) > MAX_STOP_STRINGS:
        raise RequestError(f"stop takes at most {MAX_STOP_STRINGS} strings, got {len(stops)}", "stop")
    return tuple(stops)


COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "repeat_penalty", "repeat_last_n",
          "presence_penalty", "frequency_penalty", "seed", "stop", "stream", "stream_options", "n", "user",
          "algorithm", "logprobs", "logit_bias"}
CHAT_ONLY = {"messages", "max_completion_tokens", "top_logprobs", "response_format"}
COMPLETION_ONLY = {"prompt", "echo", "best_of", "suffix"}


def _config(body: dict, max_context: int) -> GenerationConfig:
    unsupported = (("n", (1, None), "one choice per request"), ("best_of", (1, None), "one choice per request"),
                   ("logprobs", (False, None, 0), "log probabilities are not returned"),
                   ("top_logprobs", (0, None), "log probabilities are not returned"),
                   ("echo", (False, None), "the prompt is not echoed"), ("suffix", (None, ""), "no insertion"),
                   ("logit_bias", (None, {}), "logit biases would change the target's distribution"))
    for name, allowed, why in unsupported:
        _absent_or(body, name, allowed, why)
    fmt = body.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        raise RequestError("response_format is not supported: text only", "response_format")
    algorithm = body.get("algorithm", "auto")
    if not isinstance(algorithm, str):
        raise RequestError(f"algorithm must be a string, got {algorithm!r}", "algorithm")
    max_tokens = _number(body, "max_completion_tokens", True)
    max_tokens = _number(body, "max_tokens", True) if max_tokens is None else max_tokens
    if max_tokens is not None and max_tokens < 1:
        raise RequestError(f"max_tokens must be at least 1, got {max_tokens}", "max_tokens")
    if max_tokens is not None and max_tokens > max_context:
        raise RequestError(f"max_tokens is {max_tokens}, beyond the model's context of {max_context} tokens",
                           "max_tokens", code="context_length_exceeded")
    values: dict[str, Any] = {"max_new_tokens": max_tokens or max_context, "temperature": 1.0}
    for name in ("temperature", "top_p", "min_p", "repeat_penalty", "presence_penalty", "frequency_penalty"):
        if (v := _number(body, name)) is not None:
            values[CONFIG_NAMES.get(name, name)] = float(v)
    for name in ("top_k", "repeat_last_n", "seed"):
        if (v := _number(body, name, integer=True)) is not None:
            values[name] = v
    try:
        return GenerationConfig(stop=_stop(body), algorithm=algorithm, **values).check()
    except UsageError as e:  # GenerationConfig's own rules, in its names
        if e.field is None:  # the algorithm's name is the one rule without a field
            raise RequestError(str(e), "algorithm") from None
        param = REQUEST_NAMES.get(e.field, e.field)
        raise RequestError(str(e).replace(e.field, param, 1), param) from None


def _content(m: Any, i: int) -> dict[str, str]:
    if not isinstance(m, dict):
        raise RequestError(f"messages[{i}] must be an object", f"messages[{i}]")
    role, content = m.get("role"), m.get("content")
    if role not in ROLES:
        raise RequestError(f"messages[{i}].role must be one of {', '.join(ROLES)}, got {role!r}", f"messages[{i}].role")
    if isinstance(content, list):  # content parts: text only
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
            raise RequestError(f"messages[{i}].content: only text parts are supported", f"messages[{i}].content")
        content = "".join(p["text"] for p in content)
    if not isinstance(content, str) or not content:
        raise RequestError(f"messages[{i}].content must be a non-empty string", f"messages[{i}].content")
    return {"role": "system" if role == "developer" else role, "content": content}


@dataclass
class Request:
    """A checked request: what to generate, how to feed the prompt, and how to answer."""

    chat: bool
    config: GenerationConfig
    feed: Callable[[Generator], None]
    stream: bool
    include_usage: bool


def parse(body: Any, chat: bool, max_context: int) -> Request:
    """Check a request body; RequestError names the first field at fault."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    known = COMMON | (CHAT_ONLY if chat else COMPLETION_ONLY)
    for name in body:
        if name not in known:
            raise RequestError(f"unknown field {name!r}", name)
    config = _config(body, max_context)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestError(f"stream must be true or false, got {stream!r}", "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise RequestError("stream_options takes include_usage only", "stream_options")
    explicit = body.get("max_tokens") is not None or body.get("max_completion_tokens") is not None
    feed = _chat_feed(body) if chat else _prompt_feed(body)
    return Request(chat, config, _bounded(feed, config, explicit), stream, bool(options.get("include_usage")))


def _chat_feed(body: dict) -> Callable[[Generator], None]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list", "messages")
    turns = [_content(m, i) for i, m in enumerate(messages)]

    def feed(gen: Generator) -> None:
        if not gen.model.target.manifest.chat_template:
            raise RequestError("this model has no chat template: send its prompt to /v1/completions", "messages")
        gen.append_messages(turns)
    return feed


def _prompt_feed(body: dict) -> Callable[[Generator], None]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        return lambda gen: gen.append_text(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return lambda gen: gen.append_tokens(prompt)
    raise RequestError("prompt must be a non-empty string, a list of one, or a list of token ids", "prompt")


Feed = Callable[[Generator], None]


def _bounded(feed: Feed, config: GenerationConfig, explicit: bool) -> Feed:
    """The feed, then the check that the prompt and max_tokens fit the context together."""
    def run(gen: Generator) -> None:
        feed(gen)
        limit = gen.model.target.manifest.max_context
        if explicit and len(gen.ids) + config.max_new_tokens > limit:
            raise RequestError(f"the prompt ({len(gen.ids)} tokens) and max_tokens ({config.max_new_tokens}) "
                               f"exceed the model's context of {limit} tokens", "max_tokens",
                               code="context_length_exceeded")
    return run


# --- replies ----------------------------------------------------------------------------------------


class Reply:
    """The objects of one reply, streamed or whole, with the id and time they share."""

    def __init__(self, chat: bool, model: str, fingerprint: str):
        self.chat, self.model, self.fingerprint = chat, model, fingerprint
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.prompt_tokens = 0

    def _head(self, kind: str) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model,
                "system_fingerprint": self.fingerprint}

    def usage(self, result: GenerationResult) -> dict:
        n = len(result.token_ids)
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": n, "total_tokens": self.prompt_tokens + n}

    @staticmethod
    def finish_reason(result: GenerationResult) -> str:
        return FINISH.get(result.stats.stop_reason, "stop")

    def whole(self, result: GenerationResult) -> dict:
        reason = self.finish_reason(result)
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": result.text}, "logprobs": None,
                      "finish_reason": reason}
        else:
            choice = {"index": 0, "text": result.text, "logprobs": None, "finish_reason": reason}
        return {**self._head("chat.completion" if self.chat else "text_completion"), "choices": [choice],
                "usage": self.usage(result), "edge_sd": result.stats.to_dict()}

    def chunk(self, text: str | None = None, finish: str | None = None, first: bool = False) -> dict:
        if self.chat:
            delta: dict = {"role": "assistant", "content": ""} if first else ({"content": text} if text else {})
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            return {**self._head("chat.completion.chunk"), "choices": [choice]}
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        return {**self._head("text_completion"), "choices": [choice]}

    def last_chunk(self, result: GenerationResult) -> dict:
        return {**self.chunk(finish=self.finish_reason(result)), "edge_sd": result.stats.to_dict()}

    def usage_chunk(self, result: GenerationResult) -> dict:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._head(kind), "choices": [], "usage": self.usage(result)}
