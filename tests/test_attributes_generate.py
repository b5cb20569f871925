"""`fedmvp attributes generate/check` against a real local HTTP server (the real openai SDK).

The server (tests/openai_stub_server.py) replays scripted replies per class: good answers,
429 with Retry-After, 500, malformed JSON, wrong phrase counts, dropped connections,
slow answers, 401. Nothing of the SDK is mocked.
"""

from __future__ import annotations

import json
import socket
import time
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

sys.path.insert(0, str(Path(__file__).parent))
from openai_stub_server import Reply, StubOpenAI, default_phrases, good, status  # noqa: E402

from fedmvp.attributes.files import META_KEY, load_attributes  # noqa: E402
from fedmvp.attributes.prompt import PROMPT_VERSION  # noqa: E402
from fedmvp_apps.cli import main  # noqa: E402

KEY = "sk-test-SECRET-0123456789"
FAST = ["--backoff", "0.01", "--timeout", "5", "--no-progress"]


@pytest.fixture
def classes(tmp_path: Path) -> Path:
    path = tmp_path / "classes.txt"
    path.write_text("# three animals\ngiraffe\nzebra\n\nred_circle\n")
    return path


def run(args: list[str], key: str | None = KEY, base_url: str | None = None) -> Result:
    env = {"OPENAI_API_KEY": key, "OPENAI_BASE_URL": base_url}
    return CliRunner().invoke(main, ["attributes", *args], env=env)


def generate(stub: StubOpenAI, classes: Path, out: Path, *extra: str) -> Result:
    return run(["generate", "--classes", str(classes), "--out", str(out),
                "--base-url", stub.base_url, "--model", "test-model", *FAST, *extra])


def test_good_run_writes_file_with_metadata(classes: Path, tmp_path: Path) -> None:
    out = tmp_path / "attributes" / "animals.json"
    with StubOpenAI() as stub:
        result = generate(stub, classes, out, "--json")
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["ok"] is True and summary["generated"] == ["giraffe", "zebra", "red_circle"]
    attrs = load_attributes(out, ["giraffe", "zebra", "red_circle"])
    assert attrs["zebra"] == default_phrases("zebra", 10)
    assert attrs["red_circle"] == default_phrases("red circle", 10)
    meta = json.loads(out.read_text())[META_KEY]
    assert meta["model"] == "test-model" and meta["prompt_version"] == PROMPT_VERSION
    assert meta["created"].startswith("20") and meta["offline"] is False
    assert len(stub.requests) == 3
    request = stub.requests[0]
    assert request.path == "/v1/chat/completions"
    assert request.headers["authorization"] == f"Bearer {KEY}"
    assert request.body["model"] == "test-model"
    assert request.body["response_format"]["type"] == "json_schema"
    assert request.body["response_format"]["json_schema"]["schema"]["properties"]["attributes"]["maxItems"] == 10
    assert KEY not in out.read_text() and KEY not in result.output


@pytest.mark.timed  # asserts on the wall clock: runs where the cores go first (docs/testing.md)
def test_retry_after_is_honoured_and_5xx_retried(classes: Path, tmp_path: Path) -> None:
    script = {"zebra": [status(429, "slow down", retry_after="1"), good()],
              "giraffe": [status(500), status(503), good()]}
    out = tmp_path / "a.json"
    with StubOpenAI(script) as stub:
        result = generate(stub, classes, out)
        zebra, giraffe = stub.requests_for("zebra"), stub.requests_for("giraffe")
    assert result.exit_code == 0, result.output
    assert len(zebra) == 2 and zebra[1].time - zebra[0].time >= 0.95  # Retry-After: 1, base 0.01
    assert len(giraffe) == 3 and giraffe[2].time - giraffe[0].time < 0.9
    assert "giraffe: HTTP 500, retrying in 0.0s (attempt 2/6)" in result.stderr
    assert "giraffe: HTTP 503, retrying in 0.0s (attempt 3/6)" in result.stderr
    assert "zebra: HTTP 429, retrying in 1.0s" in result.stderr
    assert len(load_attributes(out)) == 3


