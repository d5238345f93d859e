"""README's "Where things live" map names real places: a newcomer can check it against
the tree, and a move that forgets the map fails here."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def map_rows() -> list[tuple[str, str]]:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme.split("## Where things live", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and len(cells) == 2 and not set(cells[0]) <= {"-"}:
            rows.append((cells[0], cells[1]))
    return rows[1:]  # without the header row


def named_paths(where: str, what: str) -> list[str]:
    """The paths a row names: the first cell's (a bare file name is in the folder the
    cell named before it) and the second cell's ``.py`` files (in that folder too)."""
    paths: list[str] = []
    base = ""
    for token in re.findall(r"`([^`]+)`", where):
        if "/" in token:
            base = token if token.endswith("/") else token.rsplit("/", 1)[0] + "/"
            paths.append(token)
        else:
            paths.append(base + token)
    for token in re.findall(r"`([^`]+)`", what):
        if re.fullmatch(r"[\w/]+\.py", token):
            paths.append(token if "/" in token else base + token)
        elif token.endswith("/") and not token.startswith(".."):
            paths.append(token)
    return paths


def test_the_map_has_a_row_per_module_group() -> None:
    rows = map_rows()
    assert len(rows) >= 10, rows
    top = {p.split("/")[0] for where, what in rows for p in named_paths(where, what)}
    assert {"arbor", "conversations", "compaction", "templates", "tests"} <= top


def test_every_path_in_the_map_exists() -> None:
    missing = [
        path
        for where, what in map_rows()
        for path in named_paths(where, what)
        if not any(ROOT.glob(path.rstrip("/")))
    ]
    assert not missing, f"README names paths that are not in the tree: {missing}"


def test_every_python_module_group_is_on_the_map() -> None:
    # Each app folder and each package inside one is named by some row.
    named = " ".join(" ".join(named_paths(w, x)) for w, x in map_rows())
    for app in ("arbor", "conversations", "compaction"):
        for package in (ROOT / app).iterdir():
            if (package / "__init__.py").exists() and package.name not in {
                "migrations",
                "management",
                "templatetags",
            }:
                assert f"{app}/{package.name}/" in named, f"{app}/{package.name}/ is not mapped"
