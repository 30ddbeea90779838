"""Verification: report types, full reloads, streaming checks, checks of a pushed commit, `verify TARGET`, inputs."""