def test_malformed_json_dropped_connection_and_timeout_recover(classes: Path, tmp_path: Path) -> None:
    script = {"zebra": [Reply("bad_json_content"), good()],
              "giraffe": [Reply("drop"), Reply("bad_body"), good()],
              "red_circle": [Reply("good", delay=1.5), good()]}
    out = tmp_path / "a.json"
    with StubOpenAI(script) as stub:
        result = generate(stub, classes, out, "--timeout", "0.4")
        zebra = stub.requests_for("zebra")
        assert len(stub.requests_for("giraffe")) == 3 and len(stub.requests_for("red_circle")) == 2
    assert result.exit_code == 0, result.output
    reask = zebra[1].body["messages"]
    assert reask[-2]["role"] == "assistant" and "That answer was invalid" in reask[-1]["content"]
    assert "not valid JSON" in reask[-1]["content"]
    assert "no answer within 0.4s" in result.stderr and "connection failed" in result.stderr
    assert set(load_attributes(out)) == {"giraffe", "zebra", "red_circle"}


def test_wrong_count_fails_class_keeps_others_and_rerun_asks_only_missing(
        classes: Path, tmp_path: Path) -> None:
    seven = [f"striped trait {i}" for i in range(7)]
    out = tmp_path / "a.json"
    with StubOpenAI({"zebra": [good(seven)] * 3}) as stub:
        result = generate(stub, classes, out, "--json")
        assert len(stub.requests_for("zebra")) == 3  # first ask + 2 re-asks
    assert result.exit_code == 1
    summary = json.loads(result.stdout)
    assert summary["failed"] == {"zebra": "invalid answer after 3 tries: expected 10 phrases, got 7"}
    assert "error: zebra: invalid answer after 3 tries" in result.stderr
    on_disk = json.loads(out.read_text())
    assert set(on_disk) == {META_KEY, "giraffe", "red_circle"}
    with pytest.raises(ValueError, match="1 of 3 classes missing: zebra"):
        load_attributes(out, ["giraffe", "zebra", "red_circle"])

    with StubOpenAI() as stub:  # resume: only the failed class is asked for
        again = generate(stub, classes, out, "--json")
        asked = {r.class_name for r in stub.requests}
    assert again.exit_code == 0, again.output
    assert asked == {"zebra"} and json.loads(again.stdout)["kept"] == ["giraffe", "red_circle"]
    assert list(load_attributes(out)) == ["giraffe", "zebra", "red_circle"]  # class-list order
    assert json.loads(out.read_text())[META_KEY]["runs"][-1]["generated"] == 1


def test_paper_file_is_resumed_without_touching_its_phrases(classes: Path, tmp_path: Path) -> None:
    out = tmp_path / "paper.json"
    mine = [f"hand written {i}" for i in range(10)]
    out.write_text(json.dumps({"okapi": mine[::-1], "giraffe": mine}))
    with StubOpenAI() as stub:
        result = generate(stub, classes, out)
        assert {r.class_name for r in stub.requests} == {"zebra", "red circle"}
    assert result.exit_code == 0, result.output
    assert load_attributes(out)["giraffe"] == mine
    assert list(load_attributes(out)) == ["giraffe", "zebra", "red_circle", "okapi"]  # extras kept


def test_auth_error_stops_early_keeps_answers_and_redacts_key(classes: Path, tmp_path: Path) -> None:
    out = tmp_path / "a.json"
    script = {"zebra": [status(401, f"Incorrect API key provided: {KEY}")]}
    with StubOpenAI(script) as stub:
        result = generate(stub, classes, out, "--concurrency", "1", "--json")
        assert [r.class_name for r in stub.requests] == ["giraffe", "zebra"]
    assert result.exit_code == 1
    summary = json.loads(result.stdout)
    assert summary["generated"] == ["giraffe"] and summary["skipped"] == ["red_circle"]
    assert "HTTP 401" in summary["aborted"] and "***" in summary["aborted"]
    assert "stopping: HTTP 401" in result.stderr
    assert KEY not in result.output and KEY not in out.read_text()
    assert list(load_attributes(out)) == ["giraffe"]


def test_concurrency_is_bounded(tmp_path: Path) -> None:
    names = tmp_path / "six.json"
    names.write_text(json.dumps([f"class{i}" for i in range(6)]))
    script = {f"class{i}": [Reply("good", delay=0.2)] for i in range(6)}
    with StubOpenAI(script) as stub:
        result = generate(stub, names, tmp_path / "a.json", "--concurrency", "2")
        assert stub.max_inflight == 2
    assert result.exit_code == 0, result.output


def test_unreachable_server_is_one_clear_failure(classes: Path, tmp_path: Path) -> None:
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    out = tmp_path / "a.json"
    result = run(["generate", "--classes", str(classes), "--out", str(out), "--base-url",
                  f"http://127.0.0.1:{port}/v1", "--max-retries", "1", *FAST], key=None)
    assert result.exit_code == 1
    assert f"cannot reach http://127.0.0.1:{port}/v1 after 2 attempts" in result.stderr
    assert not out.exists()


