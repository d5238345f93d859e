"""``manage.py create_api_token USERNAME [--name NAME] [--days N]``: mint an API bearer token.

The secret is printed once; only its sha256 is stored, so it cannot be shown again.
Every run creates a new token (a user may hold several, e.g. one per script).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError, CommandParser

from conversations import services

API_URL = "http://127.0.0.1:8000/api/conversations"


class Command(BaseCommand):
    help = (
        "Create an API token for USERNAME and print its secret once. Use it as "
        "'Authorization: Bearer <secret>' on /api/. Only a hash is stored: a lost secret "
        "cannot be recovered, create a new token instead."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("username", help="the user the token acts as")
        parser.add_argument(
            "--name",
            default="cli",
            help="a label to tell the user's tokens apart (default: %(default)s)",
        )
        parser.add_argument(
            "--days",
            type=int,
            default=None,
            help="refuse the token after this many days (default: it never expires)",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        username: str = options["username"]
        user_model = get_user_model()
        try:
            user = user_model._default_manager.get_by_natural_key(username)
        except user_model.DoesNotExist:
            raise CommandError(
                f"no user named {username!r}; create one first "
                "(manage.py createsuperuser, or in the admin)"
            ) from None
        if not user.is_active:
            raise CommandError(
                f"user {username!r} is inactive: a token for it would be refused; "
                "activate the user first"
            )
        days = options["days"]
        if days is not None and days < 1:
            raise CommandError(f"--days must be 1 or more, got {days}")
        token, secret = services.api_token_create(
            user=user,
            name=options["name"],
            expires_in=timedelta(days=days) if days is not None else None,
        )
        self.stdout.write(
            f"Created API token {token.name!r} for {username}. Copy the secret now: only its "
            "hash is stored and it is never shown again."
        )
        self.stdout.write(secret)
        self.stdout.write(f'Try it: curl -H "Authorization: Bearer {secret}" {API_URL}')
