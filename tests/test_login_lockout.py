"""Login brute force is throttled: after a few wrong passwords from one address a
username is locked out there (the right password included), on /login/ and on
/admin/login/; another account, or the same one elsewhere, is not affected."""

from __future__ import annotations

from django.conf import settings
from django.test import Client, TestCase

from tests.builders import make_user


class LoginLockoutTests(TestCase):
    def setUp(self) -> None:
        self.alice = make_user("alice", password="right-password", staff=True)
        make_user("bob", password="bobs-password")

    def attempt(self, client: Client, path: str, username: str, password: str) -> int:
        response = client.post(path, {"username": username, "password": password})
        return response.status_code

    def test_wrong_passwords_lock_the_username_at_that_address(self) -> None:
        here = Client(REMOTE_ADDR="203.0.113.5")
        for _ in range(settings.AXES_FAILURE_LIMIT):
            self.assertIn(self.attempt(here, "/login/", "alice", "guess"), (200, 429))
        # Now even the right password is refused, with a clear page.
        response = here.post("/login/", {"username": "alice", "password": "right-password"})
        self.assertEqual(response.status_code, 429)
        self.assertIn("Too many failed sign-ins", response.content.decode())
        self.assertNotIn("_auth_user_id", here.session)
        # The admin's login is the same door.
        self.assertEqual(self.attempt(here, "/admin/login/", "alice", "right-password"), 429)
        # Bob, from the same address, and Alice from another one, still get in.
        self.assertEqual(self.attempt(here, "/login/", "bob", "bobs-password"), 302)
        elsewhere = Client(REMOTE_ADDR="198.51.100.7")
        self.assertEqual(self.attempt(elsewhere, "/login/", "alice", "right-password"), 302)

    def test_a_success_before_the_limit_resets_the_count(self) -> None:
        here = Client(REMOTE_ADDR="203.0.113.9")
        for _ in range(settings.AXES_FAILURE_LIMIT - 1):
            self.attempt(here, "/login/", "alice", "guess")
        self.assertEqual(self.attempt(here, "/login/", "alice", "right-password"), 302)
        here.logout()
        for _ in range(settings.AXES_FAILURE_LIMIT - 1):
            self.attempt(here, "/login/", "alice", "guess")
        self.assertEqual(self.attempt(here, "/login/", "alice", "right-password"), 302)
