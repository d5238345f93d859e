"""Run one chat turn in a separate process, for the crash tests (tests/test_turns.py).

    python tests/turn_child.py CONVERSATION_ID MODEL TEXT [--block-tool READY_FILE]

With --block-tool, a tool named "block" is registered that writes READY_FILE and then
sleeps, so the parent can kill this process after the model produced a tool call and
before the tool's result exists.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "arbor.settings")

import django

django.setup()

from conversations.models import Conversation  # noqa: E402
from conversations.providers import ToolSpec  # noqa: E402
from conversations.tools import TOOLS, Tool  # noqa: E402
from conversations.turns import turn_run  # noqa: E402


def main() -> None:
    cid, model, text = sys.argv[1:4]
    if "--block-tool" in sys.argv:
        ready = Path(sys.argv[sys.argv.index("--block-tool") + 1])

        def block(ctx: object, args: object) -> str:
            ready.write_text(str(os.getpid()))
            time.sleep(120)
            return "unreachable"

        TOOLS["block"] = Tool(ToolSpec("block", "Blocks (crash tests only)."), block)
    conversation = Conversation.objects.get(pk=cid)
    outcome = turn_run(
        conversation=conversation, parts=[{"type": "text", "text": text}], model=model
    )
    print(outcome.tip)


if __name__ == "__main__":
    main()
