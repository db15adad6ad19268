"""Continuing a stream after a failover from the tokens already delivered.

A replay (sse.py) asks the new plan for the whole answer again and drops what
the client has: it recomputes every token already sent, one network round per
token, and it needs llama.cpp to repeat itself, which batching concurrent
requests does not guarantee. A continuation asks the new plan to go on from
exactly where the client is:

    prompt tokens + delivered token ids   -> one prompt, processed as one batch
    n_predict - delivered                 -> what is left of the budget
    same sampling parameters and pinned seed

so the time to the next token does not grow with the length already delivered.

What it needs of the stream: the token ids behind the text the client has.
The proxy asks llama-server for per-token ``logprobs`` (receipt.py,
``ask_for_token_ids``), whose entries carry each token's id, and strips them
again unless the client asked. Ids whose text llama-server still holds back (a
possible stop string) are not part of the resume point: they are generated
again. llama-server skips a token's chunk, and so its id, when the token ends in
part of a UTF-8 character; so before continuing, the proxy has the new
llama-server detokenize the ids and continues only if they spell exactly the
delivered text.

How: llama-server's ``/v1/completions`` takes a prompt mixing text and token
ids, ``["<prompt text>", id, id, ...]``, tokenizing the text exactly as it
would alone (special tokens parsed, BOS added). A chat request's prompt text
is its messages rendered by the same llama-server's ``/apply-template``. The
continuation's completion chunks are reshaped into the original endpoint's
events (chat: ``choices[0].delta.content``) with the ``id``, ``created`` and
``model`` the client saw first, and usage counted as for one generation.

A plain (non-streamed) request that continuation covers goes to llama-server
as a stream (``streamed``), so that it has token ids to go on from too;
``Assembly`` makes the one response the client asked for out of the events.

Not covered, so replayed as before: several choices, grammars and JSON
schemas (their state starts at the first generated token), tool calls,
non-text chat content, chat answers with reasoning content, and a failover
after the whole budget was delivered.

Sans-I/O: events in, requests and events out; the proxy performs the requests.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .receipt import token_ids
from .sse import event_payload, sse_event

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
CONTINUE_PATH = COMPLETIONS_PATH  # the only endpoint taking a prompt of text and token ids
TEMPLATE_PATH = "/apply-template"
DETOKENIZE_PATH = "/detokenize"
DEFAULT_CHAT_TOP_LOGPROBS = 20  # llama-server's for a chat request with logprobs and no top_logprobs
# Their effect starts at the first generated token (grammar state, tool-call parsing) or spans
# several answers: a continuation cannot carry it on.
UNCOVERED_KEYS = ("n", "n_cmpl", "grammar", "json_schema", "response_format", "tools", "functions",
                  "n_indent", "t_max_predict_ms")
# Replaced in the continuation request: the prompt, the budget, the probabilities asked for.
BUDGET_KEYS = ("n_predict", "max_completion_tokens", "max_tokens")  # llama-server's order of precedence
REPLACED_KEYS = frozenset({"messages", "prompt", "logprobs", "top_logprobs", "n_probs", "stream_options",
                           "cache_prompt", *BUDGET_KEYS})


def uncovered(path: str, request: dict[str, Any]) -> str | None:
    """Why a continuation cannot serve ``request`` on ``path`` (None: it can)."""
    if path not in (CHAT_PATH, COMPLETIONS_PATH):
        return f"{path} is not a generation endpoint"
    for key in UNCOVERED_KEYS:
        if _constrains(key, request.get(key)):
            return f"the request sets {key!r}"
    if path == CHAT_PATH:
        messages = request.get("messages")
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("content", ""), str) for m in messages):
            return "the chat messages are not all text"
    elif _prompt_parts(request.get("prompt")) is None:
        return "the prompt is not one text or one list of tokens"
    return None


def _constrains(key: str, value: Any) -> bool:
    """Whether ``value`` of an UNCOVERED_KEYS entry asks for what a continuation cannot carry on."""
    if key in ("n", "n_cmpl"):
        return value not in (None, 1)
    if key == "response_format":
        return isinstance(value, dict) and value.get("type", "text") != "text"
    return value not in (None, False, 0, "", [], {})


def _prompt_parts(prompt: Any) -> list[Any] | None:
    """One completion prompt as a list of text and token ids (None: several prompts, or media)."""
    if isinstance(prompt, str):
        return [prompt]
    # A list with a number in it is one prompt mixing text and ids; a list of texts is several prompts.
    if (isinstance(prompt, list) and prompt and all(isinstance(p, (str, int)) for p in prompt)
            and (len(prompt) == 1 or any(isinstance(p, int) for p in prompt))):
        return list(prompt)
    return None


def _budget(request: dict[str, Any]) -> int | None:
    """The most tokens the request may generate (None: no limit)."""
    for key in BUDGET_KEYS:
        value = request.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            return value if value >= 0 else None
    return None


def _probabilities_asked(path: str, request: dict[str, Any]) -> int:
    """llama-server's n_probs for ``request``: how many top tokens each token's logprobs list."""
    n_probs = request.get("n_probs")
    if isinstance(n_probs, int):
        return n_probs
    logprobs = request.get("logprobs")
    if path == CHAT_PATH:
        return request.get("top_logprobs", DEFAULT_CHAT_TOP_LOGPROBS) if logprobs else 0
    return logprobs if isinstance(logprobs, int) and not isinstance(logprobs, bool) else int(logprobs is True)


def streamed(path: str, request: dict[str, Any]) -> dict[str, Any]:
    """A plain ``request`` as a stream with usage, to be continued if need be and assembled (Assembly)."""
    request = {**request, "stream": True}
    if path == CHAT_PATH:
        request["stream_options"] = {"include_usage": True}
    return request


@dataclass
class Continuation:
    """One generation request streamed from llama-server: what the client has, and how to go on from there.

    Feed ``record`` every event as the client (or the Assembly of a plain answer) gets it, with
    the token ids still in; after
    a failover ask ``resumable``, have the new llama-server render the chat prompt
    (``template_request``) and check the ids (``detokenize_request``, ``spells_delivered``),
    send ``request(prompt)`` to CONTINUE_PATH and pass its events through ``reshape``.
    """

    path: str
    sent: dict[str, Any]  # the request as llama-server got it: seed pinned, token ids asked for
    why_not: str | None = None  # set when the request or its answer is outside what continuation covers
    text: str = ""  # all text delivered
    identity: dict[str, Any] = field(default_factory=dict)  # id, created, model of the first event
    _ids: list[int] = field(default_factory=list)  # every token id delivered
    _resume_ids: int = 0  # how many of them the delivered text spells (the rest is held back)
    _skipped: int = 0  # ids given as prompt in the continuation now running

    def __post_init__(self) -> None:
        self.why_not = uncovered(self.path, self.sent)

    @property
    def resume_ids(self) -> list[int]:
        return self._ids[: self._resume_ids]

    def record(self, event: bytes) -> None:
        """Note one event as delivered."""
        payload = event_payload(event)
        if not isinstance(payload, dict) or not isinstance(payload.get("choices"), list):
            return
        if not self.identity:
            self.identity = {k: payload[k] for k in ("id", "created", "model") if k in payload}
        for choice in payload["choices"]:
            if not isinstance(choice, dict):
                continue
            if choice.get("index", 0) != 0:
                self.why_not = "the answer has several choices"
            delta = choice.get("delta")
            if isinstance(delta, dict) and (delta.get("reasoning_content") or delta.get("tool_calls")):
                self.why_not = "the answer has reasoning or tool calls"
            text = delta.get("content") if isinstance(delta, dict) else choice.get("text")
            self._ids += token_ids(choice)
            if isinstance(text, str) and text:
                self.text += text
                self._resume_ids = len(self._ids)  # text sent includes all held back before it

    def resumable(self) -> bool:
        """Whether a continuation can go on from here (else: replay, or retry whole)."""
        budget = _budget(self.sent)
        return (self.why_not is None and self._resume_ids > 0
                and (budget is None or budget > self._resume_ids))

    def template_request(self) -> dict[str, Any] | None:
        """The body for TEMPLATE_PATH that renders a chat request's prompt (None: not a chat)."""
        return self.sent if self.path == CHAT_PATH else None

    def detokenize_request(self) -> dict[str, Any]:
        return {"tokens": self.resume_ids}

    def spells_delivered(self, detokenized: Any) -> bool:
        """Whether DETOKENIZE_PATH's answer shows the resume ids spell exactly the delivered text."""
        return isinstance(detokenized, dict) and detokenized.get("content") == self.text

    def request(self, rendered_prompt: str | None = None) -> dict[str, Any]:
        """The body for CONTINUE_PATH; a chat request needs TEMPLATE_PATH's ``prompt``.

        Remembers how many ids it gives as prompt: ``reshape`` counts them as generated in usage."""
        if self.path == CHAT_PATH:
            assert rendered_prompt is not None, "a chat continuation needs the rendered prompt"
            parts: list[Any] = [rendered_prompt]
        else:
            parts = _prompt_parts(self.sent["prompt"]) or []
        ids = self.resume_ids
        body = {k: v for k, v in self.sent.items() if k not in REPLACED_KEYS}
        # cache_prompt off: the prompt and the delivered ids are read afresh, as one batch, whether or not the
        # slot that held them was freed in time to be reused (llama.cpp is not batch-invariant), so the text
        # after the seam does not depend on that race, and a receipt's replay reproduces it.
        body.update(prompt=[*parts, *ids], stream=True, n_probs=_probabilities_asked(self.path, self.sent),
                    cache_prompt=False)
        budget = _budget(self.sent)
        if budget is not None:
            body["n_predict"] = budget - len(ids)
        self._skipped = len(ids)
        return body

    def reshape(self, event: bytes) -> list[bytes]:
        """A continuation event as the client's endpoint would have sent it (none, one or more)."""
        payload = event_payload(event)
        if not isinstance(payload, dict) or not isinstance(payload.get("choices"), list):
            return [event]  # [DONE], an error, a comment: the same in both formats
        payload.update(self.identity)
        if isinstance(payload.get("usage"), dict):
            payload["usage"] = self._usage(payload["usage"])
        if self.path == COMPLETIONS_PATH:
            return [sse_event(payload)]
        return [sse_event(chunk) for chunk in self._chat_chunks(payload)]

    def _usage(self, usage: dict[str, Any]) -> dict[str, Any]:
        """Counted as one generation: the skipped ids were generated, not prompt."""
        usage = dict(usage)
        if isinstance(usage.get("prompt_tokens"), int) and isinstance(usage.get("completion_tokens"), int):
            usage["prompt_tokens"] -= self._skipped
            usage["completion_tokens"] += self._skipped
            details = usage.get("prompt_tokens_details")
            if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
                usage["prompt_tokens_details"] = {
                    **details, "cached_tokens": min(details["cached_tokens"], usage["prompt_tokens"])}
        return usage

    def _chat_chunks(self, payload: dict[str, Any]) -> list[dict[str, Any]]:
        """A completion chunk as chat.completion.chunk events, the way llama-server's chat endpoint sends them."""
        common = {k: v for k, v in payload.items() if k not in ("choices", "usage", "timings", "object")}
        common["object"] = "chat.completion.chunk"
        chunks = []
        for choice in payload["choices"]:
            text, logprobs, finish = choice.get("text") or "", choice.get("logprobs"), choice.get("finish_reason")
            if text or logprobs:
                piece = {"finish_reason": None, "index": 0, "delta": {"content": text}}
                if logprobs:
                    piece["logprobs"] = logprobs
                chunks.append({**common, "choices": [piece]})
            if finish is not None:
                chunks.append({**common, "choices": [{"finish_reason": finish, "index": 0, "delta": {}}]})
        stream_options = self.sent.get("stream_options")
        if "usage" in payload and isinstance(stream_options, dict) and stream_options.get("include_usage"):
            chunks.append({**common, "choices": [], "usage": payload["usage"]})
        if chunks and "timings" in payload:
            chunks[-1]["timings"] = payload["timings"]  # the proxy reads the decode speed from it
        return chunks


