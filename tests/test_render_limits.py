"""Huge messages do not hold the chat page or the process: a text part renders up to a
bound with "Show all" (the message as plain text, for its owner only), a message shows
its first parts and counts the rest, the markdown cache is bounded in characters (not
entries), and an animation's frames together are held to the image pixel limit.
"""

from __future__ import annotations

import io
import tempfile

from django.test import Client, TestCase, override_settings
from django.urls import reverse
from PIL import Image

from conversations import markdown, services
from conversations.errors import InvalidInput
from conversations.models import Message
from conversations.templatetags.arbor_ui import RENDER_MAX_CHARS, RENDER_MAX_PARTS
from tests.builders import make_user, new_conversation


class LongMessageTests(TestCase):
    @classmethod
    def setUpTestData(cls) -> None:
        cls.user = make_user("reader")
        cls.conv, cls.n = new_conversation(cls.user, "a>b")
        cls.huge = "".join(f"line {i} of a very long paste\n" for i in range(70_000))
        Message.objects.filter(pk=cls.n["b"].pk).update(parts=[{"type": "text", "text": cls.huge}])
        many = [{"type": "text", "text": f"part number {i}"} for i in range(1_000)]
        Message.objects.filter(pk=cls.n["a"].pk).update(parts=many)

    def setUp(self) -> None:
        self.client.force_login(self.user)

    def page(self) -> str:
        response = self.client.get(reverse("conversations:detail", args=[self.conv.pk]))
        self.assertEqual(response.status_code, 200)
        return response.content.decode()

    def test_a_huge_text_renders_up_to_the_bound_with_show_all(self) -> None:
        self.assertGreater(len(self.huge), 1_900_000)
        html = self.page()
        self.assertIn("line 100 of a very long paste", html)
        self.assertNotIn("line 69999 of a very long paste", html)
        self.assertLess(len(html), 4 * RENDER_MAX_CHARS + 100_000)
        self.assertIn(f"Show all ({len(self.huge)} characters)", html)
        url = reverse("conversations:message_text", args=[self.conv.pk, self.n["b"].pk])
        self.assertIn(f'href="{url}"', html)
        full = self.client.get(url)
        self.assertEqual(full["Content-Type"], "text/plain; charset=utf-8")
        self.assertEqual(full.content.decode(), self.huge)

    def test_a_message_of_many_parts_shows_the_first_and_counts_the_rest(self) -> None:
        html = self.page()
        self.assertIn(f"part number {RENDER_MAX_PARTS - 1}", html)
        self.assertNotIn(f"part number {RENDER_MAX_PARTS}<", html)
        self.assertIn(f"{1_000 - RENDER_MAX_PARTS} more parts not shown", html)

    def test_show_all_is_the_owner_s_only(self) -> None:
        url = reverse("conversations:message_text", args=[self.conv.pk, self.n["b"].pk])
        stranger = Client()
        stranger.force_login(make_user("stranger"))
        self.assertEqual(stranger.get(url).status_code, 404)


class MarkdownCacheTests(TestCase):
    def test_the_cache_is_bounded_by_characters(self) -> None:
        cache = markdown._ByteBoundedCache(max_chars=100_000, max_item=30_000)
        for i in range(50):
            cache.put(f"{i}" + "x" * 10_000, "<p>" + "x" * 10_000 + "</p>")
        self.assertLessEqual(cache.size, 100_000)
        self.assertLessEqual(len(cache.items), 5)
        self.assertIsNotNone(cache.get("49" + "x" * 10_000))  # the newest are kept
        self.assertIsNone(cache.get("0" + "x" * 10_000))
        cache.put("big" * 20_000, "y")
        self.assertIsNone(cache.get("big" * 20_000))  # over max_item: never kept

    def test_render_still_caches_ordinary_text(self) -> None:
        text = "a **bold** claim, once"
        first = markdown.render(text)
        self.assertEqual(markdown._CACHE.get(text), first)


def gif(frames: int, size: tuple[int, int]) -> bytes:
    images = [Image.new("RGB", size, (i % 256, (i * 7) % 256, 0)) for i in range(frames)]
    out = io.BytesIO()
    images[0].save(out, "GIF", save_all=True, append_images=images[1:], duration=20)
    return out.getvalue()


@override_settings(MEDIA_ROOT=tempfile.mkdtemp())
class AnimationLimitTests(TestCase):
    def test_frames_times_area_are_held_to_the_pixel_limit(self) -> None:
        user = make_user()
        with override_settings(ARBOR_MAX_IMAGE_PIXELS=1_000_000):
            with self.assertRaises(InvalidInput) as caught:
                services.blob_store(owner=user, data=gif(120, (100, 100)))
            self.assertEqual(caught.exception.code, "image_too_large")
            self.assertIn("120 frames", caught.exception.detail)
            blob = services.blob_store(owner=user, data=gif(20, (100, 100)))
        self.assertEqual((blob.width, blob.height), (100, 100))
