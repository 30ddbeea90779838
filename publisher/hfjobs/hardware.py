"""The Jobs hardware flavors on offer: the Hub's live list when it answers quickly, else the built-in table."""

from __future__ import annotations

import logging
import os
import threading
from typing import Literal

from publisher import flavors as flavor_table
from publisher.flavors import Flavor
from publisher.io import hub

log = logging.getLogger(__name__)

Source = Literal["hub", "builtin"]
LIST_TIMEOUT_S = 3.0  # `hf-ao-publish recipes` must stay quick when the Hub cannot be reached


def available(token: str | None = None, timeout: float = LIST_TIMEOUT_S) -> tuple[list[Flavor], Source]:
    """(flavors cheapest first, where they came from). Never raises: any failure means the built-in table."""
    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"):
        return list(flavor_table.BUILTIN), "builtin"
    found: list[Flavor] = []
    failed: list[BaseException] = []

    def fetch() -> None:
        try:
            found.extend(flavor_table.from_hub(hub.client(token).list_jobs_hardware()))
        except Exception as exc:  # reported at debug level: the table is the documented fallback
            failed.append(exc)

    # A thread, because the client's request has no timeout argument and a black-holed network would hang.
    worker = threading.Thread(target=fetch, name="jobs-hardware", daemon=True)
    worker.start()
    worker.join(timeout)
    if worker.is_alive() or failed or not found:
        log.debug("the Hub's Jobs hardware list is not available (%s); using the built-in table",
                  failed[0] if failed else "timed out" if worker.is_alive() else "empty")
        return list(flavor_table.BUILTIN), "builtin"
    return found, "hub"
