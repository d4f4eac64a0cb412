"""The base of every manifest block: strict, frozen, finite."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Strict(BaseModel):
    # Every number finite: a manifest's numbers reach package metadata and release files, which
    # strict JSON readers read (JSON has no NaN or infinity).
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)
