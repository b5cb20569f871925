"""The versioned LLM prompt for class attributes, its JSON schema and the answer contract.

The prompt text is part of the experiment: change any wording here and bump
``PROMPT_VERSION`` so files written before and after can be told apart (the version is
recorded in each file's metadata block). The schema and ``parse_answer`` define the same
contract twice on purpose: servers that ignore ``response_format`` (some
OpenAI-compatible ones do) are still held to it by local validation.

Class names and domains are data, not instructions: they enter the prompt JSON-escaped
(``quoted``), so a name holding quotes, newlines or "ignore previous instructions" cannot close
its string, start a line of its own or add a rule (v2; for a name without quotes, backslashes or
control characters the text is v1's). An answer is held to the format exactly: at most
``MAX_ANSWER_CHARS``, one JSON object with the one key ``attributes`` (an answer naming other
classes is refused), K printable phrases.
"""

from __future__ import annotations

import json

PROMPT_VERSION = "fedmvp-attributes-v2"
DEFAULT_K = 10
MAX_PHRASE_CHARS = 80
MAX_PHRASE_WORDS = 10
MAX_ANSWER_CHARS = 16 << 10  # K=50 phrases of 80 characters are 5 KB of JSON
SCHEMA_NAME = "class_attributes"
OFFLINE_VERSION = "fedmvp-offline-template-v1"

SYSTEM_PROMPT = (
    "You describe what object classes look like, for a vision-language model that "
    "matches images against sentences. You answer with short visual attribute "
    "phrases only."
)

_USER_TEMPLATE = """\
List exactly {k} distinct visual attributes of {name} that help recognise it in an image{domain_clause}.

Rules for every attribute:
- a short noun phrase of 2 to 6 words, lowercase, no final period;
- it must read naturally after "a photo of a {bare}, which has ...", \
e.g. for a giraffe: "exceptionally long neck", "brown patches on yellow fur";
- describe what is visible (shape, parts, colour, texture, pattern, typical context), \
not behaviour, facts or the name itself;
- no two attributes may say the same thing.

Answer with a JSON object {{"attributes": [...]}} holding exactly {k} strings."""

_DOMAIN_CLAUSE = (
    " when it is depicted as {domain}; prefer attributes that remain visible in that "
    "style of depiction"
)


class InvalidAnswer(ValueError):
    """The model's answer broke the contract; the message says how, to re-ask with it."""


def quoted(text: str) -> str:
    """``text`` as a JSON string literal, every unprintable character escaped too (U+2028, ANSI)."""
    return "".join(c if c.isprintable() else json.dumps(c)[1:-1] for c in json.dumps(text, ensure_ascii=False))


def shown(name: str, limit: int = 80, quote: bool = False) -> str:
    """A class name (or any untrusted text) as a message line shows it: as is when printable and
    short, else ``repr`` cut to ``limit`` characters (``quote``: always ``repr``)."""
    if not quote and name.isprintable() and len(name) <= limit:
        return name
    text = repr(name[:limit])
    return text if len(name) <= limit and len(text) <= limit + 3 else text[:limit] + "..."


def listed(names: list[str], first: int = 3) -> str:
    """The first names (`shown`) and how many more: one bounded line however many there are."""
    more = f" and {len(names) - first} more" if len(names) > first else ""
    return ", ".join(shown(n) for n in names[:first]) + more


def display_name(class_name: str) -> str:
    """Folder-style names ('red_circle') are asked about as words."""
    return class_name.replace("_", " ").strip()


def build_messages(class_name: str, k: int = DEFAULT_K,
                   domain: str | None = None) -> list[dict[str, str]]:
    """System + user messages asking for ``k`` attributes of one class (optionally in a domain)."""
    clause = _DOMAIN_CLAUSE.format(domain=quoted(display_name(domain))[1:-1]) if domain else ""
    name = quoted(display_name(class_name))
    user = _USER_TEMPLATE.format(k=k, name=name, bare=name[1:-1], domain_clause=clause)
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": user}]


def reask_message(reason: str, k: int = DEFAULT_K) -> dict[str, str]:
    """Follow-up user turn after an invalid answer: says what was wrong so the retry can fix it."""
    return {"role": "user", "content": (
        f"That answer was invalid: {reason}. Reply again with a JSON object "
        f'{{"attributes": [...]}} holding exactly {k} distinct, non-empty phrases of at most '
        f"{MAX_PHRASE_WORDS} words each.")}


def response_schema(k: int = DEFAULT_K) -> dict:
    """JSON schema of one answer: ``{"attributes": [k strings]}``."""
    return {
        "type": "object",
        "properties": {
            "attributes": {
                "type": "array",
                "items": {"type": "string"},
                "minItems": k,
                "maxItems": k,
            },
        },
        "required": ["attributes"],
        "additionalProperties": False,
    }


