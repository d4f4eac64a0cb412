"""PyTorch, before a format converts it: load the base, apply an adapter with peft (fused or kept), wrap it in the
stateful export decoder, traced and converted by each format's ``conversion``. Imports torch."""

__all__ = ["base_model", "calibration", "export_decoder", "lora"]
