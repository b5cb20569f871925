"""An open federation's sites: each name the server meets gets the next id, kept in the run directory.

A [federation] preset without [[sites]] lists no site (docs/architecture.md "Open membership"): a site
joins with its folder and its name (`fedmvp join --data DIR --name NAME`, default the host name). The
server learns the name when the node identifies itself (``sampling.NodeRegistry``) and numbers it here,
in order of first appearance. The list is written (atomically) before the site is sent any work, so a
resumed server and a rejoining site keep their id: the id keys the site's LoRA switch, its records in
state.json and its seeds, as a listed site's place does. ``RUN/sites.json``::

    {"format": "fedmvp-sites", "version": 1, "run_id": "...", "sites": [{"id": 0, "name": "clinic-3"}, ...]}

The file is checked when it is read: anything else is one line naming it (``SiteRegistryError``).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedmvp_formats.messages import site_name_problem as name_problem

from fedmvp import atomic
from fedmvp.federated.replies import ClassRules

REGISTRY_FILE = "sites.json"
FORMAT, VERSION = "fedmvp-sites", 1


class SiteRegistryError(ValueError):
    """sites.json that cannot be used; one line naming the file and the problem."""


class SiteRegistry:
    """name -> id of an open federation's sites, persisted in ``RUN/sites.json`` on every new name."""

    def __init__(self, path: Path, run_id: str, names: list[str] | None = None):
        self.path, self.run_id = Path(path), run_id
        self._names: list[str] = list(names or [])
        self._ids = {name: i for i, name in enumerate(self._names)}

    @classmethod
    def load(cls, run_path: str | Path, run_id: str) -> "SiteRegistry":
        """The run's registry (empty when the run has none yet), every entry checked."""
        path = Path(run_path) / REGISTRY_FILE
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return cls(path, run_id)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            raise SiteRegistryError(f"{path}: unreadable site registry ({' '.join(str(err).split())})") from None
        return cls(path, run_id, _names(path, record, run_id))

    @property
    def names(self) -> list[str]:
        """The sites' names in id order."""
        return list(self._names)

    def id_of(self, name: str) -> int | None:
        return self._ids.get(name)

    def register(self, name: str) -> int:
        """``name``'s id: its own if met before, else the next one, written before it is returned."""
        if name in self._ids:
            return self._ids[name]
        problem = name_problem(name)
        if problem is not None:
            raise SiteRegistryError(problem)
        names = [*self._names, name]
        atomic.write_json(self.path, {"format": FORMAT, "version": VERSION, "run_id": self.run_id,
                                      "sites": [{"id": i, "name": n} for i, n in enumerate(names)]})
        self._names, self._ids[name] = names, len(names) - 1
        return self._ids[name]


def _names(path: Path, record: Any, run_id: str) -> list[str]:
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        raise SiteRegistryError(f"{path}: not a {FORMAT} record")
    version = record.get("version")
    if not isinstance(version, int) or isinstance(version, bool) or not 1 <= version <= VERSION:
        raise SiteRegistryError(f"{path}: version {version!r} (this fedmvp reads 1..{VERSION})")
    if record.get("run_id") != run_id:
        raise SiteRegistryError(f"{path}: the site registry of run {record.get('run_id')!r}, not of this run "
                                f"({run_id})")
    entries = record.get("sites")
    if not isinstance(entries, list):
        raise SiteRegistryError(f"{path}: sites must be a list")
    names: list[str] = []
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict) or entry.get("id") != i or isinstance(entry.get("id"), bool):
            raise SiteRegistryError(f"{path}: sites[{i}] must be {{\"id\": {i}, \"name\": ...}} (ids in order)")
        problem = name_problem(entry.get("name"))
        if problem is not None:
            raise SiteRegistryError(f"{path}: sites[{i}]: {problem}")
        if entry["name"] in names:
            raise SiteRegistryError(f"{path}: sites[{i}]: name {entry['name']!r} is numbered twice")
        names.append(entry["name"])
    return names


@dataclass
class OpenSites:
    """What the server knows of an open federation: the registry, and its federation record as it
    stands (``record_of(names)``: the plan of those sites, ``federation_plan.plan_record``)."""

    registry: SiteRegistry
    record_of: Callable[[list[str]], dict]

    def record(self) -> dict:
        return self.record_of(self.registry.names)

    def view(self) -> tuple[dict, dict[int, str], dict[int, None], ClassRules]:
        """What the strategy holds of the sites, as numbered so far: the record (each site's base and new
        sets), the names by id, the example bounds (None: a folder the server never sees, bounded by
        [server] site_max_examples) and the classes each may claim."""
        record, names = self.record(), self.registry.names
        return record, dict(enumerate(names)), {site: None for site in range(len(names))}, \
            ClassRules.from_record(record)
