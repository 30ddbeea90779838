"""Test infrastructure: the loopback Hub (hubserver), tiny model builders (tiny) and every FLUX-shaped config
(configs), the library-path yardstick (reference), the one checkpoint comparison (checkpoints), the float8 checks
(fp8_checks), the offline demo. Nothing outside publisher.testing imports it."""
