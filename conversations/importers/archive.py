"""Zip archives of transcripts, as people have them:

- **a ChatGPT export download**: ``conversations.json`` (newer exports split it into
  ``conversations-000.json``, …) with the image and DALL·E files beside it; an image
  pointer (``file-service://file-…``, ``sediment://file_…``) is read from the file in
  the archive whose name starts with its id, so images become blobs;
- **a Claude Code project folder** (``zip -r`` of ``~/.claude/projects/<project>/``):
  session files and, for Claude Code ≥ 2.1, ``<session>/subagents/agent-<id>.jsonl``
  with ``agent-<id>.meta.json`` naming the call that started each; sessions are
  imported first, so every sub-agent conversation is linked to its call;
- any other set of transcript files (pi sessions, Arbor exports…), each detected on its
  own.

A folder (the command line's way to give a project folder) is read the same way, in
place. Archives are read member by member without unpacking them whole. The sum of the
members' sizes is bounded by the file limit before anything is read (a small zip may
claim to expand to terabytes), and each member is copied with a byte count.
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from conversations.importers.base import ImportRejected, ImportTooLarge, Limits

ZIP_MAGIC = b"PK\x03\x04"
MAX_MEMBERS = 100_000
_CHATGPT = re.compile(r"^conversations(-\d+)?\.json$")
_AGENT = re.compile(r"^agent-([\w-]+)\.jsonl$")
_TRANSCRIPT_SUFFIXES = (".json", ".jsonl")
# Files of a ChatGPT export that hold no conversations.
_CHATGPT_OTHERS = {
    "user.json",
    "message_feedback.json",
    "model_comparisons.json",
    "shared_conversations.json",
    "group_chats.json",
    "shopping.json",
}


def is_archive(path: Path) -> bool:
    if path.is_dir():
        return True
    with open(path, "rb") as stream:
        return stream.read(4) == ZIP_MAGIC


def open_archive(path: Path, limits: Limits) -> Archive:
    return Folder(path, limits) if path.is_dir() else Archive(path, limits)


@dataclass
class Transcript:
    """One member of the archive to import, extracted to ``path``."""

    name: str
    path: Path | None  # None when the member cannot be read (``error`` says why)
    # Claude Code ≥ 2.1 sub-agent runs: the call that started it (from the meta file, or
    # ``agent:<id>`` for the call whose result names it) and the call's description.
    spawned_by_call: str | None = None
    description: str = ""
    error: str = ""


class Archive:
    """The members of a zip archive (``Archive(path, limits)``) or of a folder
    (``Folder``), by their ``/``-separated names."""

    def __init__(self, path: Path, limits: Limits) -> None:
        self.limits = limits
        try:
            self.zip = zipfile.ZipFile(path)
        except (zipfile.BadZipFile, OSError) as exc:
            raise ImportRejected(
                f"the file starts like a zip archive but cannot be read: {exc}",
                code="bad_archive",
            ) from None
        try:
            infos = [i for i in self.zip.infolist() if not i.is_dir() and not _hidden(i.filename)]
            if any(i.flag_bits & 0x1 for i in infos):
                raise ImportRejected("the archive is encrypted", code="bad_archive")
            self.sizes = {i.filename: i.file_size for i in infos}
            self._check()
        except BaseException:
            self.zip.close()
            raise
        self.workdir = Path(tempfile.mkdtemp(prefix="arbor-archive-"))

    def _check(self) -> None:
        if len(self.sizes) > MAX_MEMBERS:
            raise ImportRejected(
                f"the archive holds {len(self.sizes)} files; the limit is {MAX_MEMBERS}",
                code="bad_archive",
            )
        total = sum(self.sizes.values())
        if total > self.limits.max_file_bytes:
            raise ImportTooLarge(
                f"the archive's files add up to {total} bytes unpacked; the import limit "
                f"is {self.limits.max_file_bytes}"
            )
        self.by_base: dict[str, list[str]] = {}
        for name in sorted(self.sizes):
            self.by_base.setdefault(PurePosixPath(name).name, []).append(name)

    def close(self) -> None:
        self.zip.close()
        shutil.rmtree(self.workdir, ignore_errors=True)

    def read(self, name: str, limit: int) -> bytes:
        """Up to ``limit`` + 1 bytes of a member."""
        with self.zip.open(name) as stream:
            return stream.read(limit + 1)

    def local_path(self, name: str, index: int) -> Path:
        """The member as a file on disk, copied out with a byte count (the header's
        size is only a claim)."""
        target = self.workdir / f"{index}{PurePosixPath(name).suffix}"
        limit = self.limits.max_file_bytes
        written = 0
        try:
            with self.zip.open(name) as source, open(target, "wb") as out:
                while chunk := source.read(1 << 20):
                    written += len(chunk)
                    if written > limit:
                        raise ImportTooLarge(f"{name} unpacks to more than {limit} bytes")
                    out.write(chunk)
        except (zipfile.BadZipFile, OSError, EOFError) as exc:
            raise ImportRejected(
                f"{name} in the archive cannot be read: {exc}", code="bad_archive"
            ) from None
        return target

    def done_with(self, path: Path) -> None:
        path.unlink(missing_ok=True)

    @property
    def is_chatgpt(self) -> bool:
        return any(_CHATGPT.match(PurePosixPath(n).name) for n in self.sizes)

    def transcripts(self) -> Iterator[Transcript]:
        """The members to import, in the order that links sub-agents to their calls:
        ChatGPT's conversation files only; otherwise sessions before sub-agent runs."""
        if self.is_chatgpt:
            chosen = [n for n in self.sizes if _CHATGPT.match(PurePosixPath(n).name)]
        else:
            chosen = [
                n
                for n in self.sizes
                if n.endswith(_TRANSCRIPT_SUFFIXES)
                and not n.endswith(".meta.json")
                and PurePosixPath(n).name not in _CHATGPT_OTHERS
            ]
        chosen.sort(key=lambda n: ("/subagents/" in f"/{n}", n))
        for index, name in enumerate(chosen):
            try:
                path = self.local_path(name, index)
            except (ImportRejected, ImportTooLarge) as exc:
                yield Transcript(name, None, error=exc.detail)
                continue
            yield Transcript(name, path, *self._spawned_by(name))
            self.done_with(path)

    def _spawned_by(self, member: str) -> tuple[str | None, str]:
        name = PurePosixPath(member)
        match = _AGENT.match(name.name)
        if not match or name.parent.name != "subagents":
            return None, ""
        meta = str(name.with_name(f"agent-{match.group(1)}.meta.json"))
        fallback = f"agent:{match.group(1)}"
        if meta not in self.sizes:
            return fallback, ""
        try:
            data = json.loads(self.read(meta, 64 * 1024))
        except (ValueError, OSError, zipfile.BadZipFile):
            return fallback, ""
        data = data if isinstance(data, dict) else {}
        call, description = data.get("toolUseId"), data.get("description")
        return (
            call if isinstance(call, str) and call else fallback,
            description.strip() if isinstance(description, str) else "",
        )

    def media(self, pointer: str, max_bytes: int) -> tuple[bytes, str] | None:
        """The bytes and file name of the member a ChatGPT image pointer names (its file
        id is the start of the file's name), or None."""
        file_id = pointer.split("://", 1)[-1].strip()
        if not re.fullmatch(r"[\w-]{4,200}", file_id):
            return None
        for base, names in self.by_base.items():
            if base.startswith(file_id) and not base.endswith(_TRANSCRIPT_SUFFIXES):
                if self.sizes[names[0]] > max_bytes:
                    return None
                data = self.read(names[0], max_bytes)
                return (data, base) if len(data) <= max_bytes else None
        return None


class Folder(Archive):
    """A folder read like an archive (``manage.py import_transcripts <project folder>``):
    its files are read in place."""

    def __init__(self, path: Path, limits: Limits) -> None:
        self.limits = limits
        self.root = path
        files = [p for p in path.rglob("*") if p.is_file() and not p.is_symlink()]
        names = {p.relative_to(path).as_posix(): p for p in files}
        self.files = {n: p for n, p in names.items() if not _hidden(n)}
        self.sizes = {n: p.stat().st_size for n, p in self.files.items()}
        self._check()

    def close(self) -> None:
        pass

    def read(self, name: str, limit: int) -> bytes:
        with open(self.files[name], "rb") as stream:
            return stream.read(limit + 1)

    def local_path(self, name: str, index: int) -> Path:
        return self.files[name]

    def done_with(self, path: Path) -> None:
        pass


def _hidden(name: str) -> bool:
    """Dot-files and macOS resource forks; dot-folders are not hidden (a zip of
    ``~/.claude/projects/…`` by its full path holds ``home/me/.claude/…``)."""
    path = PurePosixPath(name)
    return path.name.startswith(".") or "__MACOSX" in path.parts