def test_no_key_no_server_is_usage_error_and_offline_works(classes: Path, tmp_path: Path) -> None:
    out = tmp_path / "a.json"
    result = run(["generate", "--classes", str(classes), "--out", str(out)], key=None)
    assert result.exit_code == 2
    assert "no OPENAI_API_KEY" in result.stderr and "--offline" in result.stderr
    assert not out.exists()

    offline = run(["generate", "--classes", str(classes), "--out", str(out), "--offline"], key=None)
    assert offline.exit_code == 0, offline.output
    meta = json.loads(out.read_text())[META_KEY]
    assert meta["offline"] is True and meta["offline_classes"] == ["giraffe", "zebra", "red_circle"]
    assert meta["runs"][0]["model"] == "offline-template"
    assert load_attributes(out)["red_circle"][0] == "the typical shape of a red circle"

    with StubOpenAI() as stub:  # an online rerun replaces the placeholders
        online = generate(stub, classes, out)
        assert len(stub.requests) == 3
    assert online.exit_code == 0, online.output
    meta = json.loads(out.read_text())[META_KEY]
    assert meta["offline"] is False and meta["offline_classes"] == [] and len(meta["runs"]) == 2
    assert load_attributes(out)["giraffe"] == default_phrases("giraffe", 10)


def test_bad_inputs_exit_2_with_one_line(classes: Path, tmp_path: Path) -> None:
    both = run(["generate", "--classes", str(classes), "--preset", "x", "--offline"])
    assert both.exit_code == 2 and "exactly one of --classes FILE or --preset NAME" in both.stderr
    gone = run(["generate", "--classes", str(tmp_path / "nope.txt"), "--offline"])
    assert gone.exit_code == 2 and f"{tmp_path / 'nope.txt'}: no such class list" in gone.stderr
    corrupt = tmp_path / "corrupt.json"
    corrupt.write_text("{oops")
    bad_out = run(["generate", "--classes", str(classes), "--out", str(corrupt), "--offline"])
    assert bad_out.exit_code == 2 and f"{corrupt}: not valid JSON" in bad_out.stderr
    assert corrupt.read_text() == "{oops"
    assert len(bad_out.stderr.strip().splitlines()) == 1


def test_existing_file_for_another_domain_is_refused(classes: Path, tmp_path: Path) -> None:
    out = tmp_path / "a.json"
    assert run(["generate", "--classes", str(classes), "--out", str(out), "--offline",
                "--domain", "sketch"]).exit_code == 0
    assert json.loads(out.read_text())[META_KEY]["domain"] == "sketch"
    other = run(["generate", "--classes", str(classes), "--out", str(out), "--offline",
                 "--domain", "photo"])
    assert other.exit_code == 2 and "generated for domain 'sketch', not 'photo'" in other.stderr


def test_domain_hint_reaches_the_prompt(tmp_path: Path) -> None:
    names = tmp_path / "one.txt"
    names.write_text("giraffe\n")
    with StubOpenAI() as stub:
        assert generate(stub, names, tmp_path / "a.json", "--domain", "sketch").exit_code == 0
        user = stub.requests[0].body["messages"][1]["content"]
    assert "depicted as sketch" in user


def test_check_command(classes: Path, tmp_path: Path) -> None:
    good_file = tmp_path / "good.json"
    good_file.write_text(json.dumps({c: default_phrases(c, 10) for c in ["giraffe", "zebra", "red_circle"]}))
    ok = run(["check", str(good_file), "--classes", str(classes)])
    assert ok.exit_code == 0 and "no metadata" in ok.stdout and ok.stdout.strip().endswith("ok")
    partial = tmp_path / "partial.json"
    partial.write_text(json.dumps({"giraffe": ["neck", "neck"] + [f"p{i}" for i in range(8)],
                                   "zebra": ["stripes"]}))
    bad = run(["check", str(partial), "--classes", str(classes), "--json"])
    assert bad.exit_code == 1
    report = json.loads(bad.stdout)
    assert report["missing"] == ["red_circle"]
    assert report["problems"] == {"giraffe": ["duplicate phrase 'neck'"],
                                  "zebra": ["1 phrases, need 10"]}


