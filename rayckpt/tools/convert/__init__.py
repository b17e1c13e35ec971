"""Conversions between rayckpt and torch.save, DCP and safetensors (``rayckpt convert``)."""

from .core import DEFAULT_GROUP_BYTES, DEFAULT_MAX_SHARD_BYTES, FORMATS, ConvertInfo, convert, regroup_values

__all__ = ["DEFAULT_GROUP_BYTES", "DEFAULT_MAX_SHARD_BYTES", "FORMATS", "ConvertInfo", "convert", "regroup_values"]
