"""The compare page: sibling answers, or whole branches below the point they split."""

from __future__ import annotations

import re

from django.test import TestCase

from conversations.compare import compare, recent_leaves
from tests.builders import make_user, new_conversation


def _cells(body: str, column_id: object) -> list[str]:
    """The diff text of each cell of one column, tags stripped."""
    column = body.split(f'id="col-{column_id}"', 1)[1].split("</section>", 1)[0]
    cells = re.findall(r'<div class="diff">(.*?)</div>', column, flags=re.S)
    return [re.sub(r"<[^>]+>", "", cell).strip() for cell in cells]


class CompareBranchesTests(TestCase):
    @classmethod
    def setUpTestData(cls) -> None:
        cls.alice = make_user("alice")
        cls.bob = make_user("bob")
        # Two branches leave "plan": one explores caching in three messages, the
        # other explores indexes in two.
        cls.conv, cls.n = new_conversation(
            cls.alice,
            "task>plan>try cache>cache hits low>drop cache, plan>try index>index helps",
            title="perf",
        )

    def setUp(self) -> None:
        self.client.force_login(self.alice)

    def test_two_leaves_show_each_branch_below_the_split_row_by_row(self) -> None:
        a, b = self.n["drop cache"], self.n["index helps"]
        response = self.client.get(f"/c/{self.conv.pk}/compare/?m={a.pk}&m={b.pk}")
        assert response.status_code == 200
        body = response.content.decode()
        # The shared part is named once, not repeated in the columns.
        assert "Both continue from the assistant message" in body and "plan" in body
        assert _cells(body, a.pk) == ["try cache", "cache hits low", "drop cache"]
        assert _cells(body, b.pk) == ["try index", "index helps"]
        # Row 1 of the second branch is diffed against row 1 of the first.
        assert "<del>cache</del>" in body and "<ins>index</ins>" in body
        # Either branch can be continued.
        assert body.count("Continue from this one") == 2

    def test_siblings_compare_as_single_messages(self) -> None:
        conv, n = new_conversation(self.alice, "q>the quick fox, q>the slow fox")
        comparison = compare(conversation=conv, chosen=[n["the quick fox"], n["the slow fox"]])
        assert comparison.split is not None and comparison.split.pk == n["q"].pk
        assert [len(c.cells) for c in comparison.columns] == [1, 1]
        assert "<del>quick</del>" in comparison.columns[0].cells[0].text
        assert "<ins>slow</ins>" in comparison.columns[1].cells[0].text

    def test_an_ancestor_and_its_descendant_each_get_a_column(self) -> None:
        comparison = compare(conversation=self.conv, chosen=[self.n["plan"], self.n["drop cache"]])
        assert [c.chosen.pk for c in comparison.columns] == [
            self.n["plan"].pk,
            self.n["drop cache"].pk,
        ]
        assert [m.message.pk for m in comparison.columns[1].cells][-1] == self.n["drop cache"].pk

    def test_one_path_query_per_chosen_message_and_two_for_the_labels(self) -> None:
        chosen = [self.n["drop cache"], self.n["index helps"]]
        with self.assertNumQueries(2 + 2):  # + the current path, + the versions
            compare(conversation=self.conv, chosen=chosen)

    def test_the_picker_lists_leaves_newest_first(self) -> None:
        leaves = recent_leaves(conversation=self.conv)
        assert [m.pk for m in leaves] == [self.n["index helps"].pk, self.n["drop cache"].pk]
        body = self.client.get(f"/c/{self.conv.pk}/compare/").content.decode()
        assert body.count('type="checkbox" name="m"') == 2
        assert "Compare the checked branches" in body

    def test_bad_and_foreign_ids_are_404(self) -> None:
        _other, n = new_conversation(self.bob, "x>y, x>z")
        url = f"/c/{self.conv.pk}/compare/"
        assert self.client.get(url + "?m=nope&m=" + str(self.n["plan"].pk)).status_code == 404
        foreign = f"?m={n['y'].pk}&m={self.n['plan'].pk}"
        assert self.client.get(url + foreign).status_code == 404
        self.client.force_login(self.bob)
        assert self.client.get(url).status_code == 404

    def test_text_is_escaped_in_every_cell(self) -> None:
        # Two roots (no shared message) whose text is markup; build_tree splits names on
        # ">", so the tags are left open.
        one = "note about the page <script src=//evil.example/x.js"
        two = "note about the page <img src=x onerror=alert(1)"
        conv, n = new_conversation(self.alice, f"{one}, {two}")
        a, b = n[one], n[two]
        body = self.client.get(f"/c/{conv.pk}/compare/?m={a.pk}&m={b.pk}").content.decode()
        assert "These branches share no message" in body
        assert "<script src=//evil" not in body and "<img src=x" not in body
        assert "<del>&lt;script src=//evil.example/x.js</del>" in body
        assert "<ins>&lt;img src=x onerror=alert(1)</ins>" in body