def test_preset_classes_and_domains_come_from_a_real_preset(tmp_path: Path, monkeypatch) -> None:
    """--preset/--domain read the class list and domains of a real preset (an ImageFolder tree)."""
    from data_trees import imagefolder

    imagefolder(tmp_path / "toy" / "train", ["giraffe", "zebra"], n=1)
    imagefolder(tmp_path / "toy" / "test", ["giraffe", "zebra"], n=1)
    (tmp_path / "toy.toml").write_text(
        'protocol = "ssmt"\n[train]\nrounds = 1\n[[datasets]]\nname = "toy"\nlayout = "imagefolder"\n'
        'root = "toy"\ndomain = "sketch"\n')
    monkeypatch.chdir(tmp_path)  # the default --out is relative: attributes/<preset>_<domain>.json
    runner = CliRunner()
    ok = runner.invoke(main, ["attributes", "generate", "--preset", "toy.toml", "--domain",
                              "sketch", "--offline"], env={"OPENAI_API_KEY": None})
    assert ok.exit_code == 0, ok.output
    written = Path("attributes/toy_sketch.json")
    assert list(load_attributes(written)) == ["giraffe", "zebra"]
    assert json.loads(written.read_text())[META_KEY]["domain"] == "sketch"
    typo = runner.invoke(main, ["attributes", "generate", "--preset", "toy.toml", "--domain",
                                "skecth", "--offline"])
    assert typo.exit_code == 2
    assert "preset 'toy.toml' has no domain 'skecth'; its domains are: sketch" in typo.stderr
    unknown = runner.invoke(main, ["attributes", "generate", "--preset", "nope", "--offline"])
    assert unknown.exit_code == 2 and "preset 'nope'" in unknown.stderr


def test_answer_containing_the_key_is_dropped_and_the_key_never_written(classes: Path, tmp_path: Path) -> None:
    """A server that echoes the key inside an answer: the answer is re-asked, never stored, never shown."""
    leaky = [f"stripes {KEY}"] + [f"zebra trait {i}" for i in range(9)]
    out = tmp_path / "out" / "a.json"
    script = {"zebra": [good(leaky), good()], "giraffe": [good(leaky)] * 3}
    with StubOpenAI(script) as stub:
        result = generate(stub, classes, out, "--json", "-v")
        reasked = stub.requests_for("zebra")[1].body["messages"]
    assert result.exit_code == 1
    summary = json.loads(result.stdout)
    assert summary["generated"] == ["zebra", "red_circle"]
    assert "contained the API key" in summary["failed"]["giraffe"]
    assert "contained the API key; it was dropped" in result.stderr
    assert KEY not in json.dumps(reasked)
    assert load_attributes(out)["zebra"] == default_phrases("zebra", 10)
    assert KEY not in result.stdout and KEY not in result.stderr
    for path in tmp_path.rglob("*"):
        assert not path.is_file() or KEY.encode() not in path.read_bytes(), path


@pytest.mark.timed  # asserts on the wall clock: runs where the cores go first (docs/testing.md)
def test_timeout_bounds_the_whole_answer_of_a_trickling_server(tmp_path: Path) -> None:
    """A byte every 0.3 s keeps every read under the timeout; --timeout 1 must still end each try at 1 s."""
    names = tmp_path / "one.txt"
    names.write_text("zebra\n")
    out = tmp_path / "a.json"
    with StubOpenAI({"zebra": [Reply("trickle", delay=0.3)] * 2}) as stub:
        started = time.monotonic()
        result = generate(stub, names, out, "--timeout", "1", "--max-retries", "1")
        elapsed = time.monotonic() - started
        assert len(stub.requests_for("zebra")) == 2
    assert result.exit_code == 1, result.output
    assert "no answer within 1s" in result.stderr and "gave up after 2 attempts" in result.stderr
    assert elapsed < 6, elapsed  # two 1 s deadlines, not the trickle's minutes
    assert not out.exists()


@pytest.mark.parametrize("name", ["x" * 10_000, "Aston Martin V8 Vantage Convertible 2012", "a" * 60])
def test_offline_file_passes_check_whatever_the_name(tmp_path: Path, name: str) -> None:
    """generate --offline and check hold phrases to one contract, even for absurd class names."""
    names = tmp_path / "names.json"
    names.write_text(json.dumps([name, "giraffe"]))
    out = tmp_path / "a.json"
    assert run(["generate", "--classes", str(names), "--out", str(out), "--offline"]).exit_code == 0
    checked = run(["check", str(out), "--classes", str(names)])
    assert checked.exit_code == 0, checked.output
    assert load_attributes(out)["giraffe"][0] == "the typical shape of a giraffe"
