"""Ask an OpenAI-compatible chat endpoint for K visual attribute phrases per class.

Why it is built this way:
- the SDK's own retries are off (``max_retries=0``): the loop here retries 408/409/429/5xx,
  timeouts and dropped connections with exponential backoff, honours ``Retry-After``, and
  stops at once on errors that would repeat for every class (bad key, unknown model,
  unreachable server), so its behaviour is ours to test;
- every answer is validated (exactly K distinct, non-empty, short phrases) and re-asked
  with the reason, because not every compatible server enforces the JSON schema;
- the output file is rewritten atomically after every class, so an interrupted or failed
  run keeps everything answered so far and a rerun asks only for what is missing;
- the API key is read from the environment only and redacted from every message we emit; an
  answer that contains it (a server echoing the request) is dropped and re-asked, never stored;
  names and server texts are logged escaped, cut short (``prompt.shown``).
"""

from __future__ import annotations

import datetime as dt
import email.utils
import logging
import os
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Mapping
from urllib.parse import urlsplit

from tqdm import tqdm

from fedmvp.attributes import prompt
from fedmvp.attributes.files import (META_KEY, AttributeFileError, read_attribute_file,
                                     save_attributes)
from fedmvp.attributes.prompt import OFFLINE_VERSION, offline_attributes, shown

log = logging.getLogger("fedmvp.attributes")

FILE_FORMAT = "fedmvp-attributes/1"
RETRY_STATUS = frozenset({408, 409, 429})
ABORT_STATUS = frozenset({401, 403, 404})
NO_KEY = "EMPTY"  # local servers (vLLM, Ollama) accept any key; the SDK insists on one


class GenerateError(Exception):
    """Bad input or setup found before anything was asked (the CLI exits 2)."""


class _Abort(Exception):
    """A failure that would repeat for every class: stop the whole run."""


class _ClassFailed(Exception):
    """This class could not be answered; the others go on."""


class _Stopped(Exception):
    """The run was stopped while this class waited its turn or its backoff."""


class _DeadlinePassed(Exception):
    """No complete answer within ``--timeout`` seconds of wall-clock time."""


@dataclass
class GenerateConfig:
    """Knobs of one generation run (``backoff_base`` is small in tests)."""

    model: str = "gpt-4o"
    k: int = prompt.DEFAULT_K
    domain: str | None = None
    concurrency: int = 4
    max_retries: int = 5          # transport retries per request (429, 5xx, timeouts, drops)
    max_reasks: int = 2           # extra asks after an invalid answer
    backoff_base: float = 1.0     # seconds; doubles per retry, with jitter
    backoff_max: float = 30.0
    retry_after_max: float = 120.0
    timeout: float = 60.0
    temperature: float | None = None


@dataclass
class GenerateReport:
    """What a run did; ``to_dict`` is the CLI's ``--json`` summary."""

    out: str
    model: str | None
    prompt_version: str
    offline: bool
    requested: int
    kept: list[str] = field(default_factory=list)
    generated: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)
    aborted: str | None = None
    requests: int = 0
    elapsed_s: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.failed and not self.skipped and self.aborted is None

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.ok}


@dataclass(frozen=True)
class Endpoint:
    """Where to ask; the key never shows in ``repr`` and ``server`` drops credentials."""

    base_url: str | None
    api_key: str = field(repr=False)

    @property
    def server(self) -> str:
        if not self.base_url:
            return "api.openai.com"
        parts = urlsplit(self.base_url)
        return f"{parts.scheme}://{parts.hostname}{f':{parts.port}' if parts.port else ''}{parts.path}"


def resolve_endpoint(base_url: str | None = None,
                     env: Mapping[str, str] | None = None) -> Endpoint:
    """Key from ``OPENAI_API_KEY`` only; server from ``base_url`` or ``OPENAI_BASE_URL``."""
    env = os.environ if env is None else env
    key = env.get("OPENAI_API_KEY") or None
    base_url = base_url or env.get("OPENAI_BASE_URL") or None
    if not key and not base_url:
        raise GenerateError(
            "no OPENAI_API_KEY in the environment and no --base-url/OPENAI_BASE_URL: set one "
            "of them, or pass --offline to write template attributes")
    return Endpoint(base_url=base_url, api_key=key or NO_KEY)


