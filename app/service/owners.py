"""Who owns a saved voice, and which voices a caller sees (`[voices] scope`). Design notes: docs/design.md."""

from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass
from pathlib import Path

from app.service.voices import VoiceInfo, VoiceStore

OWNER_DIR_PREFIX = "o-"


@dataclass(frozen=True)
class Owner:
    """The caller a voice belongs to; `admin` sees every voice."""

    id: str
    admin: bool = False


ADMIN = Owner("admin", admin=True)
ANYONE = Owner("")  # shared scope's stand-in where no door said who (tools, tests)


@dataclass(frozen=True)
class Caller:
    """Who sent a request (the server's identity.py decides, once per request): the owner of the voices it may
    use, the client its fair share is counted for, and whether it may see every request and the engine's facts."""

    owner: Owner = ANYONE
    client: str = ""
    admin: bool = False


NOBODY = Caller()  # where no door said who: tools, tests, a replica whose ingress counted the share
# a request's state keys (Starlette's `request.state`, ASGI scope["state"]), written once by the server's gate
# (AccessLimits, in the server's limits.py) and read by every door, the page's handlers too
CALLER_KEY = "studio_caller"  # its Caller
ARRIVAL_KEY = "studio_arrived_at"  # its arrival (time.monotonic()), for queue waits


def owner_dir(owner_id: str) -> str:
    """The folder name of `owner_id`'s voices (a hash: owner ids hold characters no path should)."""
    return OWNER_DIR_PREFIX + hashlib.sha256(owner_id.encode("utf-8")).hexdigest()[:24]


class OwnedVoices:
    """The saved voices of every owner under one folder; `of(owner)` is the `VoiceStore` that owner may use."""

    def __init__(self, root: str | Path, scope: str, max_transcript_chars: int | None = None) -> None:
        self.root = Path(root).expanduser().resolve()
        self.private = scope == "private"  # scope: "private" or "shared", the config's resolved [voices] scope
        self.model_fingerprint = ""  # set once the model is loaded (voices of another model are refused)
        self.max_transcript_chars = max_transcript_chars
        self._lock = threading.Lock()  # one for every store: a name is checked and written in one step

    def of(self, owner: Owner, target: str | None = None) -> VoiceStore:
        """The store `owner` reads and writes; the admin may name another owner's (`target`, an owner id)."""
        folder = self.root
        if owner.admin and target:
            folder = self.root / owner_dir(target)
        elif self.private and not owner.admin:
            folder = self.root / owner_dir(owner.id)
        return VoiceStore(folder, self.model_fingerprint, owner=target or owner.id,
                          max_transcript_chars=self.max_transcript_chars, lock=self._lock)

    def visible(self, owner: Owner) -> list[VoiceInfo]:
        """What `owner` may list, newest first: their own; for the admin in private scope every owner's too."""
        found = self.of(owner).list()  # newest first
        if owner.admin and self.private and self.root.is_dir():
            for folder in sorted(self.root.glob(OWNER_DIR_PREFIX + "*")):
                if folder.is_dir():
                    found += VoiceStore(folder, self.model_fingerprint).list()
        return sorted(found, key=lambda v: (-v.created, v.name))

