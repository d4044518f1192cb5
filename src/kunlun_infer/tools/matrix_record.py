"""A version matrix that remembers: every ``doctor`` outcome, kept per machine and shared by file.

``kunlun-infer doctor`` appends one JSON line per run to a local record: when
and where it ran, the config's capability choices, every installed plugin's
version and the stack beneath each (``plugin_info``), the device's identity
and stack versions (stage 1), and each stage's pass/fail — for a failure, the
stage, layer, plugin and first line of the message. ``kunlun-infer plugins
--matrix`` then answers, for the plugins installed now and each config the
record knows: *passed here before*, *failed (at stage N)*, or *new* (with what
changed since that config's last recorded run). ``--export``/``--import``
move the record between machines, so a team keeps one matrix.

Two runs are of the same combination for a config when the framework
version, the hook API, and the version, distribution and stack of each
plugin serving that config are equal; plugins the config does not use do not
matter. The record lives at ``$KUNLUN_INFER_MATRIX_RECORD``, else
``$XDG_STATE_HOME/kunlun_infer/doctor-runs.jsonl``, else
``~/.local/state/kunlun_infer/doctor-runs.jsonl`` (``--record FILE`` on the
commands wins over all three).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import socket
import uuid
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from kunlun_infer.errors import KunlunInferError
from kunlun_infer.hookspecs import CAPABILITIES, HOOK_API_VERSION_STR
from kunlun_infer.version import __version__

RECORD_ENV = "KUNLUN_INFER_MATRIX_RECORD"
SCHEMA = 1
PASSED, FAILED, NEW = "passed", "failed", "new"


class RecordError(KunlunInferError):
    """A record file that cannot be read, written or imported; the message names the file (and line)."""


def record_path(explicit: str | os.PathLike[str] | None = None,
                environ: Mapping[str, str] | None = None) -> Path:
    """Where the record lives: ``explicit``, else ``$KUNLUN_INFER_MATRIX_RECORD``, else the user's state dir."""
    environ = os.environ if environ is None else environ
    if explicit:
        return Path(explicit).expanduser()
    if environ.get(RECORD_ENV):
        return Path(environ[RECORD_ENV]).expanduser()
    state = environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(state) / "kunlun_infer" / "doctor-runs.jsonl"


# ---------------------------------------------------------------------- what is installed


def installed(manager: Any) -> dict[str, Any]:
    """The framework and every plugin the manager knows: version, distribution, options, stack, load error."""
    plugins = {}
    for row in manager.describe():
        dist = f"{row['distribution']} {row['distribution_version']}" if row["distribution"] else row["source"]
        plugins[row["name"]] = {"version": row["version"], "distribution": dist, "stack": dict(row["stack"]),
                                "options": {c: list(o) for c, o in row["options"].items()},
                                "error": row["error"]}
    return {"framework": {"kunlun-infer": __version__, "hook_api": HOOK_API_VERSION_STR}, "plugins": plugins}


def serving(plugins: Mapping[str, Any], config: Mapping[str, str]) -> dict[str, str | None]:
    """``capability -> plugin name`` serving each of ``config``'s choices among ``plugins`` (None: none does)."""
    found: dict[str, str | None] = {}
    for capability, option in config.items():
        found[capability] = next((name for name, p in plugins.items()
                                  if option in p.get("options", {}).get(capability, [])), None)
    return found


def combination(state: Mapping[str, Any], config: Mapping[str, str]) -> dict[str, Any] | None:
    """What makes two runs of ``config`` comparable: framework, and each serving plugin's version and stack.

    None when a choice of ``config`` has no plugin in ``state`` (it cannot run here).
    """
    plugins = state["plugins"]
    chosen = serving(plugins, config)
    if any(name is None for name in chosen.values()):
        return None
    return {"framework": dict(state["framework"]),
            "plugins": {name: {k: plugins[name][k] for k in ("version", "distribution", "stack")}
                        for name in sorted(set(chosen.values()))}}


