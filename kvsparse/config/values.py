"""One typed reader for every setting's text: durations, sizes, counts, switches.

Each setting kvsparse takes from the environment or a command-line flag is
declared once, as a `Setting` (`kvsparse.config.settings.SETTINGS`), with
its kind and its bounds; the kind's parser is shared, so every duration
accepts the same spellings, every size the same units, and the errors read
alike:

- seconds: ``30``, ``2.5``, ``500ms``, ``30s``, ``5m``, ``1h``; ``inf`` where
  the setting allows no bound (a retry window that never gives up).
- bytes: ``1073741824``, ``512MiB``, ``1GiB``, ``1G``, ``64k`` (powers of 1024).
- count: a whole number, ``0`` or more (a setting may ask for more).
- switch: ``1``/``0``, ``true``/``false``, ``yes``/``no``, ``on``/``off``.

An empty variable counts as unset. A malformed value raises
`kvsparse.errors.InvalidArgument` naming the variable (or flag) and what it
takes. Thread-safe: nothing here keeps state.

Example:
    >>> parse_seconds("500ms", "KVSPARSE_TIMEOUT"), parse_bytes("1GiB", "--max-message-size")
    (0.5, 1073741824)
"""

from __future__ import annotations

import math
import operator
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Optional

from kvsparse.config.names import (
    DEFAULT_HEARTBEAT_TIMEOUT,
    HEARTBEAT_TIMEOUT,
    MAX_REPLY_BYTES,
    MAX_UNREAD_REPLY_BYTES,
    MEMORY_BUDGET,
    REJOIN_WINDOW,
    RETRY_WINDOW,
    SAVE_EVERY,
    TIMEOUT,
)
from kvsparse.errors import InvalidArgument

_SECOND_UNITS = {"": 1.0, "s": 1.0, "ms": 1e-3, "m": 60.0, "min": 60.0, "h": 3600.0}
_SECONDS_PATTERN = re.compile(r"([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*(ms|s|min|m|h)?")
_INFINITE = ("inf", "infinity")
_BYTE_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_BYTES_PATTERN = re.compile(r"(\d+)\s*([kmgt]?)(?:i?b)?")
_SWITCHES = {"1": True, "true": True, "yes": True, "on": True}
_SWITCHES.update({"0": False, "false": False, "no": False, "off": False})


def parse_seconds(
    text,
    what: str = "duration",
    *,
    minimum: float = 0.0,
    above_minimum: bool = False,
    infinite: bool = False,
) -> float:
    """A duration in seconds: ``30``, ``2.5``, ``500ms``, ``30s``, ``5m``, ``1h`` (or ``inf``).

    Args:
        text: the text (a number is taken as seconds too).
        what: the variable or flag to name in an error.
        minimum: the least value allowed; above_minimum: the value must exceed it.
        infinite: whether ``inf`` (no bound) is allowed.

    Raises:
        InvalidArgument: not a duration in range, naming `what`.

    Example:
        >>> parse_seconds("2m", "--retry-window"), parse_seconds("inf", "x", infinite=True)
        (120.0, inf)
    """
    bound = f"> {minimum:g}" if above_minimum else f">= {minimum:g}"
    takes = f"a number of seconds {bound} (e.g. 30, 2.5, 500ms, 5m, 1h" + (
        ", or inf)" if infinite else ")"
    )
    if isinstance(text, bool):
        raise InvalidArgument(f"{what} must be {takes}, got {text!r}")
    if isinstance(text, (int, float)):
        value = float(text)
    elif isinstance(text, str):
        folded = text.strip().lower()
        if folded in _INFINITE:
            value = math.inf
        else:
            match = _SECONDS_PATTERN.fullmatch(folded)
            if match is None:
                raise InvalidArgument(f"{what}={text!r} is not {takes}")
            value = float(match.group(1)) * _SECOND_UNITS[match.group(2) or ""]
    else:
        raise InvalidArgument(f"{what} must be {takes}, got {text!r}")
    if math.isnan(value) or (math.isinf(value) and not (infinite and value > 0)):
        raise InvalidArgument(f"{what}={text!r} is not {takes}")
    if value < minimum or (above_minimum and value == minimum):
        raise InvalidArgument(f"{what}={text!r} is not {takes}")
    return value


