"""Naming element types: normd's DType from strings, numpy dtypes and torch dtypes.

Neither numpy nor torch is imported here: objects are recognised by name.
"""

from ._lib import DType

_NAMES = {
    "f32": DType.F32, "fp32": DType.F32, "float32": DType.F32, "float": DType.F32,
    "f16": DType.F16, "fp16": DType.F16, "float16": DType.F16, "half": DType.F16,
    "bf16": DType.BF16, "bfloat16": DType.BF16,
    # bf16 data lives in numpy as uint16 bit patterns (normd.host.to_bf16).
    "uint16": DType.BF16,
    # FP8, only ever a job's y_dtype (normd.job_ext); uint8 bit patterns in numpy.
    "f8e4m3": DType.F8E4M3, "e4m3": DType.F8E4M3, "float8_e4m3fn": DType.F8E4M3,
    "f8e5m2": DType.F8E5M2, "e5m2": DType.F8E5M2, "float8_e5m2": DType.F8E5M2,
}

#: Bytes per element of each dtype.
ITEMSIZE = {DType.F32: 4, DType.F16: 2, DType.BF16: 2, DType.F8E4M3: 1, DType.F8E5M2: 1}


def to_dtype(spec):
    """DType for a DType/int, a name ("bf16", "float32"...), a numpy or a torch dtype.

    Raises TypeError for anything normd does not compute in (float64, ints...).
    """
    if isinstance(spec, DType):
        return spec
    if isinstance(spec, int) and not isinstance(spec, bool):
        return DType(spec)
    if isinstance(spec, str):
        name = spec
    elif isinstance(spec, type):  # numpy scalar types such as numpy.float32
        name = spec.__name__
    else:  # numpy dtypes have .name; torch dtypes print as "torch.float32"
        name = str(getattr(spec, "name", spec))
    name = name.lower().replace("torch.", "")
    try:
        return _NAMES[name]
    except KeyError:
        raise TypeError("normd computes in float32, float16 and bfloat16 (bf16 as uint16 in "
                        "numpy; FP8 output f8e4m3/f8e5m2 as uint8); %r is none of them"
                        % (spec,)) from None


def dtype_of(obj):
    """The DType of a numpy array or torch tensor (None for anything else)."""
    dt = getattr(obj, "dtype", None)
    if dt is None:
        return None
    return to_dtype(dt)
