"""Inputs, checked before any heavy work: safetensors headers, the base model, every adapter,
and the checked bundle the later stages take (``checked.check_inputs``). No torch here, but for a multimodal base's config (``text_tower``)."""

__all__ = ["adapter", "base", "calibration", "checked", "float16", "mlx_adapter", "safetensors", "text", "text_tower"]
