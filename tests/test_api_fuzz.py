"""Schemathesis fuzzes every operation of the API's own OpenAPI schema, as two users.

For a fixed number of generated requests per operation (schema-valid and, where the
operation has a query or a body to break, schema-invalid ones; derandomized, so each run
makes the same choices, though the ids behind them are new each run), it proves:

1. no request gets a 5xx, whatever it sends;
2. an answer conforms to the schema where the schema says something: a 2xx is one of the
   documented codes, with the documented content type and a body matching the documented
   schema, and an operation that needs credentials never answers 2xx without them;
3. no cross-user access: Bob's requests that name Alice's real ids (in the path, or as a
   tip, parent, message or image blob in the query or body) never succeed; each answers
   exactly as the same request naming ids nobody has (a lookup by id answers 404), no
   answer to Bob carries Alice's text or an id of hers he did not send, and Alice's rows
   never change.

Alice fuzzes her own data too: path ids, tips, parents, labels and expected versions are
mostly her real ones, and bodies are often well-formed parts and turns, so the generated
requests get past the lookups and validation into the services (turns, edits, forks,
rewinds, chat turns with the offline fake model, exports, compaction).

The app runs in process through schemathesis's WSGI transport (``arbor.wsgi``), on a
database whose rows are committed (``transaction=True``), so on-commit jobs run too.
"""

from __future__ import annotations

import io
import json
import secrets
import traceback
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import hypothesis
import pytest
import schemathesis
from django.core.signals import got_request_exception, request_started
from hypothesis import HealthCheck, Phase, given
from hypothesis import strategies as st
from PIL import Image
from schemathesis.checks import not_a_server_error
from schemathesis.core import NotSet
from schemathesis.core.failures import FailureGroup
from schemathesis.generation import GenerationMode
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    ignored_auth,
    response_headers_conformance,
    response_schema_conformance,
)
from schemathesis.transport.serialization import Binary

from arbor.api import api
from arbor.wsgi import application
from compaction.models import CompactionRecord
from conversations import services
from conversations.models import Blob, Checkpoint, Conversation, Message, TurnAttempt
from tests.builders import make_user, text, tool_turn

# Generated requests per operation and user. 24 operations x 2 users x 25 examples is
# 1,200 generated requests; with Bob's twin requests and the auth probes of ignored_auth,
# the app handles about 2,400 (some 75 s on two cores).
EXAMPLES = 25

# Schemathesis's checks, run on every response:
# - not_a_server_error: no 5xx, ever;
# - content_type_conformance, response_schema_conformance, response_headers_conformance:
#   only for documented status codes, i.e. the 2xx each route declares;
# - ignored_auth: every operation requires auth, so a 2xx is re-sent without the token
#   and with a made-up one, and both must be refused.
# Left out:
# - status_code_conformance: ninja documents only the success code of each route, so
#   every 404, 409 and 422 (the API's errors, documented in prose) would be a failure;
#   instead, a 2xx must be one of the documented codes (see fuzz below).
# - positive_data_acceptance: a schema-valid request may rightly be refused (an id nobody
#   has is a 404, a stale expected_version a 409, parts are validated beyond the schema).
# - negative_data_rejection: it judges a request by the label given at generation
#   (schema-valid or not), which Steer below invalidates by putting real values in.
#   (A body that is not a JSON object is refused with a 400: tests/test_api_bad_input.)
CHECKS = [
    not_a_server_error,
    content_type_conformance,
    response_schema_conformance,
    response_headers_conformance,
    ignored_auth,
]

RAW_SCHEMA = api.get_openapi_schema()
# The bearer token is ours to send: schemathesis must not generate Authorization headers
# or session cookies of its own.
CONFIG = schemathesis.Config.from_dict({"generation": {"with-security-parameters": False}})
SCHEMA = schemathesis.openapi.from_dict(RAW_SCHEMA, config=CONFIG)
SCHEMA.app = application
OPERATIONS = {op.label: op for op in (result.ok() for result in SCHEMA.get_all_operations())}


def _modes(label: str) -> list[GenerationMode]:
    """Negative data needs something to break beyond a free-form string path parameter
    (which every string satisfies): a query parameter or a body."""
    method, path = label.split(" ", 1)
    raw = RAW_SCHEMA["paths"][path][method.lower()]
    breakable = "requestBody" in raw or any(p["in"] != "path" for p in raw.get("parameters", []))
    return list(GenerationMode) if breakable else [GenerationMode.POSITIVE]


