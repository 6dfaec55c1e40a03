"""The conditioned coding's model 3, under the names the encoder and decoder call a model by
(encode_conditioned, decode_conditioned, work, ERRORS, as conditioned.py and
conditioned_rice.py have them).

Model 3 is model 2 (conditioned_rice.py) with each exponent's values coded by a code of its
own: a Rice code, or a canonical Huffman code over a window of WINDOW values from a base
with an escape for the rest, whichever is smaller, its table sent once per record. The
kernels live in conditioned_rice.py beside model 2's because they share its bit stream and
numba's cache keys a kernel by its own file only: kernels here calling helpers there would
keep stale machine code when those helpers change.

The stream, as model 2's (conditioned_rice.py) except where said:
- the pivot (8 bits); per class, its gap parameter (5 bits) and no value parameter;
- lo and hi (8 bits each);
- per exponent x from lo to hi: its change count m, and if m > 0: the rank of its first
  change (Rice, the class's gap parameter), then its value code: a bit, 0 for Rice (then
  the parameter, 5 bits), 1 for Huffman (then the window's base, coded as a count, and each
  of the SYMBOLS symbols' code length, 4 bits, 0 for unused; at most LENGTH_MAX);
- per changed element in position order: its coded value less one by its exponent's code
  (Huffman: the code of value - base if within the window, else the escape's code then the
  value coded as a count; codes are canonical, shorter first then by symbol, and written
  first bit first), then the gap as in model 2;
- zero bits up to the next byte.
A decoder refuses code lengths over LENGTH_MAX, a table whose lengths overfill the code
space, and a code no symbol has.
"""

from __future__ import annotations

import numpy as np

from deltarl.codecs.conditioned_rice import (
    CHANGE_COST_ELEMS,
    ERRORS,
    MODEL_EXPONENT_HUFFMAN,
    decode_records,
    encode_records,
)
from deltarl.codecs.conditioned_rice import HEADER_BITS_HUFFMAN as HEADER_BITS
from deltarl.codecs.conditioned_rice import MIN_BITS_PER_CHANGE_HUFFMAN as MIN_BITS_PER_CHANGE

MODEL = MODEL_EXPONENT_HUFFMAN

__all__ = [
    "ERRORS",
    "HEADER_BITS",
    "MIN_BITS_PER_CHANGE",
    "MODEL",
    "decode_conditioned",
    "encode_conditioned",
    "work",
]


def encode_conditioned(*args: np.ndarray | int) -> None:
    """Model 3's encoder: conditioned.encode_conditioned's arguments and results."""
    encode_records(MODEL, *args)


def decode_conditioned(*args: np.ndarray | int) -> None:
    """Model 3's decoder: conditioned.decode_conditioned's arguments, results and bounds."""
    decode_records(MODEL, *args)


def work(lengths: np.ndarray, changed: np.ndarray) -> np.ndarray:
    """Each item's cost to either kernel, in elements: what kernels.deal shares out."""
    return lengths + CHANGE_COST_ELEMS * changed
