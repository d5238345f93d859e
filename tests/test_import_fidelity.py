"""What real exports hold survives the import: ChatGPT browsing keeps its pages and
citation links, a call answered by several tool messages is paired whole, Open WebUI
text stays in the order it was written, and a file cut short says so in words (a 422
"truncated" when nothing in it is complete; at the top of the report otherwise).

tests/data/chatgpt/browsing.json is made by make_browsing.py beside it, shaped after
real exports of the 2023 ``browser`` tool and the 2024+ ``web`` tool. The files cut
short are cut from the repository's own data (tests/data, or made here), never from the
third-party samples: a fresh clone has those tests too.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from django.core.files.uploadedfile import SimpleUploadedFile
from django.test import TestCase, override_settings
from django.urls import reverse

from conversations import selectors, services
from conversations.importers import ImportRejected, ImportReport, transcript_import
from conversations.models import Conversation, ImportJob, Message
from conversations.providers.convert import to_anthropic
from conversations.providers.fake import anthropic_pairing_error
from conversations.services import transcript_resume
from tests.builders import make_user, openwebui_chat

DATA = Path(__file__).parent / "data"
BROWSING = DATA / "chatgpt" / "browsing.json"
CODEX = DATA / "codex" / "codex-compacted.jsonl"
MEDIA = tempfile.TemporaryDirectory()


def write(name: str, data: bytes | str) -> Path:
    path = Path(tempfile.mkdtemp()) / name
    path.write_bytes(data.encode() if isinstance(data, str) else data)
    return path


def path_of(conversation: Conversation) -> list[Message]:
    return selectors.message_path(conversation_id=conversation.pk, tip_id=conversation.tip_id)


@override_settings(MEDIA_ROOT=MEDIA.name)
class ChatGPTBrowsingTests(TestCase):
    @classmethod
    def setUpTestData(cls) -> None:
        cls.user = make_user("browser-user")
        cls.report = transcript_import(owner_id=cls.user.pk, path=BROWSING)
        cls.old, cls.new = (Conversation.objects.get(pk=pk) for pk in cls.report.conversation_ids)

    def test_a_quoted_page_keeps_its_url_title_and_domain(self) -> None:
        raw = json.loads(BROWSING.read_text())[0]["mapping"]
        quotes = [n["message"]["content"] for n in raw.values() if n["id"].startswith("t-q")]
        tool = [m for m in path_of(self.old) if m.role == "tool"][-1]
        wanted = [{k: q[k] for k in ("url", "title", "domain")} for q in quotes]
        self.assertEqual(tool.metadata["sources"], wanted)

    def test_every_page_of_a_multi_page_click_is_one_paired_result(self) -> None:
        path = path_of(self.old)
        click = next(m for m in path if any("mclick" in str(p) for p in m.parts))
        below = path[path.index(click) + 1]
        self.assertEqual(below.role, "tool")
        (result,) = below.parts
        self.assertEqual(result["call_id"], click.parts[0]["id"])
        texts = [p["text"] for p in result["parts"]]
        self.assertEqual(len(texts), 2)
        self.assertTrue(all("(full page text)" in t for t in texts))
        (summary, _) = self.report.conversations
        self.assertEqual((summary.tool_calls, summary.tool_pairs), (2, 2))
        self.assertEqual(summary.flagged.as_list(), [])
        messages, resume = transcript_resume(conversation=self.old, tip_id=self.old.tip_id)
        self.assertEqual(resume.trimmed, [])
        wire = to_anthropic(messages).messages
        self.assertIsNone(anthropic_pairing_error(wire))
        sent = json.dumps(wire, ensure_ascii=False)
        self.assertEqual(sent.count("(full page text)"), 2)

    def test_the_search_results_are_kept_as_sources(self) -> None:
        search = next(m for m in path_of(self.old) if m.role == "tool")
        urls = [s["url"] for s in search.metadata["sources"]]
        self.assertEqual(len(urls), 4)
        self.assertIn("https://fastapi.tiangolo.com/", urls)

    def test_citation_markers_point_at_their_pages(self) -> None:
        answer = path_of(self.old)[-1]
        self.assertEqual(
            [(c["marker"], c["url"]) for c in answer.metadata["citations"]],
            [
                ("【6†source】", "https://docs.djangoproject.com/en/5.2/"),
                ("【7†source】", "https://example.org/frameworks"),
            ],
        )
        newer = path_of(self.new)[-1]
        (citation,) = newer.metadata["citations"]
        self.assertIn(citation["marker"], newer.parts[0]["text"])
        self.assertEqual(citation["url"], "https://docs.djangoproject.com/en/5.2/releases/5.2/")

    def test_nothing_of_the_pages_is_reported_dropped(self) -> None:
        for summary in self.report.conversations:
            self.assertNotIn("content_dropped", summary.repaired.kinds())

    def test_the_page_shows_the_markers_as_links_and_the_sources(self) -> None:
        self.client.force_login(self.user)
        page = self.client.get(reverse("conversations:detail", args=[self.old.pk]))
        html = page.content.decode()
        self.assertIn(
            'class="cite" href="https://docs.djangoproject.com/en/5.2/" '
            'title="Django documentation"',
            html,
        )
        self.assertNotIn("【6†source】", html)
        self.assertIn('<details class="sources"><summary>2 sources</summary>', html)
        self.assertIn('href="https://flask.palletsprojects.com/"', html)


@override_settings(MEDIA_ROOT=MEDIA.name)
class ChatGPTReportTests(TestCase):
    def test_a_content_field_not_kept_is_reported(self) -> None:
        doc = json.loads(BROWSING.read_text())[1]
        doc["mapping"]["n-final"]["message"]["content"]["gizmo_widget"] = {"x": 1}
        report = transcript_import(owner_id=make_user().pk, path=write("c.json", json.dumps(doc)))
        (summary,) = report.conversations
        (item,) = [i for i in summary.repaired.as_list() if i["kind"] == "content_dropped"]
        self.assertIn("gizmo_widget", item["detail"])

    def test_a_script_url_is_never_a_link(self) -> None:
        doc = json.loads(BROWSING.read_text())[0]
        citation = doc["mapping"]["a-final"]["message"]["metadata"]["citations"][0]
        citation["metadata"]["url"] = "javascript:alert(1)"
        doc["mapping"]["a-final"]["message"]["metadata"]["_cite_metadata"] = {}
        user = make_user()
        report = transcript_import(owner_id=user.pk, path=write("x.json", json.dumps([doc])))
        self.client.force_login(user)
        html = self.client.get(
            reverse("conversations:detail", args=[report.conversation_ids[0]])
        ).content.decode()
        self.assertNotIn("javascript:alert", html.split("<main", 1)[-1].replace("&quot;", ""))
        self.assertIn("【6†source】", html)  # left as text, not linked


def owui_chat(assistant: dict[str, Any]) -> str:
    messages = {
        "u": {"id": "u", "parentId": None, "role": "user", "content": "What is 2+2?"},
        "a": {"id": "a", "parentId": "u", "role": "assistant", **assistant},
    }
    return json.dumps({"title": "order", "history": {"messages": messages, "currentId": "a"}})


DETAILS = (
    '<details type="tool_calls" done="true" id="call_1" name="calc" '
    'arguments="{&quot;x&quot;: &quot;2+2&quot;}" result="4">\n'
    "<summary>Tool Executed</summary>\n</details>"
)


@override_settings(MEDIA_ROOT=MEDIA.name)
class OpenWebUIOrderTests(TestCase):
    def moves(self, assistant: dict[str, Any]) -> list[tuple[str, ...]]:
        report = transcript_import(
            owner_id=make_user(f"u{Conversation.objects.count()}").pk,
            path=write("owui.json", owui_chat(assistant)),
        )
        conversation = Conversation.objects.get(pk=report.conversation_ids[0])
        out = []
        for m in path_of(conversation)[1:]:
            out.append((m.role, *(p.get("text") or p.get("name") or p["type"] for p in m.parts)))
        return out

    def test_text_before_a_tool_block_stays_before_the_call(self) -> None:
        content = f"Let me calculate that.\n{DETAILS}\nThe answer is 4."
        self.assertEqual(
            self.moves({"content": content}),
            [
                ("assistant", "Let me calculate that.", "calc"),
                ("tool", "tool_result"),
                ("assistant", "The answer is 4."),
            ],
        )

    def test_a_details_block_of_another_kind_stays_in_the_text(self) -> None:
        content = "Intro\n<details><summary>More</summary>prose</details>\nEnd"
        self.assertEqual(self.moves({"content": content}), [("assistant", content)])

    def test_output_items_without_a_message_keep_the_content_order(self) -> None:
        output = [
            {"type": "function_call", "call_id": "call_1", "name": "calc", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "call_1", "output": "4"},
        ]
        content = f"Let me calculate that.\n{DETAILS}\nThe answer is 4."
        self.assertEqual(
            self.moves({"content": content, "output": output}),
            [
                ("assistant", "Let me calculate that.", "calc"),
                ("tool", "tool_result"),
                ("assistant", "The answer is 4."),
            ],
        )


@override_settings(MEDIA_ROOT=MEDIA.name, ARBOR_INPROCESS_JOBS="inline")
class TruncatedFileTests(TestCase):
    def test_a_chatgpt_file_cut_inside_its_first_conversation_says_so(self) -> None:
        data = BROWSING.read_bytes()
        assert data.index(b'"browse-2025"') > 3000  # the cut is inside the first one
        cut = write("conversations.json", data[:3000])
        with self.assertRaises(ImportRejected) as caught:
            transcript_import(owner_id=make_user().pk, path=cut)
        self.assertEqual(caught.exception.code, "truncated")
        self.assertIn("cut at byte 3000", str(caught.exception))
        self.assertFalse(Conversation.objects.exists())

    def test_through_the_api_it_is_a_422_naming_the_cut(self) -> None:
        user = make_user()
        _, secret = services.api_token_create(user=user, name="t")
        data = BROWSING.read_bytes()
        response = self.client.post(
            "/api/imports",
            {"file": SimpleUploadedFile("conversations.json", data[:3000])},
            HTTP_AUTHORIZATION=f"Bearer {secret}",
        )
        self.assertEqual(response.status_code, 422, response.content)
        body = response.json()
        self.assertEqual(body["error"], "truncated")
        self.assertIn("byte 3000", json.dumps(body))

    def test_a_single_document_cut_short_says_truncated(self) -> None:
        data, user = openwebui_chat(), make_user()
        whole = transcript_import(owner_id=user.pk, path=write("whole.json", data))
        self.assertEqual((whole.format, whole.conversations[0].messages), ("openwebui", 6))
        with self.assertRaises(ImportRejected) as caught:
            transcript_import(owner_id=user.pk, path=write("chat.json", data[:2000]))
        self.assertEqual(caught.exception.code, "truncated")

    def test_a_list_cut_later_keeps_what_came_before_and_says_what_was_lost(self) -> None:
        doc = json.loads(BROWSING.read_text())
        data = json.dumps(doc)
        cut = data[: data.index('"browse-2025"') + 40]
        report = transcript_import(owner_id=make_user().pk, path=write("two.json", cut))
        self.assertEqual(len(report.conversations), 1)
        self.assertIn(f"cut at byte {len(cut.encode())}", report.truncated)
        self.assertIn("element 1", report.truncated)
        self.assertEqual(report.as_dict()["truncated"], report.truncated)

    def jsonl_cut(self) -> tuple[bytes, int]:
        """A real Codex session (tests/data/codex) cut inside its line 21."""
        lines = CODEX.read_bytes().split(b"\n")
        assert len(lines[20]) > 100
        kept = b"\n".join(lines[:20]) + b"\n"
        return kept + lines[20][:100], 21

    def test_a_jsonl_cut_imports_what_came_before_and_says_so(self) -> None:
        data, line = self.jsonl_cut()
        report: ImportReport = transcript_import(
            owner_id=make_user().pk, path=write("s.jsonl", data)
        )
        self.assertEqual(len(report.conversations), 1)
        self.assertIn(f"cut at byte {len(data)}", report.truncated)
        self.assertIn(f"inside line {line}", report.truncated)
        self.assertIn(f"the {line - 1} lines before it were read", report.truncated)

    def test_the_import_page_says_it_at_the_top(self) -> None:
        data, line = self.jsonl_cut()
        user = make_user()
        self.client.force_login(user)
        with self.captureOnCommitCallbacks(execute=True):
            response = self.client.post(
                reverse("conversations:import"),
                {"file": SimpleUploadedFile("s.jsonl", data), "format": "auto"},
            )
        self.assertEqual(response.status_code, 302)
        job = ImportJob.objects.get(owner=user)
        html = self.client.get(response["Location"]).content.decode()
        self.assertEqual(job.state, "done")
        alert = html.index("This file was cut short.")
        self.assertLess(alert, html.index("Imported 1 conversation"))
        self.assertIn(f"inside line {line}", html)


@override_settings(MEDIA_ROOT=MEDIA.name)
class OddValueTests(TestCase):
    def test_odd_citation_and_tool_values_do_not_stop_the_import(self) -> None:
        docs = json.loads(BROWSING.read_text())
        meta = docs[0]["mapping"]["a-final"]["message"]["metadata"]
        meta["citations"], meta["content_references"] = 5, True
        docs[1]["mapping"]["n-final"]["message"]["metadata"]["content_references"] = [
            {"matched_text": "x", "items": 7}
        ]
        report = transcript_import(
            owner_id=make_user().pk, path=write("odd.json", json.dumps(docs))
        )
        self.assertEqual(len(report.conversations), 2)

    def test_a_line_ending_in_garbage_is_corrupt_not_cut(self) -> None:
        data = (DATA / "sessions" / "pi-parallel.jsonl").read_bytes()
        lines = data.split(b"\n")[:10]
        report = transcript_import(
            owner_id=make_user().pk,
            path=write("g.jsonl", b"\n".join(lines) + b'\n{"type": "message"} x'),
        )
        self.assertEqual(report.truncated, "")
        self.assertIn("corrupt_entry", report.skipped.kinds())


class CiteLinkTests(TestCase):
    def test_only_marker_shaped_text_outside_tags_and_links_is_linked(self) -> None:
        from conversations.templatetags.arbor_ui import cite_links

        html = '<p>See <a href="https://x.org">https 【6†source】</a> then 【6†source】 ok</p>'
        cites = [
            {"marker": " ", "url": "https://a.org"},
            {"marker": "https", "url": "https://b.org"},
            {"marker": "【6†source】", "url": "https://c.org", "title": "C"},
        ]
        out = str(cite_links(html, cites))
        self.assertIn('<a href="https://x.org">https 【6†source】</a>', out)
        self.assertIn('then <a class="cite" href="https://c.org" title="C"', out)
        self.assertNotIn("a.org", out)
        self.assertNotIn("b.org", out)