def response_format(k: int = DEFAULT_K) -> dict:
    """The ``response_format`` argument of ``chat.completions.create`` (structured output)."""
    return {"type": "json_schema",
            "json_schema": {"name": SCHEMA_NAME, "strict": True, "schema": response_schema(k)}}


def clean_phrase(phrase: str) -> str:
    """Whitespace collapsed, surrounding quotes/bullets and a final period dropped."""
    text = " ".join(phrase.split()).strip("\"'`").lstrip("-*• ").rstrip(".").strip()
    return text


def phrase_problems(phrases: list[str], k: int | None = DEFAULT_K) -> list[str]:
    """Every way ``phrases`` breaks the contract (empty list = valid)."""
    problems: list[str] = []
    if k is not None and len(phrases) != k:
        problems.append(f"expected {k} phrases, got {len(phrases)}")
    seen: dict[str, int] = {}
    for i, phrase in enumerate(phrases):
        if not isinstance(phrase, str) or not phrase.strip():
            problems.append(f"phrase {i + 1} is empty")
            continue
        if len(phrase) > MAX_PHRASE_CHARS or len(phrase.split()) > MAX_PHRASE_WORDS:
            problems.append(f"phrase {i + 1} is too long ({len(phrase)} chars, "
                            f"max {MAX_PHRASE_CHARS} chars / {MAX_PHRASE_WORDS} words)")
        if not phrase.isprintable():
            problems.append(f"phrase {i + 1} holds control characters")
        key = phrase.strip().lower()
        seen[key] = seen.get(key, 0) + 1
        if seen[key] == 2:
            problems.append(f"duplicate phrase {shown(phrase, 40, quote=True)}")
    return problems


def parse_answer(content: str | None, k: int = DEFAULT_K) -> list[str]:
    """The cleaned phrases of one answer, or ``InvalidAnswer`` naming what is wrong."""
    if content is None or not content.strip():
        raise InvalidAnswer("the answer was empty")
    if len(content) > MAX_ANSWER_CHARS:
        raise InvalidAnswer(f"the answer was {len(content)} characters, more than {MAX_ANSWER_CHARS}")
    try:
        data = json.loads(content)
    except json.JSONDecodeError as exc:
        raise InvalidAnswer(f"the answer was not valid JSON ({exc.msg})") from None
    except RecursionError:
        raise InvalidAnswer("the answer was not valid JSON (nested too deeply)") from None
    expected = 'the answer was not {"attributes": [strings]}'
    if not isinstance(data, dict):
        raise InvalidAnswer(f"{expected} (a JSON {'list' if isinstance(data, list) else type(data).__name__})")
    if set(data) != {"attributes"}:
        raise InvalidAnswer(f"{expected} (other keys: {listed(sorted(set(data) - {'attributes'}))})")
    data = data["attributes"]
    if not isinstance(data, list) or not all(isinstance(p, str) for p in data):
        raise InvalidAnswer(expected)
    phrases = [clean_phrase(p) for p in data]
    problems = phrase_problems(phrases, k)
    if problems:
        raise InvalidAnswer("; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else ""))
    return phrases


# Offline placeholders: generic but valid phrases, replaced by a later online run.
OFFLINE_TEMPLATES = (
    "the typical shape of {a} {name}", "the characteristic colors of {a} {name}",
    "the distinctive texture of {a} {name}", "the usual size of {a} {name}",
    "the recognizable outline of {a} {name}", "the typical parts of {a} {name}",
    "the distinctive details of {a} {name}", "the common surroundings of {a} {name}",
    "the typical pattern of {a} {name}", "the overall look of {a} {name}",
)


def offline_attributes(class_name: str, k: int = DEFAULT_K) -> list[str]:
    """K template phrases from the class name alone, so training can run without an LLM.

    They obey the same contract as an LLM's answer (``phrase_problems``), so that
    ``fedmvp attributes check`` accepts what ``generate --offline`` wrote: where naming the class
    would make a phrase too long, it says "the object" (the sentence names the class anyway)."""
    name = display_name(class_name)
    article = "an" if name[:1].lower() in "aeiou" else "a"
    templates = [*OFFLINE_TEMPLATES, *(f"visual detail {i + 1} of {{a}} {{name}}"
                                       for i in range(len(OFFLINE_TEMPLATES), k))][:k]
    phrases = [t.format(a=article, name=name) for t in templates]
    return [p if not phrase_problems([p], None) else t.format(a="the", name="object")
            for p, t in zip(phrases, templates)]
