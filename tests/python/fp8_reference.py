"""FP8 (OCP e4m3 / e5m2) by brute force, in numpy float64, for the variant tests.

Every code's value is decoded from its bits; a value is rounded by finding
the nearest non-negative finite code (ties to the even code), with the
daemon's rules around it (docs/VARIANTS.md): magnitudes at or above the
largest finite value saturate to it, NaN becomes 0x7f, the sign is kept
(-0 is 0x80).
"""

import numpy as np

#: name -> (exponent bits, mantissa bits, bias, largest finite code)
FORMATS = {"e4m3": (4, 3, 7, 0x7E), "e5m2": (5, 2, 15, 0x7B)}


def decode(fmt):
    """float64 values of the 256 codes (NaN for NaN codes, +-inf for e5m2's infinities)."""
    ebits, mbits, bias, _ = FORMATS[fmt]
    out = np.empty(256)
    for code in range(256):
        sign = -1.0 if code & 0x80 else 1.0
        exp = (code >> mbits) & ((1 << ebits) - 1)
        man = code & ((1 << mbits) - 1)
        if fmt == "e4m3" and (code & 0x7F) == 0x7F:
            out[code] = np.nan
        elif fmt == "e5m2" and exp == 31:
            out[code] = sign * np.inf if man == 0 else np.nan
        elif exp == 0:
            out[code] = sign * man / (1 << mbits) * 2.0 ** (1 - bias)
        else:
            out[code] = sign * (1 + man / (1 << mbits)) * 2.0 ** (exp - bias)
    return out


def encode(values, fmt):
    """(codes as uint8, distance to the nearest midpoint relative to |value|) of float64 values.

    The distance says how close a value is to a tie between two codes; the
    daemon's fp32 arithmetic may pick the other code only where it is tiny.
    """
    _, _, _, top = FORMATS[fmt]
    table = decode(fmt)[: top + 1]  # non-negative finite values, increasing with the code
    v = np.asarray(values, dtype=np.float64)
    a = np.abs(v)
    finite = np.where(np.isnan(a), 0.0, np.minimum(a, table[-1]))
    hi = np.clip(np.searchsorted(table, finite), 1, top)
    lo = hi - 1
    dlo, dhi = finite - table[lo], table[hi] - finite
    pick_hi = (dhi < dlo) | ((dhi == dlo) & (hi % 2 == 0))
    mag = np.where(pick_hi, hi, lo)
    mag = np.where(finite >= table[-1], top, mag)
    codes = (mag | np.where(np.signbit(v), 0x80, 0)).astype(np.uint8)
    codes[np.isnan(v)] = 0x7F
    midpoint = (table[lo] + table[hi]) / 2
    closeness = np.abs(finite - midpoint) / np.maximum(finite, np.finfo(np.float64).tiny)
    closeness[(a >= table[-1]) | np.isnan(v)] = np.inf
    return codes, closeness


def check_codes(what, got, ref_values, fmt, near=1e-5, max_share=0.01):
    """got (uint8 codes) equals encode(ref_values) except near ties, by one code at most.

    near: how close to a midpoint (relative to |value|) a value must be for
    the fp32 computation to be allowed the neighbouring code.
    """
    want, closeness = encode(ref_values, fmt)
    got = np.asarray(got, dtype=np.uint8).reshape(want.shape)
    differ = got != want
    if not differ.any():
        return 0
    bad = differ & ~(closeness <= near)
    step = np.abs(got.astype(np.int32) - want.astype(np.int32))
    assert not bad.any(), "%s: %d codes differ away from a tie, e.g. got 0x%02x want 0x%02x " \
        "for %r" % (what, int(bad.sum()), got[bad][0], want[bad][0], ref_values.ravel()[
            np.flatnonzero(bad.ravel())[0]])
    assert (step[differ] == 1).all(), "%s: a near-tie code is off by more than one" % what
    assert differ.mean() <= max_share, "%s: %d of %d codes differ" % (what, int(differ.sum()),
                                                                       differ.size)
    return int(differ.sum())
