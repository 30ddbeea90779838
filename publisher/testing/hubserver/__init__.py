"""A small Hub-compatible HTTP server on loopback, for tests and the offline demo.

The unmodified huggingface_hub client (and transformers/diffusers `from_pretrained`) talk to it through
HF_ENDPOINT, on the paths huggingface.co makes them take: Xet uploads and downloads (hf_xet's file-based CAS,
xet.py), ``resolve/`` redirecting LFS files to a second origin (bridge.py), multipart LFS above a threshold and
plain LFS when the client sets HF_HUB_DISABLE_XET=1 (lfs.py), rate-limit headers and fine-grained tokens
(faults.py, access.py). The protocol: the project's shared reference (hub-http-api.md, hub-real-paths.md).

    from publisher.testing.hubserver import HubServer, spawn_server
    with HubServer(tmp_path, tokens={"tok_alice": "alice"}, orgs={"acme": ["alice"]}) as hub:
        HfApi(endpoint=hub.url, token="tok_alice").create_repo("alice/demo")
"""

from publisher.testing.hubserver.faults import FaultInjector
from publisher.testing.hubserver.server import HubServer, spawn_server, wait_for_server
from publisher.testing.hubserver.storage import HubError, Store

__all__ = ["FaultInjector", "HubError", "HubServer", "Store", "spawn_server", "wait_for_server"]
