"""Compression rules shared by the stages: which tensors are compressed at all (size threshold,
LoRA matrices) and how ``keep_float16`` patterns match a weight's name.
"""

from __future__ import annotations

import fnmatch
import logging

log = logging.getLogger(__name__)


# Name fragments of peft's low-rank matrices once traced (``..._lora_A_default_weight``).
LORA_PATTERNS = ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B")


WEIGHT_THRESHOLD = 2048


def matches_any(const_name: str, patterns: tuple[str, ...]) -> bool:
    for pattern in patterns:
        normalized = pattern.replace(".", "_")
        if any(ch in normalized for ch in "*?["):
            if fnmatch.fnmatchcase(const_name, f"*{normalized}*"):
                return True
        elif normalized in const_name:
            return True
    return False
