"""Conversions between rayckpt and torch.save, DCP and safetensors (``rayckpt convert``).

``core`` holds ``convert()`` and the table that sends each format to its module,
``common`` what every format shares (``ConvertInfo`` and the export helpers),
``streaming`` writes imports as rayckpt checkpoints, and ``torch_file``, ``dcp_dir`` and
``safetensors_files`` each own one format.
"""

from .core import DEFAULT_GROUP_BYTES, DEFAULT_MAX_SHARD_BYTES, FORMATS, ConvertInfo, convert
from .dcp_dir import regroup_values

__all__ = ["DEFAULT_GROUP_BYTES", "DEFAULT_MAX_SHARD_BYTES", "FORMATS", "ConvertInfo", "convert", "regroup_values"]
