"""PyTorch to Core ML: load the base, apply an adapter with peft (fused or kept), wrap it in the
stateful export decoder, trace and convert (``coreml.convert_decoder``). Imports torch."""

__all__ = ["base_model", "calibration", "coreml", "export_decoder", "lora"]