def _query_parameters(label: str) -> set[str]:
    method, path = label.split(" ", 1)
    raw = RAW_SCHEMA["paths"][path][method.lower()]
    return {p["name"] for p in raw.get("parameters", []) if p["in"] == "query"}


def _documented(label: str) -> set[int]:
    method, path = label.split(" ", 1)
    responses = RAW_SCHEMA["paths"][path][method.lower()]["responses"]
    return {int(code) for code in responses}


# --- the two users and their data -------------------------------------------------------


def png_bytes(seed: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (3, 2), (seed % 256, (seed // 256) % 256, 9)).save(buf, format="PNG")
    return buf.getvalue()


def plant(user: Any, marker: str, seed: int) -> None:
    """A conversation with a tool turn, an image, a branch, a checkpoint "cp" and a failed
    turn to retry; every text carries ``marker``."""
    blob = services.blob_store(owner=user, data=png_bytes(seed))
    conv = services.conversation_create(
        owner=user, title=f"{marker} tree", system_prompt=f"{marker} system"
    )
    first = services.turn_append(
        conversation=conv,
        parent_id=None,
        expected_version=conv.version,
        messages=tool_turn(f"{marker} ask", result=f"{marker} result", answer=f"{marker} answer"),
    )
    second = services.turn_append(
        conversation=conv,
        parent_id=first.tip,
        expected_version=first.version,
        messages=[
            {
                "role": "user",
                "parts": [*text(f"{marker} look"), {"type": "image", "blob": blob.sha256}],
            },
            {"role": "assistant", "parts": text(f"{marker} seen")},
        ],
    )
    services.turn_append(  # a second answer to the first question: a branch
        conversation=conv,
        parent_id=first.message_ids[0],
        expected_version=second.version,
        messages=[{"role": "assistant", "parts": text(f"{marker} other answer")}],
    )
    conv.refresh_from_db()
    services.checkpoint_create(conversation=conv, label="cp")
    TurnAttempt.objects.create(
        conversation=conv,
        parent_id=second.tip,
        input_parts=text(f"{marker} again"),
        model="fake/demo",
        status="failed",
        error_code="provider_unavailable",
    )


@dataclass(frozen=True)
class Ids:
    """A user's ids as they stand now (the fuzzing creates and deletes)."""

    cids: list[str]
    mids: list[str]
    shas: list[str]
    labels: list[str]
    version: dict[str, int]
    conversation_of: dict[str, str]

    @classmethod
    def of(cls, user: Any) -> Ids:
        convs = Conversation.objects.filter(owner=user).order_by("created_at", "id")
        version = {str(pk): v for pk, v in convs.values_list("id", "version")}
        messages = Message.objects.filter(conversation__owner=user).order_by("created_at", "id")
        conversation_of = {str(m): str(c) for m, c in messages.values_list("id", "conversation")}
        shas = Blob.objects.filter(owners=user).order_by("sha256").values_list("sha256", flat=True)
        labels = (
            Checkpoint.objects.filter(conversation__owner=user)
            .order_by("label")
            .values_list("label", flat=True)
            .distinct()
        )
        return cls(
            cids=list(version),
            mids=list(conversation_of),
            shas=list(shas),
            labels=list(labels),
            version=version,
            conversation_of=conversation_of,
        )

    def all(self) -> set[str]:
        return {*self.cids, *self.mids, *self.shas}


@dataclass
class Person:
    user: Any
    headers: dict[str, str]
    marker: str
    seed: int

    def ensure_a_tree(self) -> None:
        """Plant a new tree when the fuzzing deleted or rewound away every message."""
        if not Message.objects.filter(conversation__owner=self.user).exists():
            self.seed += 1
            plant(self.user, self.marker, self.seed)


def alice_state(user: Any) -> dict[str, Any]:
    """Everything of Alice's that a request of Bob's could change."""
    convs = Conversation.objects.filter(owner=user).order_by("id")
    return {
        "conversations": list(
            convs.values_list(
                "id", "version", "tip_id", "title", "system_prompt", "model", "updated_at"
            )
        ),
        "messages": list(
            Message.objects.filter(conversation__owner=user)
            .order_by("id")
            .values_list("id", "parent_id", "parts")
        ),
        "checkpoints": list(
            Checkpoint.objects.filter(conversation__owner=user)
            .order_by("id")
            .values_list("id", "label", "state", "message_id", "updated_at")
        ),
        "attempts": TurnAttempt.objects.filter(conversation__owner=user).count(),
        "records": CompactionRecord.objects.filter(conversation__owner=user).count(),
        "blobs": sorted(Blob.objects.filter(owners=user).values_list("sha256", flat=True)),
    }


@dataclass
class World:
    alice: Person
    bob: Person
    # Tracebacks of the app's unhandled exceptions (got_request_exception), for reports.
    tracebacks: list[str] = field(default_factory=list)
    # The generated requests' answers, and every request the app handled (with Bob's
    # twin requests and ignored_auth's probes).
    statuses: Counter[int] = field(default_factory=Counter)
    handled: int = 0


def person(name: str, seed: int) -> Person:
    user = make_user(name)
    _, secret = services.api_token_create(user=user, name="fuzz")
    marker = f"{name}-private-{secrets.token_hex(6)}"
    plant(user, marker, seed)
    return Person(user, {"Authorization": f"Bearer {secret}"}, marker, seed)


@pytest.fixture
def world(settings: Any, tmp_path: Any) -> Iterator[World]:
    settings.ALLOWED_HOSTS = ["localhost"]  # the Host schemathesis's WSGI client sends
    settings.MEDIA_ROOT = str(tmp_path)
    alice, bob = (person(name, seed) for name, seed in (("alice", 1), ("bob", 500)))
    world = World(alice, bob)

    def record(sender: Any, request: Any = None, **kwargs: Any) -> None:
        world.tracebacks.append(traceback.format_exc())

    def count(sender: Any, **kwargs: Any) -> None:
        world.handled += 1

    got_request_exception.connect(record, dispatch_uid="test_api_fuzz")
    request_started.connect(count, dispatch_uid="test_api_fuzz")
    yield world
    got_request_exception.disconnect(dispatch_uid="test_api_fuzz")
    request_started.disconnect(dispatch_uid="test_api_fuzz")


# --- steering the generated requests ----------------------------------------------------


def ghost_like(value: str) -> str:
    """An id of the same shape that nobody has."""
    if len(value) == 64 and all(c in "0123456789abcdef" for c in value):
        return secrets.token_hex(32)
    return str(uuid.uuid4())


@dataclass
class Steer:
    """Fills a generated case with real values: the owner's own ids (Alice), or mostly
    Alice's and sometimes his own for Bob (so his request gets past the path lookup and
    names Alice's ids in the query or body instead). A generated value is kept now and
    then, and an id nobody has is put in now and then."""

    data: st.DataObject
    pools: list[Ids]  # whose ids, weighted by repetition
    named: set[str] = field(default_factory=set)  # the real ids this request carries
    conversation: str | None = None  # the conversation the path names, if any

    def draw(self, strategy: st.SearchStrategy[Any], label: str) -> Any:
        return self.data.draw(strategy, label=label)

    def real(self, what: str) -> bool:
        """Mostly a well-formed value, sometimes the generated one."""
        return bool(self.draw(st.sampled_from([True, True, False]), f"real {what}"))

    def pick(self, what: str, kind: str, generated: Any) -> Any:
        # The same draws whatever the database holds: Hypothesis replays a choice
        # sequence and requires it to draw alike, so an id is picked by an index modulo
        # the ids there are now, never by sampling the changing list itself.
        ids: Ids = self.draw(st.sampled_from(self.pools), f"whose {what}")
        source = self.draw(st.sampled_from(["real", "real", "real", "ghost", "generated"]), what)
        nearby = self.real(f"{what} nearby")
        index = self.draw(st.integers(0, 2**16), f"{what} index")
        choices: list[str] = getattr(ids, kind)
        if kind == "mids" and nearby and self.conversation is not None:
            # A message of the conversation the path names: a parent or tip that fits.
            here = [m for m, c in ids.conversation_of.items() if c == self.conversation]
            choices = here or choices
        if source == "real" and choices:
            value = choices[index % len(choices)]
            self.named.add(value)
            return value
        if source == "ghost":
            return secrets.token_hex(32) if kind == "shas" else str(uuid.uuid4())
        return generated

    def parts(self) -> list[dict[str, Any]]:
        parts: list[dict[str, Any]] = text(self.draw(st.text(max_size=30), "text"))
        if self.draw(st.booleans(), "with an image"):
            parts.append({"type": "image", "blob": self.pick("image", "shas", "0" * 64)})
        return parts

    def messages(self) -> list[dict[str, Any]]:
        shapes = ["answer", "answer", "prompt", "exchange", "tools"]  # regenerate wants answers
        shape = self.draw(st.sampled_from(shapes), "turn")
        if shape == "tools":
            return tool_turn("use a tool", call_id=self.draw(st.text(min_size=1), "call id"))
        if shape == "exchange":
            return [
                {"role": "user", "parts": self.parts()},
                {"role": "assistant", "parts": text("ok")},
            ]
        return [{"role": "assistant" if shape == "answer" else "user", "parts": self.parts()}]

    def transcript(self) -> dict[str, Any]:
        """An Open WebUI chat, one of the formats ``POST /imports`` reads."""
        ask, answer = self.draw(st.text(), "asked"), self.draw(st.text(), "answered")
        return {
            "title": self.draw(st.text(max_size=50), "title"),
            "history": {
                "currentId": "m2",
                "messages": {
                    "m1": {"id": "m1", "parentId": None, "role": "user", "content": ask},
                    "m2": {"id": "m2", "parentId": "m1", "role": "assistant", "content": answer},
                },
            },
        }

    def case(self, case: Any) -> None:
        """Point a generated request at the world's real ids and shapes, where drawn."""
        self.case_path(case.path_parameters)
        self.case_query(case)
        body = case.body  # the generated one, even where the import route's is replaced
        self.case_whole_body(case)
        if isinstance(body, dict):
            self.case_body(body)

    def case_path(self, path: dict[str, Any]) -> None:
        for name, kind in (("cid", "cids"), ("mid", "mids"), ("sha256", "shas")):
            if name in path:
                path[name] = self.pick(name, kind, path[name])
                for ids in self.pools:
                    if path[name] in ids.version or path[name] in ids.conversation_of:
                        self.conversation = ids.conversation_of.get(path[name], path[name])

    def case_query(self, case: Any) -> None:
        query = case.query
        declared = _query_parameters(case.operation.label)
        if "tip" in declared and isinstance(query.get("tip"), str | None):
            query["tip"] = self.pick("tip", "mids", query.get("tip"))
            if query["tip"] is None:
                del query["tip"]
        if case.operation.path.endswith("/export") and self.real("format"):
            formats = ["arbor", "chatgpt", "markdown", "claude-code", "pi"]
            query["format"] = self.draw(st.sampled_from(formats), "format")
        if "model" in query and self.real("model"):
            query["model"] = self.draw(st.sampled_from(["", "fake/demo"]), "model")

    def case_whole_body(self, case: Any) -> None:
        body = case.body
        if case.operation.path == "/api/imports" and self.real("transcript"):
            # The route reads the raw body, so the schema documents none to generate.
            case.body, case.media_type = self.transcript(), "application/json"
        if case.operation.path == "/api/blobs" and isinstance(body, dict) and self.real("png"):
            body["file"] = Binary(png_bytes(self.draw(st.integers(1000, 1100), "png")))

    def case_body(self, body: dict[str, Any]) -> None:
        for name in ("parent", "message"):
            if name in body:
                body[name] = self.pick(name, "mids", body[name])
        if "parts" in body and self.real("parts"):
            body["parts"] = self.parts()
        if "messages" in body and self.real("messages"):
            body["messages"] = self.messages()
        if "label" in body and self.real("label"):
            body["label"] = self.draw(st.sampled_from(["cp", "fresh"]), "label")
        if "model" in body and self.real("model"):
            body["model"] = "fake/demo"
        if "expected_version" in body and self.real("version"):
            versions = [
                ids.version[self.conversation]
                for ids in self.pools
                if self.conversation in ids.version
            ]
            if versions:
                body["expected_version"] = versions[0]


def replace_ids(value: Any, ghosts: dict[str, str]) -> Any:
    if isinstance(value, str):
        return ghosts.get(value, value)
    if isinstance(value, dict):
        return {k: replace_ids(v, ghosts) for k, v in value.items()}
    if isinstance(value, list):
        return [replace_ids(v, ghosts) for v in value]
    return value


def error_code(response: Any) -> str | None:
    try:
        body = json.loads(response.content)
    except ValueError:
        return None
    return body.get("error") if isinstance(body, dict) else None


def describe(case: Any, response: Any, world: World) -> str:
    """The request and the answer (with the app's traceback for a 5xx)."""
    body = response.content[:600].decode("utf-8", "replace")
    sent = "" if isinstance(case.body, NotSet) else f" body={case.body!r}"
    out = f"{case.method} {case.formatted_path} query={case.query!r}{sent}\n"
    out += f"-> {response.status_code} {body}"
    if response.status_code >= 500 and world.tracebacks:
        out += "\n" + world.tracebacks[-1]
    return out


# --- the fuzzing -----------------------------------------------------------------------


def fuzz(label: str, world: World, *, stranger: bool) -> None:
    operation = OPERATIONS[label]
    me = world.bob if stranger else world.alice
    alice = world.alice
    before = alice_state(alice.user)
    documented = _documented(label)
    problems: list[str] = []
    strategy = st.one_of(*(operation.as_strategy(mode) for mode in _modes(label)))

    @hypothesis.settings(
        max_examples=EXAMPLES,
        derandomize=True,
        deadline=None,
        database=None,
        # No shrinking: the database changes under each example, so a replay is not
        # the same request twice; every problem is collected with its request instead.
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(case=strategy, data=st.data())
    def example(case: Any, data: st.DataObject) -> None:
        alice.ensure_a_tree()
        me.ensure_a_tree()
        alice_ids, my_ids = Ids.of(alice.user), Ids.of(me.user)
        steer = Steer(data, [alice_ids, alice_ids, alice_ids, my_ids] if stranger else [my_ids])
        steer.case(case)
        world.tracebacks.clear()
        try:
            response = case.call(headers=me.headers)
        except Exception:  # e.g. an event stream that breaks off mid-way
            problems.append(
                f"{case.method} {case.formatted_path} raised:\n{traceback.format_exc()}"
            )
            return
        world.statuses[response.status_code] += 1
        try:
            case.validate_response(
                response,
                checks=CHECKS,
                headers=me.headers,
                transport_kwargs={"headers": me.headers},
            )
        except FailureGroup as exc:
            problems.append(f"{exc}\n{describe(case, response, world)}")
            return
        ok = 200 <= response.status_code < 300
        if ok and response.status_code not in documented:
            problems.append(
                f"undocumented {response.status_code}: {describe(case, response, world)}"
            )
        if stranger:
            problems.extend(stranger_verdicts(case, response, world, steer.named & alice_ids.all()))
            after = alice_state(alice.user)
            if after != before:
                problems.append(f"Alice's data changed: {describe(case, response, world)}")
                before.update(after)

    example()
    who = "Bob" if stranger else "Alice"
    print(f"{label} as {who}: {world.handled} requests, {dict(world.statuses)}")
    assert not problems, f"{len(problems)} problem(s):\n\n" + "\n\n".join(problems[:5])
    # The fuzzing must have got past authentication.
    assert set(world.statuses) != {401}, world.statuses


def stranger_verdicts(case: Any, response: Any, world: World, named: set[str]) -> list[str]:
    """What Bob may learn: nothing of Alice's, and not even whether her ids exist."""
    problems = []
    alice = world.alice
    sent = f"{case.formatted_path} {case.query!r} {case.body!r}"
    body = response.content.decode("utf-8", "replace")
    if alice.marker in body:
        problems.append(f"Alice's text reached Bob: {describe(case, response, world)}")
    leaked = {i for i in Ids.of(alice.user).all() if i in body and i not in sent}
    if leaked:
        problems.append(f"Alice's ids {leaked} reached Bob: {describe(case, response, world)}")
    if not named:
        return problems
    if 200 <= response.status_code < 300:
        problems.append(f"Bob used Alice's ids {named}: {describe(case, response, world)}")
        return problems
    in_path = named & {str(v) for v in (case.path_parameters or {}).values()}
    # A lookup by Alice's id is a 404; a 400 or 422 only when ninja refused the request
    # before any lookup (the twin below then answers the same).
    if in_path and response.status_code not in (400, 404, 422):
        problems.append(f"not a 404 for Alice's {in_path}: {describe(case, response, world)}")
    # The same request naming ids nobody has must answer the same.
    ghosts = {i: ghost_like(i) for i in named}
    twin = case.derive(query=replace_ids(case.query, ghosts))
    twin.path_parameters = replace_ids(case.path_parameters, ghosts)
    twin.body = replace_ids(case.body, ghosts)
    answer = twin.call(headers=world.bob.headers)
    if (answer.status_code, error_code(answer)) != (response.status_code, error_code(response)):
        problems.append(
            f"Alice's ids answer unlike missing ones:\n{describe(case, response, world)}\n"
            f"vs ghosts: {describe(twin, answer, world)}"
        )
    return problems


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("label", list(OPERATIONS))
def test_the_owner_gets_no_5xx_and_documented_answers(label: str, world: World) -> None:
    fuzz(label, world, stranger=False)


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("label", list(OPERATIONS))
def test_a_stranger_with_the_owners_ids_gets_404s_and_nothing_of_hers(
    label: str, world: World
) -> None:
    fuzz(label, world, stranger=True)


def test_schemathesis_reads_every_operation_of_the_schema() -> None:
    declared = {
        f"{method.upper()} {path}"
        for path, methods in RAW_SCHEMA["paths"].items()
        for method in methods
    }
    assert set(OPERATIONS) == declared
    assert len(OPERATIONS) >= 24
