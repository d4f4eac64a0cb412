"""Inputs, checked before any heavy work: safetensors headers, the base model, every adapter,
and the checked bundle the later stages take (``checked.check_inputs``). No torch here."""

__all__ = ["adapter", "base", "calibration", "checked", "float16", "mlx_adapter", "safetensors", "text"]
