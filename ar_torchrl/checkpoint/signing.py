"""Optional authenticity of checkpoints: an HMAC-SHA256 over a checkpoint's manifest (no torch).

The SHA-256s in a checkpoint's manifest (``.step_<N>.pt.manifest.json``, or ``meta.json`` of a
distributed checkpoint) detect **damage**, not **tampering**: whoever can write the checkpoint
directory can recompute them, or delete them and land on the path for checkpoints saved before
checksums existed. With a secret key, a save also writes ``hmac_sha256``: an HMAC-SHA256 of the
manifest, which holds every file's size and SHA-256, so it vouches for every byte of the checkpoint.
A store with a :class:`CheckpointSigner` checks it **before** anything of the checkpoint is read
beyond its JSON manifest (before the files are hashed, before anything is unpickled or loaded); an
unsigned or wrongly signed checkpoint is refused, naming the checkpoint and where the key comes from.

The key is read from an environment variable (the recipe's ``checkpoint.hmac_key_env`` names it), so
it never appears in a config, a command line or a log. A signer never prints it and cannot be pickled.
See docs/checkpoints.md for what this protects against and what it does not.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
from collections.abc import Mapping
from typing import Any

__all__ = ["MIN_KEY_BYTES", "SIGNATURE_KEY", "CheckpointSigner"]

#: The manifest entry holding the HMAC (hex).
SIGNATURE_KEY = "hmac_sha256"
#: Shorter keys are refused (an HMAC key should be random: ``secrets.token_hex(32)``).
MIN_KEY_BYTES = 16
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_MAKE_KEY = "python -c 'import secrets; print(secrets.token_hex(32))'"


class CheckpointSigner:
    """Signs and checks checkpoint manifests with HMAC-SHA256 under a secret key.

    Args:
        key: the secret (at least :data:`MIN_KEY_BYTES` bytes).
        source: where the key comes from, for messages (``$NAME`` for an environment variable).

    Example:
        >>> signer = CheckpointSigner(b"0123456789abcdef", source="$MY_KEY")
        >>> record = signer.signed({"file": "step_3.pt", "sha256": "ab12"}, kind="local")
        >>> signer.problem(record, kind="local", what="step_3.pt") is None
        True
        >>> signer.problem({**record, "sha256": "cd34"}, kind="local", what="step_3.pt")[:53]
        'step_3.pt: its HMAC does not match the key in $MY_KEY'
        >>> signer
        CheckpointSigner(key from $MY_KEY)
    """

    def __init__(self, key: bytes, *, source: str = "the given key") -> None:
        if not isinstance(key, bytes):
            raise TypeError(f"CheckpointSigner: key must be bytes, got {type(key).__name__}")
        if len(key) < MIN_KEY_BYTES:
            raise ValueError(
                f"CheckpointSigner: the key in {source} has {len(key)} bytes, fewer than "
                f"{MIN_KEY_BYTES}: use a random key, e.g. `{_MAKE_KEY}`"
            )
        self._key = key
        self.source = source

    @classmethod
    def from_env(cls, env: str, *, option: str = "hmac_key_env") -> CheckpointSigner:
        """The signer whose key is the value of the environment variable ``env`` (UTF-8);
        ``option`` names the setting that gave ``env``, for messages.

        Raises:
            ValueError: ``env`` is not a variable name, or the variable is unset, empty or short
                (the message names the variable, never its value).

        Example:
            >>> CheckpointSigner.from_env("AR_TORCHRL_DOC_UNSET_KEY")
            Traceback (most recent call last):
            ...
            ValueError: hmac_key_env=AR_TORCHRL_DOC_UNSET_KEY: the environment variable $AR_TORCHRL_DOC_UNSET_KEY is not set; ...
        """
        if not isinstance(env, str) or not _ENV_NAME.fullmatch(env):
            raise ValueError(
                f"{option} must be the NAME of an environment variable that holds the key "
                "(letters, digits, _), not the key itself; the value given is not printed"
            )
        value = os.environ.get(env)
        if not value:
            raise ValueError(
                f"{option}={env}: the environment variable ${env} is "
                f"{'empty' if value == '' else 'not set'}; export the key there (e.g. "
                f"`export {env}=$({_MAKE_KEY})`), the same on every machine that saves or loads"
            )
        try:
            return cls(value.encode(), source=f"${env}")
        except ValueError as err:
            raise ValueError(
                f"{option}={env}: {str(err).removeprefix('CheckpointSigner: ')}"
            ) from None

    def sign(self, record: Mapping[str, Any], *, kind: str) -> str:
        """The HMAC (hex) of ``record`` without its own signature; ``kind`` separates the
        manifests of different checkpoint formats (``"local"``, ``"sharded"``)."""
        return hmac.new(self._key, _message(record, kind), hashlib.sha256).hexdigest()

    def signed(self, record: Mapping[str, Any], *, kind: str) -> dict[str, Any]:
        """``record`` with its signature under :data:`SIGNATURE_KEY`."""
        return {**record, SIGNATURE_KEY: self.sign(record, kind=kind)}

    def problem(self, record: Any, *, kind: str, what: str) -> str | None:
        """Why ``record`` (a parsed manifest) is not authentic (``None``: it is), naming ``what``."""
        tag = record.get(SIGNATURE_KEY) if isinstance(record, Mapping) else None
        if tag is None:
            return (
                f"{what} is not signed (its manifest has no HMAC) but checkpoints are "
                f"authenticated with the key in {self.source}: refused, it could have been "
                "planted or changed (or it was saved without the key)"
            )
        if not isinstance(tag, str) or not hmac.compare_digest(tag, self.sign(record, kind=kind)):
            return (
                f"{what}: its HMAC does not match the key in {self.source} (signed with another "
                "key, or its manifest was altered): refused, it could have been planted or changed"
            )
        return None

    def __repr__(self) -> str:
        return f"CheckpointSigner(key from {self.source})"

    def __reduce__(self):
        raise TypeError(
            "a CheckpointSigner holds a secret key and is not pickled: each process reads the key "
            "from its own environment (CheckpointSigner.from_env)"
        )


def _message(record: Mapping[str, Any], kind: str) -> bytes:
    body = {k: v for k, v in record.items() if k != SIGNATURE_KEY}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"))
    return f"ar_torchrl checkpoint manifest ({kind})\n{text}".encode()