def parse_retry_after(headers: Mapping[str, str]) -> float | None:
    """Seconds asked for by ``retry-after-ms`` or ``Retry-After`` (seconds or HTTP date)."""
    if (ms := headers.get("retry-after-ms")) is not None:
        try:
            return max(0.0, float(ms) / 1000)
        except ValueError:
            pass
    value = headers.get("retry-after")
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=dt.timezone.utc)
    return max(0.0, (when - dt.datetime.now(dt.timezone.utc)).total_seconds())


class AttributeClient:
    """One endpoint, our retry loop and answer validation; safe to share between threads."""

    def __init__(self, endpoint: Endpoint, config: GenerateConfig,
                 stop: threading.Event | None = None) -> None:
        from openai import OpenAI  # lazy: openai is only in the `train` extra

        self.config = config
        self.endpoint = endpoint
        self.stop = stop or threading.Event()
        self.requests = 0
        self._lock = threading.Lock()
        self._secret = endpoint.api_key if endpoint.api_key != NO_KEY else None
        self._new_client = lambda: OpenAI(api_key=endpoint.api_key, base_url=endpoint.base_url,
                                          max_retries=0, timeout=config.timeout)

    def redact(self, text: str) -> str:
        """``text`` with the API key masked (servers sometimes echo it, in error bodies or answers)."""
        return text.replace(self._secret, "***") if self._secret else text

    def ask(self, class_name: str) -> list[str]:
        """K validated phrases for one class, re-asking with the reason after an invalid answer."""
        k = self.config.k
        messages = prompt.build_messages(class_name, k, self.config.domain)
        tries = 1 + self.config.max_reasks
        reason = ""
        for attempt in range(tries):
            content: str | None = None
            try:
                content = self._complete(class_name, messages)
                if self._secret and content and self._secret in content:
                    content = self.redact(content)  # not even the re-ask sends it back
                    raise prompt.InvalidAnswer("the answer contained the API key; it was dropped, not stored")
                return prompt.parse_answer(content, k)
            except prompt.InvalidAnswer as exc:
                reason = self.redact(str(exc))
                more = ", asking again" if attempt + 1 < tries else ""
                log.warning("%s: invalid answer (%s)%s", shown(class_name), reason, more)
                if content and len(content) <= prompt.MAX_ANSWER_CHARS:
                    messages = [*messages, {"role": "assistant", "content": content}]
                messages = [*messages, prompt.reask_message(reason, k)]
        raise _ClassFailed(f"invalid answer after {tries} tries: {reason}")

    def _create(self, kwargs: dict[str, Any]) -> Any:
        """One request bounded by ``timeout`` seconds of wall-clock time in all.

        httpx's timeout bounds each read, so a server trickling a byte every few seconds would
        never time out. The request runs in a daemon thread on a client of its own; past the
        deadline that client is closed (its socket with it, which ends the thread's next read)
        and ``_DeadlinePassed`` is raised, whatever the server does."""
        client = self._new_client()
        box: dict[str, Any] = {}
        done = threading.Event()

        def request() -> None:
            try:
                box["response"] = client.chat.completions.create(**kwargs)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
                box["error"] = exc
            finally:
                done.set()

        threading.Thread(target=request, name="attributes-request", daemon=True).start()
        finished = done.wait(self.config.timeout)
        # closing may wait for the pool's lock: never on this thread
        threading.Thread(target=client.close, name="attributes-close", daemon=True).start()
        if not finished:
            raise _DeadlinePassed()
        if "error" in box:
            raise box["error"]
        return box["response"]

    def _backoff(self, attempt: int) -> float:
        delay = min(self.config.backoff_max, self.config.backoff_base * 2 ** attempt)
        return delay * random.uniform(0.5, 1.0)

    def _complete(self, class_name: str, messages: list[dict[str, str]]) -> str | None:
        """One answer's text, retrying transport failures; raises _Abort/_ClassFailed/_Stopped."""
        import openai

        cfg = self.config
        kwargs: dict[str, Any] = {"model": cfg.model, "messages": messages,
                                  "response_format": prompt.response_format(cfg.k)}
        if cfg.temperature is not None:
            kwargs["temperature"] = cfg.temperature
        attempts = 1 + cfg.max_retries
        what, unreachable = "", False
        for attempt in range(attempts):
            if self.stop.is_set():
                raise _Stopped()
            with self._lock:
                self.requests += 1
            delay: float | None = None
            try:
                response = self._create(kwargs)
            except openai.APIStatusError as exc:
                status, detail = exc.status_code, self.redact(str(exc.message))[:300]
                if status in ABORT_STATUS:
                    self.stop.set()  # before the next queued class can start
                    raise _Abort(f"HTTP {status} from {self.endpoint.server} (model "
                                 f"{cfg.model!r}): {detail}") from None
                if status not in RETRY_STATUS and status < 500:
                    raise _ClassFailed(f"HTTP {status}: {detail}") from None
                what, unreachable = f"HTTP {status}", False
                delay = parse_retry_after(exc.response.headers)
            except (openai.APITimeoutError, _DeadlinePassed):
                what, unreachable = f"no answer within {cfg.timeout:g}s", False
            except openai.APIConnectionError as exc:
                what, unreachable = f"connection failed ({self.redact(str(exc))[:200]})", True
            except openai.APIResponseValidationError as exc:
                raise prompt.InvalidAnswer(f"malformed reply from the server ({exc.message})") from None
            except ValueError as exc:  # the SDK lets a body that is not JSON raise JSONDecodeError
                raise prompt.InvalidAnswer(f"the server's reply was not valid JSON ({exc})") from None
            else:
                return _answer_text(response)
            if attempt + 1 == attempts:
                break
            delay = self._backoff(attempt) if delay is None else min(delay, cfg.retry_after_max)
            log.warning("%s: %s, retrying in %.1fs (attempt %d/%d)",
                        shown(class_name), what, delay, attempt + 2, attempts)
            if self.stop.wait(delay):
                raise _Stopped()
        if unreachable:
            self.stop.set()
            raise _Abort(f"cannot reach {self.endpoint.server} after {attempts} attempts: {what}; "
                         "is the server running? check --base-url, or use --offline")
        raise _ClassFailed(f"{what}; gave up after {attempts} attempts")


