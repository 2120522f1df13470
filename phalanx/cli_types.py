"""argparse value types shared by the `phalanx` command and its `bench` subcommands.

Owns: `json_object_arg`. Lives below both command modules so neither imports the other for it.
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
