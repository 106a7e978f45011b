"""apex.normalization, computed by the normd daemon (see fused_layer_norm)."""

from .fused_layer_norm import (FusedLayerNorm, FusedLayerNormAffineFunction,
                               FusedLayerNormAffineMixedDtypesFunction, FusedLayerNormFunction,
                               FusedRMSNorm, FusedRMSNormAffineFunction,
                               FusedRMSNormAffineMixedDtypesFunction, FusedRMSNormFunction,
                               MixedFusedLayerNorm, MixedFusedRMSNorm, fused_layer_norm,
                               fused_layer_norm_affine, fused_rms_norm, fused_rms_norm_affine,
                               mixed_dtype_fused_layer_norm_affine,
                               mixed_dtype_fused_rms_norm_affine)

__all__ = [
    "FusedLayerNorm", "FusedRMSNorm", "MixedFusedLayerNorm", "MixedFusedRMSNorm",
    "fused_layer_norm_affine", "fused_layer_norm", "fused_rms_norm_affine", "fused_rms_norm",
    "mixed_dtype_fused_layer_norm_affine", "mixed_dtype_fused_rms_norm_affine",
    "FusedLayerNormAffineFunction", "FusedLayerNormFunction", "FusedRMSNormAffineFunction",
    "FusedRMSNormFunction", "FusedLayerNormAffineMixedDtypesFunction",
    "FusedRMSNormAffineMixedDtypesFunction",
]

# The norm variants (issue 19; docs/VARIANTS.md): residual add, weight offsets, FP8 output.
from .fused_add import (FusedAddLayerNorm, FusedAddRMSNorm, fused_add_layer_norm,  # noqa: E402
                        fused_add_layer_norm_, fused_add_rms_norm, fused_add_rms_norm_)
from .variants import (FusedLayerNormOffset, FusedNormVariantFunction,  # noqa: E402
                       FusedRMSNormOffset, fused_layer_norm_fp8, fused_layer_norm_offset,
                       fused_rms_norm_fp8, fused_rms_norm_offset, set_variant_fallback,
                       variant_fallback)

__all__ += [
    "FusedAddLayerNorm", "FusedAddRMSNorm", "fused_add_layer_norm", "fused_add_layer_norm_",
    "fused_add_rms_norm", "fused_add_rms_norm_", "FusedLayerNormOffset", "FusedRMSNormOffset",
    "fused_layer_norm_offset", "fused_rms_norm_offset", "fused_layer_norm_fp8",
    "fused_rms_norm_fp8", "FusedNormVariantFunction", "variant_fallback", "set_variant_fallback",
]