def _answer_text(response: Any) -> str | None:
    """The message text of a chat completion; odd replies become ``InvalidAnswer``."""
    if isinstance(response, str):  # the SDK hands back non-JSON bodies as text
        raise prompt.InvalidAnswer("the server's reply was not a JSON chat completion")
    try:
        choice = response.choices[0]
        message = choice.message
    except (AttributeError, IndexError, TypeError):
        raise prompt.InvalidAnswer("the server's reply had no choices") from None
    if getattr(message, "refusal", None):
        raise prompt.InvalidAnswer(f"the model refused: {shown(str(message.refusal), quote=True)}")
    if getattr(choice, "finish_reason", None) == "length":
        raise prompt.InvalidAnswer("the answer was cut off at the token limit")
    return message.content


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).replace(microsecond=0).isoformat().replace("+00:00", "Z")


def _read_existing(out: Path, config: GenerateConfig) -> tuple[dict[str, list[str]], dict]:
    """What ``out`` already holds; refuses files made for another K or domain."""
    if not out.exists():
        return {}, {}
    try:
        attrs, meta = read_attribute_file(out)
    except AttributeFileError as exc:
        raise GenerateError(f"{exc}; fix or remove it, or choose another --out") from None
    if meta.get("k") not in (None, config.k):
        raise GenerateError(f"{out}: holds K={meta['k']} phrases per class, not {config.k}; "
                            f"pass --k {meta['k']} or choose another --out")
    if "domain" in meta and meta["domain"] != config.domain:
        raise GenerateError(f"{out}: was generated for domain {meta['domain']!r}, not "
                            f"{config.domain!r}; choose another --out")
    return attrs, meta


def _plan(class_names: list[str], attrs: dict[str, list[str]], offline_set: set[str],
          k: int, offline: bool) -> tuple[list[str], list[str]]:
    """``(todo, kept)``: stored answers are kept; template placeholders are replaced online."""
    todo, kept = [], []
    for name in class_names:
        phrases = attrs.get(name)
        if phrases is None or (not offline and name in offline_set):
            todo.append(name)
        elif len(phrases) < k or any(not p.strip() for p in phrases):
            log.warning("%s: stored phrases are unusable (%d, need %d non-empty), replacing them",
                        shown(name), len(phrases), k)
            todo.append(name)
        else:
            kept.append(name)
    return todo, kept


