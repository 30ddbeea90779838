"""A small Hub-compatible HTTP server on loopback, for tests and the offline demo.

The unmodified huggingface_hub client (and transformers/diffusers `from_pretrained`) talk to it through
HF_ENDPOINT, with HF_HUB_DISABLE_XET=1 set before huggingface_hub is imported (LFS instead of Xet).
See /work/shared/reference/hub-http-api.md for the protocol subset.

    from publisher.testing.hubserver import HubServer, spawn_server
    with HubServer(tmp_path, tokens={"tok_alice": "alice"}, orgs={"acme": ["alice"]}) as hub:
        HfApi(endpoint=hub.url, token="tok_alice").create_repo("alice/demo")
"""

from publisher.testing.hubserver.faults import FaultInjector
from publisher.testing.hubserver.server import HubServer, spawn_server, wait_for_server
from publisher.testing.hubserver.storage import HubError, Store

__all__ = ["FaultInjector", "HubError", "HubServer", "Store", "spawn_server", "wait_for_server"]
