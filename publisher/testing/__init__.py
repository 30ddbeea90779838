"""Test infrastructure: the loopback Hub, tiny model builders, the offline demo. Nothing outside publisher.testing imports it."""