def generate_attributes(class_names: list[str], out: str | os.PathLike,
                        config: GenerateConfig | None = None, *, offline: bool = False,
                        base_url: str | None = None, env: Mapping[str, str] | None = None,
                        progress: bool = True) -> GenerateReport:
    """Fill ``out`` with attributes for ``class_names``, asking only for what it lacks."""
    config = config or GenerateConfig()
    started, out = time.monotonic(), Path(out)
    if META_KEY in class_names:
        raise GenerateError(f"{META_KEY!r} is reserved and cannot be a class name")
    attrs, old_meta = _read_existing(out, config)
    offline_set = set(old_meta.get("offline_classes", []))
    todo, kept = _plan(class_names, attrs, offline_set, config.k, offline)
    report = GenerateReport(out=str(out), model=None if offline else config.model,
                            prompt_version=OFFLINE_VERSION if offline else prompt.PROMPT_VERSION,
                            offline=offline, requested=len(class_names), kept=kept)
    endpoint = None if offline or not todo else resolve_endpoint(base_url, env)
    run = {"date": _now(), "model": "offline-template" if offline else config.model,
           "prompt_version": report.prompt_version, "generated": 0,
           "server": None if endpoint is None else endpoint.server}
    requested = set(class_names)
    order = list(class_names) + [c for c in attrs if c not in requested]  # extras stay, last

    def save() -> None:
        meta = {"format": FILE_FORMAT, "note": "metadata: attribute loaders skip this key",
                "k": config.k, "domain": config.domain,
                "model": old_meta.get("model") if offline else config.model,
                "prompt_version": old_meta.get("prompt_version") if offline else prompt.PROMPT_VERSION,
                "created": old_meta.get("created") or run["date"], "updated": _now(),
                "offline": bool(offline_set), "offline_classes": [c for c in order if c in offline_set],
                "runs": [*old_meta.get("runs", []), run]}
        save_attributes(out, {c: attrs[c] for c in order if c in attrs}, meta)

    if offline or not todo:
        for name in todo:
            attrs[name] = offline_attributes(name, config.k)
            offline_set.add(name)
        report.generated, run["generated"] = list(todo), len(todo)
        if todo or not out.exists():
            save()
        report.elapsed_s = round(time.monotonic() - started, 3)
        return report

    client = AttributeClient(endpoint, config)
    log.info("asking %s at %s for %d classes (%d already on disk)",
             config.model, endpoint.server, len(todo), len(kept))
    pool = ThreadPoolExecutor(max_workers=max(1, config.concurrency))
    futures = {pool.submit(client.ask, name): name for name in todo}
    try:
        with tqdm(total=len(todo), unit="class", desc="attributes",
                  disable=None if progress else True) as bar:
            for future in as_completed(futures):
                name = futures[future]
                bar.update(1)
                if future.cancelled():
                    report.skipped.append(name)
                    continue
                try:
                    phrases = future.result()
                except _Stopped:
                    report.skipped.append(name)
                except _Abort as exc:
                    report.failed[name] = client.redact(str(exc))
                    if report.aborted is None:
                        report.aborted = client.redact(str(exc))
                        log.error("stopping: %s", report.aborted)
                        client.stop.set()
                        for other in futures:
                            other.cancel()
                except Exception as exc:  # noqa: BLE001 - one class failing must not lose the others
                    detail = shown(client.redact(str(exc)), 200)  # an SDK error may quote the server's bytes
                    reason = str(exc) if isinstance(exc, _ClassFailed) else f"{type(exc).__name__}: {detail}"
                    report.failed[name] = client.redact(reason)
                    log.error("%s: %s", shown(name), report.failed[name])
                else:
                    attrs[name] = phrases
                    offline_set.discard(name)
                    report.generated.append(name)
                    run["generated"] = len(report.generated)
                    save()
    except BaseException:
        client.stop.set()
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown(wait=True)
    rank = {name: i for i, name in enumerate(class_names)}
    report.generated.sort(key=rank.__getitem__)
    report.skipped.sort(key=rank.__getitem__)
    report.failed = dict(sorted(report.failed.items(), key=lambda item: rank[item[0]]))
    report.requests = client.requests
    report.elapsed_s = round(time.monotonic() - started, 3)
    return report
