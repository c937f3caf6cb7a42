"""Proofline: prove what an agent action changed before calling it done.

``from proofline import Client`` gives the controller SDK (``proofline/client.py``); it is loaded on
first use, so importing any other part of the package stays light.
"""

from typing import Any

__all__ = ["ActionHandle", "ActionResult", "Client"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from proofline import client

        return getattr(client, name)
    raise AttributeError(f"module 'proofline' has no attribute {name!r}")