def parse_bytes(text, what: str = "size", *, minimum: int = 1) -> int:
    """A byte count written as ``1073741824``, ``512MiB``, ``1G`` or ``64k`` (powers of 1024).

    Raises:
        InvalidArgument: not a whole number of bytes >= minimum, naming `what`.

    Example:
        >>> parse_bytes('1GiB'), parse_bytes('64k'), parse_bytes('100')
        (1073741824, 65536, 100)
    """
    takes = f"a number of bytes >= {minimum} (e.g. 1073741824, 512MiB, 1GiB)"
    if isinstance(text, bool):
        raise InvalidArgument(f"{what} must be {takes}, got {text!r}")
    if isinstance(text, int) or hasattr(text, "__index__"):
        value = operator.index(text)
    elif isinstance(text, str):
        match = _BYTES_PATTERN.fullmatch(text.strip().lower())
        if match is None:
            raise InvalidArgument(f"{what}={text!r} is not {takes}")
        value = int(match.group(1)) * _BYTE_UNITS[match.group(2)]
    else:
        raise InvalidArgument(f"{what} must be {takes}, got {text!r}")
    if value < minimum:
        raise InvalidArgument(f"{what}={text!r} is not {takes}")
    return value


def parse_count(text, what: str = "count", *, minimum: int = 0) -> int:
    """A whole number >= minimum, from text (``"4"``) or an int.

    Raises:
        InvalidArgument: not a whole number in range, naming `what`.

    Example:
        >>> parse_count(" 4 ", "KVSPARSE_RANK")
        4
    """
    if isinstance(text, str):
        try:
            value = int(text.strip(), 10)
        except ValueError:
            raise InvalidArgument(f"{what}={text!r} is not an integer") from None
    else:
        value = _check_int(text, what)
    if value < minimum:
        raise InvalidArgument(f"{what}={text!r} must be >= {minimum}")
    return value


def parse_switch(text, what: str = "switch") -> bool:
    """On or off: ``1``/``0``, ``true``/``false``, ``yes``/``no``, ``on``/``off``.

    Raises:
        InvalidArgument: anything else, naming `what`.

    Example:
        >>> parse_switch("off", "KVSPARSE_FAST_PATH")
        False
    """
    if isinstance(text, bool):
        return text
    value = _SWITCHES.get(str(text).strip().lower()) if isinstance(text, (str, int)) else None
    if value is None:
        raise InvalidArgument(f"{what} must be 0 or 1 (or true/false, on/off), got {text!r}")
    return value


