"""A real HTTP server on 127.0.0.1 that speaks ``POST /v1/chat/completions`` and replays a script.

Tests point the real ``openai`` SDK at it (no mock of the SDK). Replies are scripted per
class: the class is found in the request's user message, so the script is deterministic
under concurrency. Every request is recorded (time, headers, body) so tests can check
what was sent, how often, and how long the client waited between tries.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass
class Reply:
    """One scripted reply: ``kind`` is good | status | bad_json_content | bad_body | drop | trickle.

    ``delay``: seconds before answering; ``trickle``: a good answer sent one byte every ``delay``
    seconds, status line and headers included (a server that never lets a per-read timeout fire).
    ``content``: the answer's text as given (any JSON or none); ``refusal``: the message's refusal."""

    kind: str = "good"
    phrases: list[str] | None = None
    status: int = 200
    headers: dict[str, str] = field(default_factory=dict)
    message: str = "scripted error"
    delay: float = 0.0
    content: str | None = None
    refusal: str | None = None


def good(phrases: list[str] | None = None) -> Reply:
    return Reply("good", phrases=phrases)


def status(code: int, message: str = "scripted error", **headers: str) -> Reply:
    return Reply("status", status=code, message=message,
                 headers={k.replace("_", "-"): v for k, v in headers.items()})


def default_phrases(class_name: str, k: int) -> list[str]:
    return [f"{class_name} visual trait {i + 1}" for i in range(k)]


@dataclass
class Request:
    time: float
    path: str
    headers: dict[str, str]
    body: Any
    class_name: str | None


class StubOpenAI:
    """Context manager: ``with StubOpenAI({"zebra": [status(500), good()]}) as s: s.base_url``."""

    def __init__(self, script: dict[str, list[Reply]] | None = None) -> None:
        self.script = {name: list(replies) for name, replies in (script or {}).items()}
        self.requests: list[Request] = []
        self.inflight = 0
        self.max_inflight = 0  # most requests being answered at once (concurrency bound)
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def base_url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}/v1"

    def __enter__(self) -> "StubOpenAI":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()

    def requests_for(self, class_name: str) -> list[Request]:
        with self._lock:
            return [r for r in self.requests if r.class_name == class_name]

    def _class_of(self, body: Any) -> str | None:
        """The scripted class named in the first user message (longest name wins)."""
        try:
            text = next(m["content"] for m in body["messages"] if m["role"] == "user")
        except (KeyError, StopIteration, TypeError):
            return None
        names = sorted(self.script, key=len, reverse=True)
        for name in names:  # as written, or JSON-escaped (a name holding quotes or newlines)
            shown = name.replace("_", " ")
            if f'"{shown}"' in text or json.dumps(shown, ensure_ascii=False) in text:
                return name
        start = text.find('"')
        return text[start + 1:text.find('"', start + 1)] if start >= 0 else None

    def _next_reply(self, class_name: str | None) -> Reply:
        with self._lock:
            queue = self.script.get(class_name or "")
            return queue.pop(0) if queue else good()

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        stub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:  # keep test output clean
                pass

            def do_POST(self) -> None:  # noqa: N802 - http.server API
                raw = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                try:
                    body = json.loads(raw)
                except json.JSONDecodeError:
                    body = None
                class_name = stub._class_of(body)
                with stub._lock:
                    stub.requests.append(Request(time.monotonic(), self.path,
                                                 {k.lower(): v for k, v in self.headers.items()}, body, class_name))
                if self.path != "/v1/chat/completions":
                    return self._send(404, {"error": {"message": f"no route {self.path}"}})
                reply = stub._next_reply(class_name)
                with stub._lock:
                    stub.inflight += 1
                    stub.max_inflight = max(stub.max_inflight, stub.inflight)
                try:
                    if reply.kind == "trickle":
                        return self._trickle(reply, body, class_name)
                    time.sleep(reply.delay)
                    self._play(reply, body, class_name)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up (timeout test)
                finally:
                    with stub._lock:
                        stub.inflight -= 1

            def _play(self, reply: Reply, body: Any, class_name: str | None) -> None:
                if reply.kind == "drop":
                    self.close_connection = True
                    return
                if reply.kind == "status":
                    return self._send(reply.status, {"error": {"message": reply.message,
                                                               "type": "scripted"}}, reply.headers)
                if reply.kind == "bad_body":
                    return self._send_raw(200, b'{"id": "x", "choices": [', "application/json")
                k = _schema_k(body)
                if reply.kind == "bad_json_content":
                    content = '{"attributes": ["striped coat", '
                elif reply.content is not None:
                    content = reply.content
                else:
                    content = json.dumps({"attributes": reply.phrases if reply.phrases is not None
                                          else default_phrases(class_name or "thing", k)})
                self._send(200, _completion(body, content, reply.refusal))

            def _trickle(self, reply: Reply, body: Any, class_name: str | None) -> None:
                content = json.dumps({"attributes": default_phrases(class_name or "thing", _schema_k(body))})
                data = json.dumps(_completion(body, content)).encode()
                raw = (f"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                       f"Content-Length: {len(data)}\r\n\r\n").encode() + data
                self.close_connection = True
                for i in range(len(raw)):
                    self.wfile.write(raw[i:i + 1])
                    self.wfile.flush()
                    time.sleep(reply.delay)

            def _send(self, code: int, payload: Any, headers: dict[str, str] | None = None) -> None:
                self._send_raw(code, json.dumps(payload).encode(), "application/json", headers)

            def _send_raw(self, code: int, data: bytes, ctype: str,
                          headers: dict[str, str] | None = None) -> None:
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(data)))
                for key, value in (headers or {}).items():
                    self.send_header(key, value)
                self.end_headers()
                self.wfile.write(data)

        return Handler


def _schema_k(body: Any) -> int:
    try:
        return int(body["response_format"]["json_schema"]["schema"]["properties"]
                   ["attributes"]["maxItems"])
    except (KeyError, TypeError, ValueError):
        return 10


def _completion(body: Any, content: str, refusal: str | None = None) -> dict[str, Any]:
    return {
        "id": "chatcmpl-stub", "object": "chat.completion", "created": int(time.time()),
        "model": (body or {}).get("model", "stub"),
        "choices": [{"index": 0, "finish_reason": "stop",
                     "message": {"role": "assistant", "content": content, "refusal": refusal}}],
        "usage": {"prompt_tokens": 10, "completion_tokens": 20, "total_tokens": 30},
    }
