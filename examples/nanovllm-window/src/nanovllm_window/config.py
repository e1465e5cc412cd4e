"""Options of the ``window`` policy; selection-string keys are checked against these fields."""

from __future__ import annotations

import attrs


def _int_at_least(minimum: int):
    def check(_inst, attribute, value) -> None:
        if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
            raise ValueError(f"{attribute.name} must be an int >= {minimum}, got {value!r}")

    return check


@attrs.define(frozen=True)
class WindowConfig:
    """``sink_blocks``: leading blocks always attended to (the attention sinks).
    ``recent_blocks``: trailing history blocks attended to; at least 1, because in decode the last
    history block holds the token being decoded."""

    sink_blocks: int = attrs.field(default=1, validator=_int_at_least(0))
    recent_blocks: int = attrs.field(default=4, validator=_int_at_least(1))
