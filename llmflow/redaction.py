"""The one rule for what llmflow never writes to a file: secret values.

Everything a run writes for people to read or share (a dump's env.json, stage state files,
summary.json, generation files, reports) goes through this module. Three things are redacted,
each replaced by ``<redacted>``:

1. **By name**: the value of an environment variable whose name looks secret. The name is split
   into parts on ``_``, ``-`` and ``.`` (case ignored); it is secret when a part *is* one of
   ``SECRET_PARTS`` (``HF_TOKEN``, ``ASCEND_PIN``, ``PWD``, ``ATB_LICENSE_FILE``, ``MY_API_KEY``)
   or *ends with* one of ``SECRET_SUFFIXES``, the words long enough not to end other words
   (``HFTOKEN``, ``DBPASSWORD``, ``APIKEY``). Parts are compared whole so that ``PATH``,
   ``KEEP_ALIVE``, ``SPINE``, ``KEYBOARD``, ``TOKENIZERS_PARALLELISM`` and ``MAX_NEW_TOKENS`` are
   not secret. Any prefix works the same (``ASCEND_``, ``ATB_``, ``HCCL_``, ``TORCH_HUB_``).
2. **Credentials inside URLs**, in any string: ``https://user:pass@host/x`` becomes
   ``https://<redacted>@host/x`` (a token given as the user name is a credential too).
3. **Known values**: a stage parameter that came from ``${env.X}`` with a secret name X holds X's
   value; a ``Redactor`` made with those values replaces them wherever they appear in a string
   (values shorter than ``MIN_EMBEDDED`` only where they are the whole string: replacing every
   ``"7"`` would garble numbers and paths).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from pathlib import PurePath
from typing import Any

REDACTED = "<redacted>"

#: name parts that make an environment variable secret when a part is exactly one of them
SECRET_PARTS = frozenset({
    "TOKEN", "SECRET", "SECRETS", "PASSWORD", "PASSWORDS", "PASSWD", "PASS", "PASSPHRASE", "PWD", "PIN",
    "KEY", "KEYS", "CREDENTIAL", "CREDENTIALS", "CREDS", "AUTH", "LICENSE", "CERT", "CERTS", "PRIVATE",
    "SESSION", "COOKIE", "COOKIES",
})
#: words that make a name part secret when it ends with them (``HFTOKEN``, ``DBPASSWORD``)
SECRET_SUFFIXES = ("TOKEN", "SECRET", "PASSWORD", "PASSWD", "PASSPHRASE", "CREDENTIAL", "CREDENTIALS",
                   "APIKEY", "COOKIE")
MIN_EMBEDDED = 4  # a known secret value this long or longer is also redacted inside longer strings

_NAME_PARTS = re.compile(r"[_\-.]+")
# scheme://userinfo@ : userinfo up to the last "@" before the host's end (a password may hold "@")
_URL_USERINFO = re.compile(r"\b([A-Za-z][A-Za-z0-9+.\-]*://)[^/?#\s]*@")


def is_secret_name(name: str) -> bool:
    """True when environment variable ``name`` looks like it holds a secret (see the module doc)."""
    for part in _NAME_PARTS.split(name.upper()):
        if part in SECRET_PARTS or part.endswith(SECRET_SUFFIXES):
            return True
    return False


def redact_urls(text: str) -> str:
    """``text`` with the user and password of every URL in it replaced by ``<redacted>``."""
    if "://" not in text:
        return text
    return _URL_USERINFO.sub(lambda m: f"{m.group(1)}{REDACTED}@", text)


def redact_env(environ: Mapping[str, str]) -> dict[str, str]:
    """Environment variables as they may be written: secret names' values ``<redacted>`` (the name
    stays, so a diff still sees the variable), URL credentials in the others redacted."""
    return {k: REDACTED if is_secret_name(k) else redact_urls(v) for k, v in environ.items()}


class Redactor:
    """Redacts known secret values (and URL credentials) from JSON-like values before they are
    written. ``Redactor()`` knows no values and redacts URL credentials only."""

    def __init__(self, values: Iterable[str] = ()):
        # longest first, so a value containing another is replaced whole
        self.values: tuple[str, ...] = tuple(sorted({v for v in values if isinstance(v, str) and v},
                                                    key=len, reverse=True))
        self._embedded = [v for v in self.values if len(v) >= MIN_EMBEDDED]

    def __bool__(self) -> bool:
        return bool(self.values)

    def text(self, value: str) -> str:
        """One string, redacted."""
        if value in self.values:
            return REDACTED
        for secret in self._embedded:
            if secret in value:
                value = value.replace(secret, REDACTED)
        return redact_urls(value)

    def __call__(self, value: Any) -> Any:
        """``value`` (dicts, lists, tuples, strings, other scalars) with every string redacted; dict
        keys too. A new value: the argument is not changed."""
        if isinstance(value, (str, PurePath)):
            return self.text(str(value))
        if isinstance(value, Mapping):
            return {self.text(k) if isinstance(k, str) else k: self(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [self(v) for v in value]
        return value


def secret_env_values(names: Iterable[tuple[str, str | None]], environ: Mapping[str, str]) -> list[str]:
    """The values of the ``(name, default)`` environment references whose names look secret: the
    variable's value, or the default the reference gives when it is unset."""
    out = []
    for name, default in names:
        if is_secret_name(name):
            value = environ.get(name, default)
            if value:
                out.append(value)
    return out
