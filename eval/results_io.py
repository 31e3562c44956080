"""Saving and loading an eval run's ``results.json`` (:func:`save_results`, :func:`load_results`)
and the crash-safe write every report file goes through (:func:`atomic_write_text`).

NOTE: separate from :mod:`eval.results`, which is the document's schema alone: this module is
the file side (names in the run folder, atomic writes, errors that name the file and each bad
field). Like it, it imports no torch and no engine code, so reading a run back stays fast.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from eval.results import SCHEMA_VERSION, Results, results_json_schema

RESULTS_FILE = "results.json"
SCHEMA_FILE = "results.schema.json"

DocumentT = TypeVar("DocumentT", bound=BaseModel)


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file, so a crash never leaves half a file."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
        # NOTE: mkstemp makes the file 0600; the result is a report, readable like the PNGs.
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _check_finite(results: Results) -> None:
    """Refuse NaN/inf floats: JSON has no spelling for them and they would be written as null."""
    stack: list[tuple[str, Any]] = [("", results.model_dump())]
    while stack:
        where, value = stack.pop()
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"results{where} is {value}; only finite numbers can be saved")
        if isinstance(value, dict):
            stack.extend((f"{where}.{k}", v) for k, v in value.items())
        elif isinstance(value, list | tuple):
            stack.extend((f"{where}[{i}]", v) for i, v in enumerate(value))


def save_results(results: Results, run_dir: str | Path) -> Path:
    """Write ``results.json`` and ``results.schema.json`` into ``run_dir``.

    Args:
        results: The run's results.
        run_dir: The run folder; created if missing.

    Returns:
        The path of the written ``results.json``.

    Raises:
        ValueError: If a float in ``results`` is NaN or infinite.
    """
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    _check_finite(results)
    path = run_dir / RESULTS_FILE
    atomic_write_text(path, results.model_dump_json(indent=2) + "\n")
    atomic_write_text(run_dir / SCHEMA_FILE, json.dumps(results_json_schema(), indent=2) + "\n")
    return path


def format_validation_error(err: ValidationError) -> str:
    """One line per problem, with the JSON location of the offending field."""
    lines = []
    for item in err.errors():
        loc = ".".join(str(part) for part in item["loc"]) or "(top level)"
        lines.append(f"  - {loc}: {item['msg']}")
    return "\n".join(lines)


def document_path(path_or_dir: str | Path, file_name: str) -> Path:
    """The document's file: ``path_or_dir`` itself, or ``file_name`` in it when it is a folder."""
    path = Path(path_or_dir)
    return path / file_name if path.is_dir() else path


def load_document(path_or_dir: str | Path, file_name: str, model: type[DocumentT], kind: str, mismatch: str) -> DocumentT:
    """Read and validate one JSON document of a run folder (``results.json``, ``sweep.json``).

    Args:
        path_or_dir: the file, or the folder that holds it as ``file_name``.
        file_name: the document's name in its folder.
        model: its schema.
        kind: what the messages call the file (``results``: "results file not found").
        mismatch: what a document that fails ``model`` is said to be, before its problems.

    Returns:
        The validated document.

    Raises:
        ValueError: If the file is missing or unreadable, is not valid JSON, or does not match
            the schema. The message names the file and says what is wrong (for schema errors,
            each offending field).
    """
    path = document_path(path_or_dir, file_name)
    if not path.is_file():
        raise ValueError(f"{path}: {kind} file not found")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: cannot read {kind} file: {exc}") from exc
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(
            f"{path}: not valid JSON (line {exc.lineno}, column {exc.colno}): {exc.msg}"
        ) from exc
    if not isinstance(data, dict):
        raise ValueError(
            f"{path}: expected a JSON object at the top level, got {type(data).__name__}"
        )
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise ValueError(
            f"{path}: {mismatch}, {exc.error_count()} problem(s):\n" + format_validation_error(exc)
        ) from exc


def load_results(path_or_dir: str | Path) -> Results:
    """Read and validate a ``results.json`` (:func:`load_document`).

    Args:
        path_or_dir: The ``results.json`` file or the run folder that holds it.

    Returns:
        The validated ``Results``.

    Raises:
        ValueError: If the file is missing or unreadable, is not valid JSON, or does not match
            the schema. The message names the file and says what is wrong (for schema errors,
            each offending field).
    """
    return load_document(
        path_or_dir, RESULTS_FILE, Results, "results", f"does not match the results schema (version {SCHEMA_VERSION})"
    )