def _check_int(value, what: str) -> int:
    # operator.index takes int and NumPy integers, and refuses floats and strings.
    if isinstance(value, bool):
        raise InvalidArgument(f"{what} must be an integer, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise InvalidArgument(f"{what} must be an integer, got {value!r}") from None


def _parse_int(text: str, variable: str, minimum: int = 0) -> int:
    return parse_count(text, variable, minimum=minimum)


def _get(environ: Mapping, name: str) -> Optional[str]:
    """The variable's text, or None when it is unset or blank."""
    value = environ.get(name)
    if value is None or not value.strip():
        return None
    return value


def _count(environ: Mapping, name: str, what: str) -> Optional[int]:
    """Variable name as an integer >= 0 (None when unset); InvalidArgument naming it else."""
    text = _get(environ, name)
    if text is None:
        return None
    try:
        value = int(text, 10)
    except ValueError:
        value = -1
    if value < 0:
        raise InvalidArgument(f"{name} must be {what} >= 0, got {text!r}")
    return value


@dataclass(frozen=True)
class Setting:
    """One duration or size setting: where it is read from and what it takes.

    Attributes:
        name: the keyword it goes by in Python (``retry_window``).
        kind: 'seconds' or 'bytes' (`kvsparse.config.values`).
        variable: its environment variable, or None (a flag only).
        flag: its command-line flag, or None (the environment only).
        default: the value when unset.
        minimum, above_minimum: the least value (exclusive when above_minimum).
        infinite: whether ``inf`` (no bound) is allowed.
        unlimited: a value (such as -1) that turns the bound off, or None.

    Immutable: safe to share between threads.

    Example:
        >>> SETTINGS["retry_window"].parse("90s")
        90.0
    """

    name: str
    kind: str
    variable: Optional[str] = None
    flag: Optional[str] = None
    default: object = None
    minimum: float = 0
    above_minimum: bool = False
    infinite: bool = False
    unlimited: Optional[int] = None

    def parse(self, text, what: Optional[str] = None):
        """The value of text for this setting; InvalidArgument naming `what` (or the variable)."""
        what = what or self.variable or self.flag or self.name
        if self.unlimited is not None and str(text).strip() == str(self.unlimited):
            return self.unlimited
        if self.kind == "seconds":
            return parse_seconds(
                text,
                what,
                minimum=self.minimum,
                above_minimum=self.above_minimum,
                infinite=self.infinite,
            )
        minimum = int(self.minimum) + (1 if self.above_minimum else 0)
        return parse_bytes(text, what, minimum=minimum)

    def read(self, environ: Optional[Mapping] = None):
        """The setting from its variable, or its default when unset."""
        environ = os.environ if environ is None else environ
        text = None if self.variable is None else _get(environ, self.variable)
        return self.default if text is None else self.parse(text)

    def add_argument(self, parser, help: str, *, default=None) -> None:
        """Adds this setting's flag to an argparse parser (or group), parsed like its variable.

        default: the value when the flag is not given (None: the caller decides later).
        """
        parser.add_argument(
            self.flag,
            type=self.argument(),
            default=default,
            metavar="SECONDS" if self.kind == "seconds" else "BYTES",
            help=help,
        )

    def argument(self):
        """An argparse ``type=`` for its flag: the same parser, argparse's error."""
        import argparse

        def parse(text: str):
            try:
                return self.parse(text, self.flag)
            except InvalidArgument as exc:
                raise argparse.ArgumentTypeError(str(exc)) from None

        parse.__name__ = self.kind  # argparse names the type in its message
        return parse


_SETTINGS = (
    Setting("timeout", "seconds", TIMEOUT, "--timeout", None, 0, above_minimum=True),
    Setting("retry_window", "seconds", RETRY_WINDOW, "--retry-window", 0.0, infinite=True),
    Setting("rejoin_window", "seconds", REJOIN_WINDOW, None, 0.0, infinite=True),
    Setting("heartbeat_timeout", "seconds", HEARTBEAT_TIMEOUT, None, DEFAULT_HEARTBEAT_TIMEOUT),
    Setting("save_every", "seconds", SAVE_EVERY, "--save-every", None, 0, above_minimum=True),
    Setting("startup_timeout", "seconds", None, "--startup-timeout", 60.0, 0, above_minimum=True),
    Setting("grace_period", "seconds", None, "--grace-period", 5.0),
    Setting("rendezvous_wait", "seconds", None, "--rendezvous-wait", None, 0, above_minimum=True),
    Setting("max_reply_bytes", "bytes", MAX_REPLY_BYTES, "--max-reply-bytes", None, 1),
    Setting(
        "max_unread_reply_bytes",
        "bytes",
        MAX_UNREAD_REPLY_BYTES,
        "--max-unread-reply-bytes",
        None,
        1,
    ),
    Setting("max_message_size", "bytes", None, "--max-message-size", 1 << 30, 1, unlimited=-1),
    # 0 (the default): no budget, the shard grows as it did before there was one.
    Setting("memory_budget", "bytes", MEMORY_BUDGET, "--memory-budget", 0, 0),
)
# Every duration and size setting, by name.
SETTINGS = {setting.name: setting for setting in _SETTINGS}


__all__ = ["SETTINGS", "Setting", "parse_bytes", "parse_count", "parse_seconds", "parse_switch"]