def differences(before: Mapping[str, Any], now: Mapping[str, Any]) -> list[str]:
    """``"kunlun 0.1.0 -> 0.2.0"``, ``"kunlun: torch 2.5.1 -> 2.9.0"`` … between two combinations."""
    changes = [f"{k} {before['framework'].get(k)} -> {v}" for k, v in now["framework"].items()
               if before["framework"].get(k) != v]
    old_plugins, new_plugins = before["plugins"], now["plugins"]
    for name in sorted(set(old_plugins) | set(new_plugins)):
        old, new = old_plugins.get(name), new_plugins.get(name)
        if old is None or new is None:
            changes.append(f"plugin {name} {'added' if old is None else 'removed'}")
            continue
        if old["version"] != new["version"] or old["distribution"] != new["distribution"]:
            changes.append(f"{name} {old['version']} ({old['distribution']}) -> {new['version']} "
                           f"({new['distribution']})")
        for key in sorted(set(old["stack"]) | set(new["stack"])):
            if old["stack"].get(key) != new["stack"].get(key):
                changes.append(f"{name}: {key} {old['stack'].get(key, '-')} -> {new['stack'].get(key, '-')}")
    return changes


# ---------------------------------------------------------------------- one doctor run


def entry_from_report(report: Any, manager: Any, *, when: datetime.datetime | None = None,
                      host: str | None = None) -> dict[str, Any]:
    """The record line for one doctor ``report`` run with ``manager``'s plugins."""
    stages = [{"number": s.number, "name": s.name, "status": s.status, "seconds": round(s.seconds, 3)}
              for s in report.stages]
    failed = report.failed
    failure = None
    if failed is not None and failed.failure is not None:
        f = failed.failure
        failure = {"stage": failed.number, "name": failed.name, "layer": f.layer, "plugin": f.plugin, "hook": f.hook,
                   "message": (f.message.splitlines() or [""])[0][:300]}
    device_stage = next((s for s in report.stages if s.number == 1), None)
    device = {}
    if device_stage is not None and device_stage.data:
        device = {"identity": dict(device_stage.data.get("identity", {})),
                  "stack": {k: str(v) for k, v in device_stage.data.get("stack", {}).items()}}
    ran = [s for s in report.stages if s.status != "not run"]
    return {
        "schema": SCHEMA,
        "id": uuid.uuid4().hex,
        "when": (when or datetime.datetime.now(datetime.timezone.utc)).isoformat(timespec="seconds"),
        "host": host or socket.gethostname(),
        "config": dict(report.config),
        "outcome": PASSED if report.ok else FAILED,
        "stages_run": [s.number for s in ran],
        "stages": stages,
        "failure": failure,
        "device": device,
        "installed": installed(manager),
    }


# ---------------------------------------------------------------------- the file


_REQUIRED = ("schema", "id", "when", "config", "outcome", "stages", "installed")


def _check_entry(entry: Any, where: str) -> dict[str, Any]:
    if not isinstance(entry, dict) or any(k not in entry for k in _REQUIRED):
        missing = [k for k in _REQUIRED if not isinstance(entry, dict) or k not in entry]
        raise RecordError(f"{where}: not a doctor run record (missing {', '.join(missing)}); was it written by "
                          f"'kunlun-infer plugins --export'?")
    if entry["schema"] != SCHEMA:
        raise RecordError(f"{where}: record schema {entry['schema']!r}, this kunlun-infer reads schema {SCHEMA}; "
                          f"upgrade kunlun-infer to read it")
    return entry