class CompareLabelsTests(TestCase):
    """Each column says which version it is, by which model, when, and whether the
    current path runs through it; a rewrite is not a sea of strikethrough; a plain view
    shows the texts without marks."""

    def setUp(self) -> None:
        self.alice = make_user("alice")
        self.client.force_login(self.alice)
        self.conv, self.n = new_conversation(
            self.alice,
            "q>the quick brown fox jumps, q>the slow brown fox jumps, "
            "q>an entirely different reply about relational databases and their indexes",
            tip="the slow brown fox jumps",
        )
        for name, model in (("the quick brown fox jumps", "openai/gpt-4o"),):
            message = self.n[name]
            message.metadata = {**message.metadata, "model": model}
            message.save(update_fields=["metadata"])

    def test_versions_model_current_and_rewrites(self) -> None:
        quick, slow, other = (
            self.n["the quick brown fox jumps"],
            self.n["the slow brown fox jumps"],
            self.n["an entirely different reply about relational databases and their indexes"],
        )
        with self.assertNumQueries(5):  # three paths, the current path, the versions
            comparison = compare(conversation=self.conv, chosen=[quick, slow, other])
        labels = [(c.version, c.current, c.model) for c in comparison.columns]
        assert labels == [((1, 3), False, "openai/gpt-4o"), ((2, 3), True, ""), ((3, 3), False, "")]
        first, second, third = (c.cells[0] for c in comparison.columns)
        # An edit is diffed word by word; a rewrite is shown as it is, and said so.
        assert "<del>quick</del>" in first.text and "<ins>slow</ins>" in second.text
        assert third.rewritten and "<ins>" not in third.text and "<del>" not in third.text
        assert not first.rewritten and not second.rewritten

    def test_the_page_labels_columns_and_switches_to_plain_text(self) -> None:
        quick, slow = self.n["the quick brown fox jumps"], self.n["the slow brown fox jumps"]
        url = f"/c/{self.conv.pk}/compare/?m={quick.pk}&m={slow.pk}"
        body = self.client.get(url).content.decode()
        assert "Version 1/3" in body and "Version 2/3" in body
        current = body.split(f'id="col-{slow.pk}"', 1)[1].split("</h2>", 1)[0]
        assert 'class="badge current"' in current
        assert (
            'class="badge current"'
            not in body.split(f'id="col-{quick.pk}"', 1)[1].split("</h2>", 1)[0]
        )
        assert "openai/gpt-4o" in body and "<del>quick</del>" in body
        assert 'class="wide"' in body  # the grid gets the window's width
        plain = self.client.get(url + "&view=plain").content.decode()
        assert "<del>" not in plain and "<ins>" not in plain
        assert _cells(plain, quick.pk) == ["the quick brown fox jumps"]
        assert _cells(plain, slow.pk) == ["the slow brown fox jumps"]
        # The links between the two views keep the chosen messages.
        assert f"m={quick.pk}&amp;m={slow.pk}&amp;view=diff" in plain
        # An unknown view is the default one, not an error.
        assert "<del>quick</del>" in self.client.get(url + "&view=bogus").content.decode()
