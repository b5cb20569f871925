"""What a site (`fedmvp join`) or device (`edge-client join`) operator sees: our lines, not Flower's.

The SuperNode and the warm executor are Flower processes whose console is Flower's INFO log (every
message received and sent, the local Runtime API's own reconnections and their "Connection
successful"). `become_supernode` reads both through pipes and passes each line through `NodeLines`:

* a line our code wrote (``MARK`` first: the ClientApp's round lines, the SuperNode's run-end line)
  is shown without the mark;
* Flower's INFO records (and uvicorn's) are dropped, except the SuperNode's first ``SuperNode ID``
  (shown as ``connected to ADDRESS``) and a reconnection after the link was lost;
* Flower's WARNING and ERROR records are shown, prefixed ``flower:``, but for the retry noise:
  the first failed try after a connection is one line (``lost the SuperLink at ...``), and the
  executor's tries at its own SuperNode's local API are not shown;
* an edge device's own INFO lines (``edge: ...``: a refresh, the runtime chosen, its personalised
  LoRA) are shown, but for its round lines, which ours replace;
* a refusal of the node's key is recognised (``key_refused``) and its Flower error block replaced
  by one line naming ``--auth-key`` and ``fedmvp serve --node-keys`` (docs/tutorials/across-machines.md).

Flower's whole log, INFO included, is appended to the file ``FEDMVP_FLOWER_LOG`` names, when set
(docs/tutorials/across-machines.md). Imports neither ``fedmvp`` nor torch (an edge device runs it).
"""

from __future__ import annotations

import re
import sys
import threading
from typing import IO, Callable

FLOWER_LOG_ENV = "FEDMVP_FLOWER_LOG"  # a file: Flower's whole log of both processes appended there too
MARK = "[fedmvp] "  # a line of ours among a Flower process's output (node_app, supernode_process)
_FLOWER = re.compile(r"^(DEBUG|INFO|WARNING|ERROR|CRITICAL) +: +(.*)$")  # Flower's console format
_OTHER = re.compile(r"^(DEBUG|INFO|WARNING|ERROR|CRITICAL):(.*)$")  # Python's default format, uvicorn's
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_QUIET = ("EXPERIMENTAL: SuperExec authentication", "Option `--insecure` was set")  # said by us already
EDGE_SAYS = "edge: "  # edge_client.node's INFO lines meant for the device's operator
NO_KEY = "must be registered via the CLI"  # Flower: the SuperLink admits only listed keys, none given
BAD_KEY = "Failed to activate SuperNode"  # Flower: a key the SuperLink does not list


def key_line(command: str, address: str, refusal: str) -> str:
    """The one line of a node refused for its key: which flag, and what the server operator does. Flower
    says the same of a key the server does not list and of a listed node it still counts online after a
    crash (up to a minute): that line names both, and its exit is not 2 (a service manager retries)."""
    command = "fedmvp join" if command == "join" else command
    admit = (f"the server's operator must list its public key (NODE_KEY.pub) in `fedmvp serve --node-keys FILE` "
             f"(docs/tutorials/across-machines.md)")
    if refusal == NO_KEY:
        return (f"error: the SuperLink at {address} admits only listed node keys and this node gave none: pass "
                f"{command} --auth-key NODE_KEY (this node's private key from `fedmvp certs`); {admit}")
    return (f"error: the SuperLink at {address} refused this node's key (--auth-key): {admit}; if it is "
            f"listed, the server still counts this node online after a crash: join again in a minute")


class NodeLines:
    """Turns the output of a node's two Flower processes into the operator's lines (see above)."""

    def __init__(self, address: str, say: Callable[[str], None], raw: IO[str] | None = None) -> None:
        self.address, self.say, self.raw = address, say, raw  # raw: every line as Flower wrote it (FLOWER_LOG_ENV)
        self.connected = False  # the SuperNode reached the SuperLink (and has not lost it since)
        self.ever_connected = False
        self.key_refused: str | None = None
        self._mode: dict[str, str] = {}  # each source's last record: "show", "drop" or "hold" (an error)
        self._held: dict[str, list[str]] = {}
        self._lock = threading.Lock()

    def feed(self, source: str, raw: str) -> None:
        """One line of ``source`` ("supernode" or "executor")."""
        with self._lock:
            line = _ANSI.sub("", raw.rstrip("\n"))
            if self.raw is not None:
                self.raw.write(f"{source}: {line}\n")
                self.raw.flush()
            if line.startswith(MARK):
                self.say(line[len(MARK):])
                return
            record = _FLOWER.match(line) or _OTHER.match(line)
            if record is None:  # a continuation of the last record (a traceback, flwr_exit's block)
                if source == "supernode" and (refusal := next((r for r in (NO_KEY, BAD_KEY) if r in line), None)):
                    self.key_refused = refusal
                mode = self._mode.get(source, "show")
                if mode == "hold":
                    self._held[source].append(line)
                elif mode == "show" and line.strip():
                    self.say(line)
                return
            self._flush(source)
            level, text = record.groups()
            shown = self._record(source, level, text)
            if shown is not None and record.re is _OTHER:
                shown = line  # another library's record (Python's logging format): as it was
            if shown is None:
                self._mode[source] = "drop"
            elif source == "supernode" and level in ("ERROR", "CRITICAL"):  # held: it may be a key refusal
                self._mode[source], self._held[source] = "hold", [shown]
            else:
                self._mode[source] = "show"
                self.say(shown)

    def flush(self, source: str) -> None:
        """The end of ``source``'s output: its held error block shown (unless a key refusal)."""
        with self._lock:
            self._flush(source)

    def _flush(self, source: str) -> None:
        held = self._held.pop(source, [])
        if not self.key_refused:
            for line in held:
                self.say(line)

    def _record(self, source: str, level: str, text: str) -> str | None:
        if source == "supernode":
            if text.startswith("SuperNode ID"):
                self.connected = self.ever_connected = True
                return f"connected to {self.address}"
            if text.startswith("Connection attempt failed"):
                if self.connected:
                    self.connected = False
                    return f"lost the SuperLink at {self.address}; trying again until it answers (Ctrl-C stops)"
                return None
            if text.startswith("Connection successful"):
                if self.ever_connected and not self.connected:
                    self.connected = True
                    return f"connected to {self.address} again"
                return None
            for refusal in (NO_KEY, BAD_KEY):
                if refusal in text:
                    self.key_refused = refusal
                    return None
        elif "Connection attempt failed" in text or "Connection successful" in text:
            return None  # the executor's tries at its SuperNode's own local API
        elif text.startswith(EDGE_SAYS) and not text.startswith("edge: round "):
            return text  # a device's own news (a refresh, its runtime, its personalised LoRA); rounds: ours
        if level in ("DEBUG", "INFO") or any(text.startswith(quiet) for quiet in _QUIET):
            return None
        return f"flower: {level}: {text}"


def pump(stream: IO[str], source: str, lines: NodeLines) -> threading.Thread:
    """Read ``stream`` (a child's merged stdout and stderr) into ``lines`` on a daemon thread."""
    def run() -> None:
        for raw in iter(stream.readline, ""):
            lines.feed(source, raw)
        lines.flush(source)
    thread = threading.Thread(target=run, daemon=True, name=f"lines-{source}")
    thread.start()
    return thread


def say(line: str) -> None:
    """The join's terminal: one line, at once (Flower's warnings and errors on stderr)."""
    print(line, file=sys.stderr if line.startswith(("flower:", "error:")) else sys.stdout, flush=True)
