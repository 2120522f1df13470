"""argparse value types shared by the `phalanx` command and its `bench` subcommands.

Owns: `json_object_arg`, `non_negative_float`. Lives below both command modules so neither imports the other for it.
"""

from __future__ import annotations

import argparse
import json


def json_object_arg(text: str) -> dict:
    """argparse type for flags that take a JSON object (e.g. --speculative-config)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e}): {text!r}") from e
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def non_negative_float(text: str) -> float:
    """argparse type for a number of seconds where 0 means off (e.g. --log-stats-interval)."""
    try:
        value = float(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from e
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0 (0 = off), got {text!r}")
    return value
