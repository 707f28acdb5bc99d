"""Compression of what crosses the site boundary: CER, STC and byte-exact codecs.

- ``tv.cer``: pFedNet's communication-efficient regulariser, exact in O(d).
- ``bitstream``: bit writer/reader and Golomb-Rice coding.
- ``stc``: sparse ternary compression (top-k ternarisation) and its bit stream.
- ``piecewise``: run coding of piecewise-constant vectors.
- ``codecs``: ``make_codec(name, **options)`` -> ``Codec`` returning real bytes.
"""

from medfed.compression.codecs import CODEC_NAMES, Codec, Encoding, make_codec
from medfed.compression.tv import cer, zero_solution_threshold

__all__ = ["CODEC_NAMES", "Codec", "Encoding", "cer", "make_codec", "zero_solution_threshold"]
