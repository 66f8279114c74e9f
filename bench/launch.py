"""--launch NAME=VALUE options of the GPU benches: changes to the Triton core's LaunchConfig for A/B runs."""

from __future__ import annotations

import ast


def launch_overrides(items: list[str]) -> dict:
    """--launch NAME=VALUE items as LaunchConfig field changes; VALUE a Python literal (8, (64, 64, 4, 3)) or a
    bare word (by_block). Field names and values are checked by LaunchConfig itself when it is built."""
    out = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name.strip():
            raise ValueError(f"--launch: expected NAME=VALUE, got {item!r}")
        try:
            out[name.strip()] = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError):
            out[name.strip()] = value.strip()
    return out
