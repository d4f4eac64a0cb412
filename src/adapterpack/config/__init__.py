"""Configuration and what the tool knows: the manifest schema and its YAML loading, compression
rules, supported model families, the device table, and the rules a package must meet on a
device. Imports nothing heavier than pydantic and PyYAML."""

__all__ = ["compression", "device_rules", "devices", "families", "manifest", "names", "paths", "strict"]
