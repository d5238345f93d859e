"""Images from the chat's composer (#15): pasted or chosen, each is checked and stored
through the blob store before the turn runs, sent to the model with the text, and shown
in the chat; a file that is not an image is refused naming it, with nothing written."""

from __future__ import annotations

from typing import Any

from django.core.files.uploadedfile import SimpleUploadedFile
from django.test import TestCase, override_settings

from conversations.models import Blob, Message, TurnAttempt
from conversations.providers.fake import FakeLLMServer, Step
from tests.builders import make_user, new_conversation
from tests.fake_models import serve_fake_models
from tests.test_api_bad_input import png_bytes


def png(name: str = "shot.png", **kwargs: Any) -> SimpleUploadedFile:
    return SimpleUploadedFile(name, png_bytes(**kwargs), content_type="image/png")


class ComposerImageTests(TestCase):
    def setUp(self) -> None:
        self.fake = FakeLLMServer()
        models = serve_fake_models(self.fake, extra={"openai/eyes": {"vision": True}})
        models.__enter__()
        self.addCleanup(models.__exit__, None, None, None)
        self.user = make_user()
        self.client.force_login(self.user)
        self.conv, _ = new_conversation(self.user, "Hello>Hi")
        self.conv.model = "openai/eyes"
        self.conv.save()
        self.url = f"/c/{self.conv.pk}/send/"

    def counts(self) -> tuple[int, int, int]:
        return (Message.objects.count(), TurnAttempt.objects.count(), Blob.objects.count())

    def test_an_image_and_text_reach_the_model_and_the_chat(self) -> None:
        self.fake.push(Step.reply("A green square."))
        image = png(width=40, height=30)
        response = self.client.post(self.url, {"text": "What is this?", "images": [image]})
        assert response.status_code == 302, response.content
        self.conv.refresh_from_db()
        question = self.conv.tip.parent
        blob = Blob.objects.get()
        assert question.parts[0]["type"] == "image" and question.parts[0]["blob"] == blob.sha256
        assert (question.parts[0]["width"], question.parts[0]["height"]) == (40, 30)
        assert question.parts[1] == {"type": "text", "text": "What is this?"}
        assert blob.owners.filter(pk=self.user.pk).exists()
        # The model got the picture with the words.
        sent = self.fake.requests[-1].body["messages"][-1]["content"]
        kinds = [block["type"] for block in sent]
        assert kinds == ["image_url", "text"], sent
        assert sent[0]["image_url"]["url"].startswith("data:image/png;base64,")
        page = self.client.get(f"/c/{self.conv.pk}/").content.decode()
        assert f'src="/api/blobs/{blob.sha256}"' in page

    def test_an_image_alone_is_a_message(self) -> None:
        response = self.client.post(
            self.url, {"text": "", "images": [png(), png("b.png", width=5)]}
        )
        assert response.status_code == 302
        self.conv.refresh_from_db()
        kinds = [p["type"] for p in self.conv.tip.parent.parts]
        assert kinds == ["image", "image"]

    def test_a_file_that_is_not_an_image_is_refused_naming_it(self) -> None:
        before = self.counts()
        fake_png = SimpleUploadedFile("notes.png", b"just some text", content_type="image/png")
        response = self.client.post(self.url, {"text": "look", "images": [png(), fake_png]})
        assert response.status_code == 422
        assert response.content.decode().startswith("notes.png: ")
        # The good image before it was not stored either: all or none.
        assert self.counts() == before, "a turn ran, a message or an image was written"

    @override_settings(ARBOR_MAX_BLOB_BYTES=100)
    def test_a_large_image_is_refused_with_the_limit(self) -> None:
        before = self.counts()
        response = self.client.post(
            self.url, {"text": "big", "images": [png(width=50, height=50, noise=True)]}
        )
        assert response.status_code == 422
        assert "the limit is 100" in response.content.decode()
        assert self.counts() == before

    def test_nothing_to_send_and_too_many_images_are_form_errors(self) -> None:
        before = self.counts()
        response = self.client.post(self.url, {"text": "  "})
        assert response.status_code == 400
        assert "Write something or attach an image first." in response.content.decode()
        response = self.client.post(
            self.url, {"text": "many", "images": [png(f"{i}.png") for i in range(9)]}
        )
        assert response.status_code == 400
        assert "at most 8 images" in response.content.decode()
        assert self.counts() == before