class Assembly:
    """A plain request answered from its stream: events in (the client's endpoint format), one response out."""

    def __init__(self, path: str) -> None:
        self._path = path
        self._top: dict[str, Any] = {}  # id, created, model, system_fingerprint; usage, timings
        self._text = ""
        self._reasoning = ""  # a reasoning model's chat answer carries it apart from the content
        self._logprobs: list[Any] = []  # present only if the client asked: the proxy strips those it added
        self._finish_reason: str | None = None
        self.error: dict[str, Any] | None = None  # an error event's payload

    def add(self, event: bytes) -> None:
        payload = event_payload(event)
        if not isinstance(payload, dict):
            return
        if "error" in payload:
            self.error = payload
            return
        for key in ("id", "created", "model", "system_fingerprint"):
            if key in payload:
                self._top.setdefault(key, payload[key])
        self._top.update({k: payload[k] for k in ("usage", "timings") if k in payload})
        for choice in payload.get("choices") or []:
            delta = choice.get("delta")
            text = delta.get("content") if isinstance(delta, dict) else choice.get("text")
            self._text += text if isinstance(text, str) else ""
            reasoning = delta.get("reasoning_content") if isinstance(delta, dict) else None
            self._reasoning += reasoning if isinstance(reasoning, str) else ""
            self._logprobs += (choice.get("logprobs") or {}).get("content") or []
            self._finish_reason = choice.get("finish_reason") or self._finish_reason

    def response(self) -> dict[str, Any]:
        """The response llama-server gives the request unstreamed."""
        logprobs = {"content": self._logprobs} if self._logprobs else None
        if self._path == CHAT_PATH:
            message = {"role": "assistant", "content": self._text}
            if self._reasoning:
                message["reasoning_content"] = self._reasoning
            choice: dict[str, Any] = {"finish_reason": self._finish_reason, "index": 0, "message": message}
            if logprobs:
                choice["logprobs"] = logprobs
            kind = "chat.completion"
        else:
            choice = {"text": self._text, "index": 0, "logprobs": logprobs, "finish_reason": self._finish_reason}
            kind = "text_completion"
        return {"choices": [choice], **self._top, "object": kind}
