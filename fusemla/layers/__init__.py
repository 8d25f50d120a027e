"""Model layers built on fusemla's ops: :class:`MLAAttention` (DeepSeek MLA over a paged cache).

Layers call the public ops (:func:`fusemla.mla_prologue`) and the plain-PyTorch references; they
contain no Triton code. Importing this package does not import Triton (the ops are imported on
the first call).
"""

from fusemla.config import MLAConfig
from fusemla.layers.mla import WEIGHT_FORMATS, MLAAttention, RMSNorm, softmax_scale_from_hf_config

__all__ = ["WEIGHT_FORMATS", "MLAAttention", "MLAConfig", "RMSNorm", "softmax_scale_from_hf_config"]
