"""What each message cost the SuperLink, read from the SuperLink's own database.

Flower stores a message as objects (``Message`` -> ``RecordDict`` -> records -> ``Array``s -> chunks)
and serves each with a request and a transaction (docs/benchmarks.md "deploy"). ``watch`` adds two log
tables and their triggers to the SuperLink's SQLite file (``fedmvp serve`` keeps it beside the run:
``.<run>.flwr/superlink.db``) once Flower created its tables: every object and parent -> child link the
SuperLink stores is logged, and every message, even after Flower deletes them once delivered. ``message_objects``
then counts each message's object tree from its root (a message's id is its ``Message`` object's id),
each message's id and type logged as the SuperLink stores it. For tests and the deploy benchmark: the
server never calls this.
"""

from __future__ import annotations

import sqlite3
import time
from collections import defaultdict
from pathlib import Path

_WATCH = """
CREATE TABLE IF NOT EXISTS fedmvp_object_log (object_id TEXT);
CREATE TABLE IF NOT EXISTS fedmvp_child_log (parent_id TEXT, child_id TEXT);
CREATE TABLE IF NOT EXISTS fedmvp_message_log (message_id TEXT, message_type TEXT);
CREATE TRIGGER IF NOT EXISTS fedmvp_object_logged AFTER INSERT ON objects
BEGIN INSERT INTO fedmvp_object_log VALUES (NEW.object_id); END;
CREATE TRIGGER IF NOT EXISTS fedmvp_child_logged AFTER INSERT ON object_children
BEGIN INSERT INTO fedmvp_child_log VALUES (NEW.parent_id, NEW.child_id); END;
"""
# Flower 1.42's SuperLink keeps a message in message_ins (to a node) or message_res (its reply) until it is
# delivered, then deletes it: its id and type are logged on the way in.
_MESSAGE_TABLES = ("message_ins", "message_res")
_MESSAGE_TRIGGER = """CREATE TRIGGER IF NOT EXISTS fedmvp_{table}_logged AFTER INSERT ON {table}
BEGIN INSERT INTO fedmvp_message_log VALUES (NEW.message_id, NEW.message_type); END;"""


def superlink_database(run_dir: Path) -> Path:
    """The SuperLink database `fedmvp serve --run-dir RUN_DIR` writes."""
    from fedmvp_apps.deploy.superlink import flower_home

    return flower_home(run_dir) / "superlink.db"


def _tables(connection: sqlite3.Connection) -> set[str]:
    return {row[0] for row in connection.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}


def watch(database: Path, timeout: float = 60.0) -> None:
    """Log every object the SuperLink at ``database`` stores from now on (waits for Flower's tables)."""
    deadline = time.monotonic() + timeout
    while True:
        if database.exists():
            with sqlite3.connect(database, timeout=30) as connection:
                if {"objects", "object_children", *_MESSAGE_TABLES} <= _tables(connection):
                    connection.executescript(_WATCH + "\n".join(_MESSAGE_TRIGGER.format(table=table)
                                                                for table in _MESSAGE_TABLES))
                    return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{database}: no SuperLink tables within {timeout:.0f} s")
        time.sleep(0.2)


def message_objects(database: Path) -> dict[str, list[int]]:
    """Message type (``train``, ``evaluate``, ``query.identify``; a reply's is its request's) -> the
    object count of each message stored since ``watch``, the Message object included."""
    with sqlite3.connect(database, timeout=30) as connection:
        logged = {row[0] for row in connection.execute("SELECT object_id FROM fedmvp_object_log")}
        children: dict[str, set[str]] = defaultdict(set)
        for parent, child in connection.execute("SELECT DISTINCT parent_id, child_id FROM fedmvp_child_log"):
            children[parent].add(child)
        messages = connection.execute("SELECT DISTINCT message_id, message_type FROM fedmvp_message_log").fetchall()
    out: dict[str, list[int]] = defaultdict(list)
    for message_id, kind in messages:
        if message_id not in logged:
            continue  # stored before the watch began
        seen, todo = set(), [message_id]
        while todo:
            node = todo.pop()
            if node not in seen:
                seen.add(node)
                todo.extend(children.get(node, ()))
        out[kind].append(len(seen))
    return dict(out)


def objects_per_message(database: Path) -> float | None:
    """The mean object count of the messages stored since ``watch`` (None: none)."""
    counts = [n for per_kind in message_objects(database).values() for n in per_kind]
    return round(sum(counts) / len(counts), 2) if counts else None