def read_record(path: Path) -> list[dict[str, Any]]:
    """Every run in the record at ``path`` (an absent file is an empty record)."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise RecordError(f"cannot read the doctor record {path}: {exc.strerror or exc}") from exc
    entries = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
        except json.JSONDecodeError as exc:
            raise RecordError(f"{path}:{number}: not JSON ({exc.msg}); each line of a doctor record is one run "
                              f"as JSON") from exc
        entries.append(_check_entry(entry, f"{path}:{number}"))
    return entries


def append_entries(path: Path, entries: Iterable[Mapping[str, Any]]) -> None:
    """Append ``entries`` to the record at ``path`` (created with its folder when missing), one write each."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a", encoding="utf-8") as out:
            for entry in entries:
                out.write(json.dumps(entry, sort_keys=True) + "\n")
    except OSError as exc:
        raise RecordError(f"cannot write the doctor record {path}: {exc.strerror or exc}; set "
                          f"{RECORD_ENV} (or --record FILE) to a writable file") from exc


def export_record(path: Path, target: Path) -> int:
    """Copy every run of the record to ``target`` (a JSON-lines file); the number of runs."""
    entries = read_record(path)
    try:
        target.write_text("".join(json.dumps(e, sort_keys=True) + "\n" for e in entries), encoding="utf-8")
    except OSError as exc:
        raise RecordError(f"cannot write {target}: {exc.strerror or exc}") from exc
    return len(entries)


def import_record(path: Path, source: Path) -> tuple[int, int]:
    """Add the runs of ``source`` the record lacks (by run id); ``(added, already present)``."""
    if not source.is_file():
        raise RecordError(f"{source}: no such file to import (give the file written by 'kunlun-infer plugins "
                          f"--export FILE')")
    incoming = read_record(source)
    known = {e["id"] for e in read_record(path)}
    fresh, seen = [], set()
    for entry in incoming:
        if entry["id"] not in known and entry["id"] not in seen:
            fresh.append(entry)
            seen.add(entry["id"])
    append_entries(path, fresh)
    return len(fresh), len(incoming) - len(fresh)


# ---------------------------------------------------------------------- the answer for what is installed now


@dataclasses.dataclass
class ConfigStatus:
    """What the record says about one config for the plugins installed now."""

    config: dict[str, str]
    status: str  #: passed | failed | new | not installed
    runs: int = 0  #: runs of this config with this combination
    passed_runs: int = 0
    last: dict[str, Any] | None = None  #: the latest run of this config with this combination
    previous: dict[str, Any] | None = None  #: for "new": the latest run of this config with another combination
    changes: list[str] = dataclasses.field(default_factory=list)  #: for "new": what differs from ``previous``
    missing: list[str] = dataclasses.field(default_factory=list)  #: for "not installed": the choices nobody serves

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _config_key(config: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    return tuple((c, str(config[c])) for c in CAPABILITIES if c in config)


def matrix_status(entries: list[dict[str, Any]], now: Mapping[str, Any]) -> list[ConfigStatus]:
    """For each config the record knows (latest first), its status with the plugins installed ``now``."""
    by_config: dict[tuple[tuple[str, str], ...], list[dict[str, Any]]] = {}
    for entry in sorted(entries, key=lambda e: e["when"]):
        by_config.setdefault(_config_key(entry["config"]), []).append(entry)
    answers = []
    for key, runs in by_config.items():
        config = dict(key)
        current = combination(now, config)
        if current is None:
            missing = [f"{c}={o}" for c, o in config.items() if serving(now["plugins"], {c: o})[c] is None]
            answers.append(ConfigStatus(config, "not installed", last=runs[-1], missing=missing))
            continue
        same = [r for r in runs if combination(r["installed"], config) == current]
        if not same:
            previous = runs[-1]
            before = combination(previous["installed"], config)
            answers.append(ConfigStatus(config, NEW, previous=previous,
                                        changes=differences(before, current) if before else []))
            continue
        last = same[-1]
        answers.append(ConfigStatus(config, PASSED if last["outcome"] == PASSED else FAILED, runs=len(same),
                                    passed_runs=sum(r["outcome"] == PASSED for r in same), last=last))
    answers.sort(key=lambda a: (a.last or a.previous or {}).get("when", ""), reverse=True)
    return answers
